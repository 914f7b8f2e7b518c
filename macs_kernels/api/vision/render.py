"""Pictures of where generated tokens looked in an image: a PNG of a score grid over the image (matplotlib) and a
self-contained HTML page where hovering a generated token paints both the image and the text prompt."""
from __future__ import annotations

import base64
import html
import io
import json
from importlib import resources

import torch

from macs_kernels.api.viz import _unit
from macs_kernels.core.scores import json_values


def _finite_limits(grid: torch.Tensor) -> tuple[float, float]:
    finite = grid[torch.isfinite(grid)]
    if finite.numel() == 0:
        return 0.0, 1.0
    low, high = float(finite.min()), float(finite.max())
    return low, high if high > low else low + 1.0


def heatmap_figure(image, grid: torch.Tensor, box, *, title: str | None = None, opacity: float = 0.55):
    """A matplotlib Figure of `image` (PIL) with the (rows, cols) score `grid` drawn over `box` (left, top, right,
    bottom in the image's pixels), coloured within the grid's own finite range (-inf, an underflowed log, at the
    bottom of the scale)."""
    from matplotlib.figure import Figure

    width, height = image.size
    left, top, right, bottom = box
    figure = Figure(figsize=(6, 6 * height / width + (0.4 if title else 0)), layout="constrained")
    axes = figure.add_subplot()
    axes.imshow(image, extent=(0, width, height, 0))
    low, high = _finite_limits(grid)
    shown = torch.nan_to_num(grid.double(), neginf=low).numpy()
    heat = axes.imshow(shown, extent=(left, right, bottom, top), cmap="inferno", alpha=opacity, vmin=low, vmax=high,
                       interpolation="nearest")
    axes.set_xlim(min(0, left), max(width, right))
    axes.set_ylim(max(height, bottom), min(0, top))
    axes.set_axis_off()
    figure.colorbar(heat, ax=axes, shrink=0.8, label="MACS score")
    if title:
        axes.set_title(title)
    return figure


def save_heatmap(explanation, path, *, step: int | None = None, how: str | None = None, image: int = 0) -> None:
    """Write a PNG of image `image`'s token scores over the image: step `step`'s, or the whole answer's."""
    from macs_kernels.api.vision import image_scores

    grid = image_scores(explanation, step=step, how=how, image=image)  # checks the image index
    tokens = explanation.images[image]
    if tokens.image is None:
        raise ValueError("the explanation does not hold the image itself (it was rebuilt from JSON?): cannot draw it")
    what = "whole answer" if step is None else f"step {step} ({explanation.generated_tokens[step]!r})"
    heatmap_figure(tokens.image, grid, tokens.box, title=f"MACS, {what}").savefig(path)


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }}
.prompt span, .answer span {{ white-space: pre-wrap; border-radius: 2px; }}
.answer span {{ cursor: pointer; padding: 0 1px; border-bottom: 2px solid #ccc; }}
.answer span.active {{ border-bottom-color: #c00; background: #fee; }}
.prompt {{ line-height: 1.7; border: 1px solid #ddd; padding: 1em; }}
.picture {{ position: relative; display: inline-block; margin: 0 1em 1em 0; }}
.picture img {{ display: block; width: 24em; image-rendering: auto; }}
.grid {{ position: absolute; display: grid; opacity: 0.6; pointer-events: none; }}
.note {{ color: #666; font-size: 0.9em; }}
</style></head><body>
<h1>{title}</h1>
<p class="note">Hover or click a generated token to see what it attended to in the image and in the text; away from
the answer, the page shows the whole-answer score (Explanation.scores). Colour: the MACS score, white at the lowest,
red at the highest, within each image's tokens and within the text's tokens; the tooltips give the score (the
z-score of log consistency).</p>
<h2>Answer</h2><div class="answer" id="answer"></div>
<h2 id="caption">Image and prompt</h2><div id="pictures"></div><div class="prompt" id="prompt"></div>
<script>
{heatmap_js}
const data = {data};
const answer = document.getElementById("answer"), caption = document.getElementById("caption");
const textCells = data.text_positions.map(i => {{
  const s = document.createElement("span"); s.textContent = data.input_tokens[i];
  document.getElementById("prompt").appendChild(s); return s; }});
const imageCells = data.images.map(picture => macsImageGrid(picture, picture.src,
                                                            document.getElementById("pictures")));
function paint(k, label) {{
  const z = k === null ? data.scores : data.step_scores[k];
  const tip = i => "score = " + (z[i] === null ? "-inf (underflow)" : z[i].toFixed(3));
  const textHeat = k === null ? data.text_heat_mean : data.text_heat[k];
  textCells.forEach((cell, j) => {{
    cell.style.background = macsHeatColour(textHeat[j]); cell.title = tip(data.text_positions[j]); }});
  data.images.forEach((picture, m) => {{
    const heat = k === null ? picture.heat_mean : picture.heat[k];
    imageCells[m].forEach((cell, j) => {{
      cell.style.background = macsHeatColour(heat[j]); cell.title = tip(picture.positions[j]); }});
  }});
  caption.textContent = "Image and prompt: " + label;
}}
macsAnswerTokens(data.generated_tokens, answer, paint);
</script></body></html>
"""


def image_page_data(explanation) -> dict:
    """The page's payload: scores, each step's heat within the text tokens and within each image's tokens."""
    step_scores, scores = explanation.step_scores, explanation.scores
    in_images = {i for tokens in explanation.images for i in tokens.positions}
    text = [i for i in range(len(explanation.input_tokens)) if i not in in_images]

    def heat(row, positions):
        return [round(w, 4) for w in _unit(row[positions])]

    return {
        "input_tokens": explanation.input_tokens,
        "generated_tokens": explanation.generated_tokens,
        "step_scores": json_values(step_scores, 4),
        "scores": json_values(scores, 4),
        "text_positions": text,
        "text_heat": [heat(row, text) for row in step_scores],
        "text_heat_mean": heat(scores, text),
        "images": [tokens.as_dict() | {
            "src": _data_url(tokens.image),
            "heat": [heat(row, list(tokens.positions)) for row in step_scores],
            "heat_mean": heat(scores, list(tokens.positions)),
        } for tokens in explanation.images],
    }


def image_html(explanation, *, title: str = "MACS attribution") -> str:
    """The page for an Explanation of a prompt with images; the images and scores are embedded."""
    if not explanation.images or any(tokens.image is None for tokens in explanation.images):
        raise ValueError("the page needs the explanation's images (explain(..., images=) keeps them)")
    payload = json.dumps(image_page_data(explanation)).replace("</", "<\\/")
    heatmap_js = (resources.files("macs_kernels") / "data" / "heatmap.js").read_text()
    return _PAGE.format(title=html.escape(title), data=payload, heatmap_js=heatmap_js)
