"""Each image token's place on the image, checked against the model itself: with the vision tower's attention
outputs zeroed, a vision token depends only on its own pixels, so changing the pixels of one grid cell (inside the
box the layout says the grid covers) must change exactly that cell's token among the embeddings the language model
receives, and changing pixels outside the box (LLaVA's centre crop) none."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from macs_kernels.api.vision import encode_image_prompts
from tests.api.vision.tiny import random_image, tiny_vlm


def _local_vision(family):
    """(a fresh model of `family` whose vision attention adds nothing, so no token mixes another's pixels, its
    processor)."""
    model, processor = tiny_vlm.__wrapped__(family)
    text = model.get_decoder()
    text_modules = {id(module) for module in text.modules()}
    for name, module in model.named_modules():
        if id(module) not in text_modules and (name.endswith("attn.proj") or name.endswith("self_attn.out_proj")):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)
    return model, processor


@torch.no_grad()
def _image_embeddings(model, processor, image) -> tuple[torch.Tensor, object]:
    """(the language model's input embeddings at the image's tokens, in layout order, the layout)."""
    ids, mask, _, inputs, layouts = encode_image_prompts(processor, model, "What is this?", image)
    seen = {}

    def read(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    hook = model.get_decoder().register_forward_pre_hook(read, with_kwargs=True)
    try:
        model(input_ids=ids, attention_mask=mask, **inputs)
    finally:
        hook.remove()
    (tokens,) = layouts[0]
    return seen["embeds"][0, list(tokens.positions)], tokens


def _changed(image, box) -> Image.Image:
    pixels = np.array(image)
    left, top, right, bottom = (round(v) for v in box)
    pixels[top:bottom, left:right] = 255 - pixels[top:bottom, left:right]
    return Image.fromarray(pixels)


@pytest.mark.parametrize("family, size", [("qwen2_5_vl", (16, 24)), ("qwen2_vl", (24, 16)), ("gemma3", (16, 16)),
                                          ("llava", (16, 24))])
def test_grid_cells_are_the_model_s_own_tokens(family, size):
    model, processor = _local_vision(family)
    image = random_image(*size, seed=5)
    base, tokens = _image_embeddings(model, processor, image)
    rows, cols = tokens.grid
    left, top, right, bottom = tokens.box
    cell_w, cell_h = (right - left) / cols, (bottom - top) / rows
    for row, col in [(0, 0), (0, cols - 1), (rows - 1, 0)]:
        # The cell's interior: resampling at the border may reach a neighbour.
        cell = (left + col * cell_w + 1, top + row * cell_h + 1, left + (col + 1) * cell_w - 1,
                top + (row + 1) * cell_h - 1)
        changed, _ = _image_embeddings(model, processor, _changed(image, cell))
        moved = (changed - base).abs().amax(-1).reshape(rows, cols) > 1e-5
        expected = torch.zeros(rows, cols, dtype=torch.bool)
        expected[row, col] = True
        assert torch.equal(moved, expected), (row, col, moved)


def test_llava_crop_leaves_the_sides_out():
    model, processor = _local_vision("llava")
    image = random_image(16, 24, seed=6)
    base, tokens = _image_embeddings(model, processor, image)
    assert tokens.box == (4.0, 0.0, 20.0, 16.0)  # 16 x 24 resized to shortest edge 16, centre crop 16 x 16
    changed, _ = _image_embeddings(model, processor, _changed(image, (0, 0, 3, 16)))
    assert torch.equal(changed, base)
