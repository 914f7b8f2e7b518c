"""Scores on the image: the token grid of each image, the PNG heatmap's placement, the HTML page's payload."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from macs_kernels import explain
from macs_kernels.api.vision import image_scores
from macs_kernels.api.vision.render import heatmap_figure, save_heatmap
from tests.api.vision.tiny import random_image, tiny_vlm


@pytest.fixture(scope="module")
def explanation():
    model, processor = tiny_vlm("llava")
    return explain(model, processor, "What is in the image?", images=[random_image(16, 24, 1), random_image(20, 20, 2)],
                   max_new_tokens=3, backend="torch")


def test_grids_are_the_image_tokens_rows(explanation):
    for image, tokens in enumerate(explanation.images):
        positions = list(tokens.positions)
        assert torch.equal(image_scores(explanation, image=image).flatten(), explanation.scores[positions])
        assert torch.equal(image_scores(explanation, step=-1, image=image).flatten(),
                           explanation.step_scores[-1][positions])
        assert torch.equal(image_scores(explanation, how="mean_log_c", image=image).flatten(),
                           explanation.whole_answer("mean_log_c")[positions])
    # Both images' tokens, disjoint, in prompt order.
    first, second = (tokens.positions for tokens in explanation.images)
    assert max(first) < min(second)
    with pytest.raises(ValueError, match="image 2 is out of range"):
        image_scores(explanation, image=2)


def test_heatmap_is_drawn_over_the_box():
    grid = torch.tensor([[0.0, 1.0], [-float("inf"), 3.0]])
    figure = heatmap_figure(random_image(10, 20), grid, (4.0, -2.0, 16.0, 12.0))
    picture, heat = figure.axes[0].get_images()
    assert picture.get_extent() == [0, 20, 10, 0]
    assert heat.get_extent() == [4.0, 16.0, 12.0, -2.0]
    # -inf (an underflowed log) is drawn at the bottom of the scale.
    assert heat.get_array().tolist() == [[0.0, 1.0], [0.0, 3.0]] and heat.get_clim() == (0.0, 3.0)


def test_png_and_page(explanation, tmp_path):
    save_heatmap(explanation, tmp_path / "answer.png", image=1)
    save_heatmap(explanation, tmp_path / "step.png", step=0)
    for name in ("answer.png", "step.png"):
        with Image.open(tmp_path / name) as png:
            assert png.format == "PNG" and png.size[0] > 100
    page = explanation.to_html()
    payload = json.loads(page.split("const data = ", 1)[1].split(";\nconst answer", 1)[0].replace("<\\/", "</"))
    assert len(payload["images"]) == 2 and payload["images"][0]["src"].startswith("data:image/png;base64,")
    for picture, tokens in zip(payload["images"], explanation.images):
        assert picture["grid"] == list(tokens.grid) and picture["positions"] == list(tokens.positions)
        for step, heat in enumerate(picture["heat"]):
            row = explanation.step_scores[step][list(tokens.positions)]
            assert heat.index(1.0) == int(row.argmax()) and heat.index(0.0) == int(row.argmin())
    in_images = {i for tokens in explanation.images for i in tokens.positions}
    assert payload["text_positions"] == [i for i in range(len(explanation.input_tokens)) if i not in in_images]
    assert explanation.as_dict()["images"] == [tokens.as_dict() for tokens in explanation.images]
