"""`macs-kernels explain --image PATH --prompt TEXT --model VLM`, on a small random LLaVA saved to a folder."""
from __future__ import annotations

import json

import pytest
import torch

from macs_kernels import explain
from macs_kernels.apps.cli import main
from macs_kernels.apps.cli.images import load_vision_model
from tests.api.vision.tiny import random_image, tiny_vlm


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    model, processor = tiny_vlm("llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_explain_an_image(folder, tmp_path, capsys):
    image = tmp_path / "picture.png"
    random_image(20, 30, seed=4).save(image)
    outputs = {name: tmp_path / f"out.{name}" for name in ("json", "html", "png")}
    assert main(["explain", "--model", str(folder), "--image", str(image), "--prompt", "What is in the image?",
                 "--max-new-tokens", "3", "--backend", "torch", "--json", str(outputs["json"]), "--html",
                 str(outputs["html"]), "--heatmap", str(outputs["png"])]) == 0
    printed = capsys.readouterr().out
    assert "4 x 4 token grid" in printed and "wrote" in printed
    written = json.loads(outputs["json"].read_text())
    model, processor = load_vision_model(folder, dtype=torch.float32)
    expected = explain(model, processor, "What is in the image?", images=str(image), max_new_tokens=3,
                       backend="torch")
    assert written["images"] == [tokens.as_dict() for tokens in expected.images]
    assert torch.allclose(torch.tensor(written["step_log_c"]), expected.step_log_c, atol=1e-5)
    assert outputs["png"].read_bytes()[:4] == b"\x89PNG" and "data:image/png;base64," in outputs["html"].read_text()


@pytest.mark.parametrize("argv, message", [
    (["--image", "missing.png", "--prompt", "What?"], "--image needs --model"),
    (["--image", "missing.png", "--prompt", "What?", "--model", "."], "--image missing.png: no such file"),
    (["--image", "x.png", "--question", "q", "--context", "c", "--model", "."], "--image takes --prompt"),
    (["--prompt", "What?", "--heatmap", "out.png"], "--heatmap draws the scores over an --image"),
    (["--image", "x.png", "--prompt", "What?", "--method", "at2"], "--method at2 takes text prompts only"),
])
def test_image_arguments_refused_before_loading(argv, message, monkeypatch):
    monkeypatch.setattr("macs_kernels.apps.cli.images.load_vision_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match=message):
        main(["explain", *argv])
