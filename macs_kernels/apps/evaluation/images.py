"""The MACS paper's image evaluation (appendix B): per image, AUC-PR of the image tokens' scores against the
object's mask mapped onto the token grid; the best step's and the whole answer's, with 95% intervals over images.

A data set is a folder with `samples.jsonl`: one line per image, {"image": PATH, "mask": PATH} (a PNG whose
non-zero pixels are the object) or {"image": PATH, "box": [left, top, right, bottom]} (pixels), paths relative to
the folder, and an optional "prompt" (default: the paper's "What is in the image?"). A token cell is the object's
when at least `threshold` of its area lies in the mask (area the image processor padded counts as background).
`synthetic_set` writes a small such set: shapes pasted on textured backgrounds, their masks known.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

PAPER_PROMPT = "What is in the image?"
DEFAULT_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class ImageSample:
    name: str
    image: Path
    mask: Path | None = None
    box: tuple[float, float, float, float] | None = None
    prompt: str = PAPER_PROMPT


def load_image_set(folder) -> list[ImageSample]:
    """The samples of a data set folder (its samples.jsonl), each image and mask checked to exist."""
    folder = Path(folder)
    manifest = folder / "samples.jsonl"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest}: no such file (an image data set folder holds samples.jsonl)")
    samples = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        where = f"{manifest}:{number}"
        if "image" not in entry or ("mask" in entry) == ("box" in entry):
            raise ValueError(f"{where}: give an image and exactly one of mask and box")
        image = folder / entry["image"]
        mask = folder / entry["mask"] if "mask" in entry else None
        for path in (image, mask):
            if path is not None and not path.is_file():
                raise FileNotFoundError(f"{where}: {path} does not exist")
        box = tuple(float(v) for v in entry["box"]) if "box" in entry else None
        if box is not None and (len(box) != 4 or box[0] >= box[2] or box[1] >= box[3]):
            raise ValueError(f"{where}: box must be [left, top, right, bottom] with left < right, top < bottom")
        samples.append(ImageSample(entry.get("name", entry["image"]), image, mask, box,
                                   entry.get("prompt", PAPER_PROMPT)))
    if not samples:
        raise ValueError(f"{manifest} lists no samples")
    return samples


def object_mask(sample: ImageSample, size: tuple[int, int]) -> np.ndarray:
    """(height, width) bool: the object's pixels in an image of `size` (width, height)."""
    width, height = size
    if sample.box is not None:
        mask = np.zeros((height, width), dtype=bool)
        left, top, right, bottom = (round(v) for v in sample.box)
        mask[max(top, 0):max(bottom, 0), max(left, 0):max(right, 0)] = True
        return mask
    from PIL import Image

    with Image.open(sample.mask) as opened:
        mask = np.asarray(opened.convert("L")) > 0
    if mask.shape != (height, width):
        raise ValueError(f"{sample.mask}: the mask is {mask.shape[1]} x {mask.shape[0]}, the image {width} x {height}")
    return mask


def cell_labels(tokens, mask: np.ndarray, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
    """(rows * cols,) 0/1 in token order: whether at least `threshold` of a token cell's area is the object's. The
    cells split the layout's box evenly; the part of a cell outside the image is background."""
    rows, cols = tokens.grid
    left, top, right, bottom = tokens.box
    cell_w, cell_h = (right - left) / cols, (bottom - top) / rows
    height, width = mask.shape
    labels = np.zeros(rows * cols, dtype=np.int64)
    for row in range(rows):
        y0, y1 = (min(max(round(top + k * cell_h), 0), height) for k in (row, row + 1))
        for col in range(cols):
            x0, x1 = (min(max(round(left + k * cell_w), 0), width) for k in (col, col + 1))
            inside = int(mask[y0:y1, x0:x1].sum())
            labels[row * cols + col] = inside >= threshold * cell_w * cell_h
    return labels


def score_explanation(explanation, labels: np.ndarray, image: int = 0) -> dict:
    """The paper's per-sample AUC-PR over one image's tokens: per step (ranked by log c, which ranks as the step's
    z-scores do without their ties), its best step, and the whole answer's (Explanation.scores)."""
    from macs_kernels.apps.evaluation.metrics import auc_pr_sample

    positions = list(explanation.images[image].positions)
    result = auc_pr_sample(explanation.step_log_c[:, positions].double().clamp_min(-1e30).numpy(), [labels],
                           aggregate=explanation.scores[positions].double().clamp_min(-1e30).numpy())
    return {"best": result["best"], "best_step": result["best_step"], "whole_answer": result["aggregate"],
            "per_step": result["per_step"], "positive_cells": int(labels.sum()), "cells": int(labels.size)}


def evaluate_sample(model, processor, sample: ImageSample, *, max_new_tokens: int = 16,
                    threshold: float = DEFAULT_THRESHOLD, **config) -> dict:
    """One greedy explain() of the sample's prompt about its image, scored against its mask (score_explanation);
    a sample whose mask reaches no token cell is marked skipped (its AUC-PR is undefined)."""
    from macs_kernels.api.explanation import explain
    from macs_kernels.api.vision.inputs import load_image

    image = load_image(sample.image)
    labels = object_mask(sample, image.size)  # checked before generating
    explanation = explain(model, processor, sample.prompt, images=image, max_new_tokens=max_new_tokens, **config)
    labels = cell_labels(explanation.images[0], labels, threshold)
    result = {"name": sample.name, "answer": explanation.text, "threshold": threshold}
    if not labels.any():
        return result | {"skipped": "no token cell reaches the mask threshold"}
    return result | score_explanation(explanation, labels)


def evaluate_images(model, processor, samples, *, done: dict | None = None, on_result=None, **options) -> list[dict]:
    """evaluate_sample over `samples` (options: its keywords and MacsConfig's). done: results already computed, by
    sample name (kept, not recomputed); on_result(result) is called after each new one (to append it to a file)."""
    results = []
    for sample in samples:
        if done and sample.name in done:
            results.append(done[sample.name])
            continue
        result = evaluate_sample(model, processor, sample, **options)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def summarise(results: list[dict]) -> dict:
    """Mean AUC-PR of the best step and of the whole answer with 95% intervals, over the scored samples."""
    from macs_kernels.apps.evaluation.metrics import mean_ci

    scored = [r for r in results if "skipped" not in r]
    summary = {"samples": len(results), "scored": len(scored), "skipped": len(results) - len(scored)}
    if not scored:
        return summary
    for key in ("best", "whole_answer"):
        mean, *interval = mean_ci([r[key] for r in scored])
        # One sample has no interval (nan): JSON has no nan, so null.
        summary[key] = {"mean": mean, "ci95": [None if math.isnan(v) else v for v in interval]}
    # A random ranking's expected AUC-PR is about the share of object cells.
    summary["random_baseline"] = float(np.mean([r["positive_cells"] / r["cells"] for r in scored]))
    return summary


def synthetic_set(folder, count: int = 8, size: tuple[int, int] = (64, 48), seed: int = 0) -> list[ImageSample]:
    """Write `count` images of `size` (width, height) to `folder`: a textured background (noise over a colour
    gradient) with one filled shape (ellipse, rectangle or triangle) pasted at a random place, its mask beside it
    (NAME.mask.png) and samples.jsonl listing them. Returns the samples."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    lines = []
    for index in range(count):
        gradient = np.linspace(0, 1, width)[None, :, None] * rng.uniform(0, 255, 3) + rng.uniform(0, 128, 3)
        background = np.clip(gradient + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)
        image = Image.fromarray(background)
        mask = Image.new("L", size, 0)
        shape_w, shape_h = (int(rng.integers(extent // 4, extent // 2)) for extent in size)
        x0, y0 = int(rng.integers(0, width - shape_w)), int(rng.integers(0, height - shape_h))
        outline = (x0, y0, x0 + shape_w, y0 + shape_h)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = ("ellipse", "rectangle", "triangle")[index % 3]
        for canvas, fill in ((ImageDraw.Draw(image), colour), (ImageDraw.Draw(mask), 255)):
            if kind == "triangle":
                canvas.polygon([(x0, y0 + shape_h), (x0 + shape_w / 2, y0), (x0 + shape_w, y0 + shape_h)], fill=fill)
            else:
                getattr(canvas, kind)(outline, fill=fill)
        name = f"{index:03d}-{kind}"
        image.save(folder / f"{name}.png")
        mask.save(folder / f"{name}.mask.png")
        lines.append({"name": name, "image": f"{name}.png", "mask": f"{name}.mask.png"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return load_image_set(folder)
