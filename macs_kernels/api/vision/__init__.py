"""MACS over a vision-language model's image tokens (the MACS paper's appendix B): explain(model, processor, prompt,
images=...) traces the language model (never the vision tower); this package maps each image's token scores onto
its token grid and the image, renders the heatmap, and evaluates patch scores against object masks."""
from __future__ import annotations

from macs_kernels.api.vision.inputs import encode_image_prompts, load_image
from macs_kernels.api.vision.layout import SUPPORTED_TYPES, ImageTokens, image_layouts

__all__ = ["SUPPORTED_TYPES", "ImageTokens", "encode_image_prompts", "image_layouts", "image_scores", "load_image"]


def image_scores(explanation, step: int | None = None, how: str | None = None, image: int = 0):
    """(rows, cols) float32 scores of one image's tokens on its token grid: step `step`'s z-scores of log c
    (Explanation.step_scores), or the whole answer's score (Explanation.scores, or the aggregation named `how`)."""
    images = explanation.images
    if not images:
        raise ValueError("this explanation has no images: explain a prompt with images=")
    if not -len(images) <= image < len(images):
        raise ValueError(f"image {image} is out of range: the prompt has {len(images)} image(s)")
    return images[image].grid_of(explanation.score_row(step, how))
