"""The image evaluation: the synthetic set's masks, masks mapped onto token cells, per-sample AUC-PR against
sklearn, and `macs-kernels eval --images` end to end on a small random LLaVA."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import average_precision_score

from macs_kernels import explain
from macs_kernels.api.vision import ImageTokens
from macs_kernels.apps.cli import main
from macs_kernels.apps.evaluation.images import (
    cell_labels,
    load_image_set,
    object_mask,
    score_explanation,
    summarise,
    synthetic_set,
)
from tests.api.vision.tiny import tiny_vlm


def test_synthetic_set_masks_mark_the_pasted_shape(tmp_path):
    samples = synthetic_set(tmp_path, count=3, size=(40, 30), seed=2)
    assert [s.name for s in samples] == ["000-ellipse", "001-rectangle", "002-triangle"]
    assert load_image_set(tmp_path) == samples
    for sample in samples:
        pixels = np.asarray(Image.open(sample.image)).astype(int)
        mask = object_mask(sample, (40, 30))
        assert 0.02 < mask.mean() < 0.3
        # The shape has one colour; the noisy background hardly ever takes it.
        colours = pixels[mask]
        assert (colours == colours[0]).all()
        assert (np.abs(pixels[~mask] - colours[0]).sum(-1) > 0).mean() > 0.99


def test_cell_labels_follow_the_box_and_threshold():
    mask = np.zeros((8, 12), dtype=bool)
    mask[0:4, 0:3] = True  # three quarters of the top-left 4 x 4 cell
    tokens = ImageTokens(tuple(range(6)), (2, 3), (0.0, 0.0, 12.0, 8.0), (12, 8))
    assert cell_labels(tokens, mask, 0.5).tolist() == [1, 0, 0, 0, 0, 0]
    assert cell_labels(tokens, mask, 0.8).tolist() == [0] * 6
    # A box reaching past the image (padding to a square): cells are 16 / 3 wide, the outside is background.
    padded = ImageTokens(tuple(range(9)), (3, 3), (-2.0, -4.0, 14.0, 12.0), (12, 8))
    assert cell_labels(padded, np.ones((8, 12), dtype=bool), 0.5).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_box_samples(tmp_path):
    Image.new("RGB", (10, 6)).save(tmp_path / "a.png")
    (tmp_path / "samples.jsonl").write_text(json.dumps({"image": "a.png", "box": [2, 1, 5, 4]}) + "\n")
    (sample,) = load_image_set(tmp_path)
    mask = object_mask(sample, (10, 6))
    assert mask.sum() == 9 and mask[1:4, 2:5].all()
    (tmp_path / "samples.jsonl").write_text(json.dumps({"image": "a.png"}) + "\n")
    with pytest.raises(ValueError, match="exactly one of mask and box"):
        load_image_set(tmp_path)


def test_scores_equal_sklearn(tmp_path):
    model, processor = tiny_vlm("llava")
    (sample,) = synthetic_set(tmp_path, count=1, size=(32, 32), seed=3)
    explanation = explain(model, processor, sample.prompt, images=str(sample.image), max_new_tokens=4,
                          backend="torch")
    labels = cell_labels(explanation.images[0], object_mask(sample, (32, 32)))
    assert 0 < labels.sum() < labels.size
    result = score_explanation(explanation, labels)
    positions = list(explanation.images[0].positions)
    per_step = [average_precision_score(labels, row[positions].numpy()) for row in explanation.step_log_c]
    assert result["per_step"] == pytest.approx(per_step, abs=1e-12)
    assert result["best"] == pytest.approx(max(per_step)) and result["best_step"] == int(np.argmax(per_step))
    assert result["whole_answer"] == pytest.approx(
        average_precision_score(labels, explanation.scores[positions].numpy()))


def test_summary_intervals():
    results = [{"best": b, "whole_answer": w, "positive_cells": 2, "cells": 8}
               for b, w in [(0.5, 0.4), (0.7, 0.2), (0.9, 0.3)]] + [{"skipped": "no cell"}]
    summary = summarise(results)
    assert summary["scored"] == 3 and summary["skipped"] == 1 and summary["random_baseline"] == 0.25
    # Student-t: mean 0.7, s = 0.2, t(0.975, 2) = 4.303
    assert summary["best"]["mean"] == pytest.approx(0.7)
    assert summary["best"]["ci95"] == pytest.approx([0.7 - 4.3027 * 0.2 / 3 ** 0.5, 0.7 + 4.3027 * 0.2 / 3 ** 0.5],
                                                    abs=1e-3)


def test_eval_command_on_the_synthetic_set(tmp_path, capsys):
    model, processor = tiny_vlm("llava")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    synthetic_set(tmp_path / "data", count=3, size=(32, 32), seed=4)
    out = tmp_path / "results.jsonl"
    argv = ["eval", "--images", str(tmp_path / "data"), "--model", str(folder), "--out", str(out),
            "--max-new-tokens", "3", "--backend", "torch"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["000-ellipse", "001-rectangle", "002-triangle"]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    scored = [line for line in lines if "skipped" not in line]
    assert summary["scored"] == len(scored) > 0
    assert summary["best"]["mean"] == pytest.approx(np.mean([line["best"] for line in scored]))
    assert "AUC-PR, best step" in capsys.readouterr().out
    # A second run resumes: nothing is recomputed, nothing appended.
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 3
    with pytest.raises(SystemExit, match="other settings"):
        main([*argv[:-4], "--max-new-tokens", "4", "--backend", "torch"])
