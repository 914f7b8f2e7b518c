"""What the image path refuses before any work, naming the reason."""
from __future__ import annotations

import types

import pytest

from macs_kernels import attach, explain
from macs_kernels.api.vision import encode_image_prompts
from tests.api.vision.tiny import random_image, tiny_vlm


def _no_generate(monkeypatch, model):
    def generate(*args, **kwargs):
        raise AssertionError("generate ran")

    monkeypatch.setattr(model, "generate", generate)


def test_language_model_outside_the_attention_interface(monkeypatch):
    model, processor = tiny_vlm("llava")
    # The top-level class says it supports the interface; its language model does not.
    monkeypatch.setattr(type(model.get_decoder()), "_supports_attention_backend", False)
    _no_generate(monkeypatch, model)
    with pytest.raises(TypeError, match=r"language model \(LlamaModel\) does not run its attention through"):
        explain(model, processor, "What is this?", images=random_image(16, 16))
    with pytest.raises(TypeError, match="LlamaModel"), attach(model):
        pass


def test_video_inputs():
    model, processor = tiny_vlm("qwen2_5_vl")
    ids, mask, _, inputs, _ = encode_image_prompts(processor, model, "What is this?", random_image(16, 16))
    videos = {"pixel_values_videos": inputs["pixel_values"], "video_grid_thw": inputs["image_grid_thw"]}
    with attach(model, backend="torch") as tracer, pytest.raises(NotImplementedError, match="video inputs"):
        model.generate(input_ids=ids, attention_mask=mask, **videos, max_new_tokens=2)
    assert not tracer.passes


def test_images_on_continuous_batching(monkeypatch):
    model, processor = tiny_vlm("gemma3")
    monkeypatch.setattr(model, "generate_batch", lambda *args, **kwargs: pytest.fail("generate_batch ran"))
    with pytest.raises(NotImplementedError, match="continuous-batching engine"):
        explain(model, processor, "What is this?", images=random_image(16, 16), continuous_batching=True)


def test_unknown_image_layout():
    _, processor = tiny_vlm("llava")
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="idefics3"))
    with pytest.raises(NotImplementedError, match="no image-token layout for model type 'idefics3'"):
        encode_image_prompts(processor, model, "What is this?", random_image(16, 16))


def test_images_need_a_processor(monkeypatch):
    model, processor = tiny_vlm("llava")
    _no_generate(monkeypatch, model)
    with pytest.raises(TypeError, match="need the model's processor"):
        explain(model, processor.tokenizer, "What is this?", images=random_image(16, 16))


def test_image_count_per_prompt(monkeypatch):
    model, processor = tiny_vlm("llava")
    _no_generate(monkeypatch, model)
    with pytest.raises(ValueError, match="one entry .* per prompt; 2 prompts"):
        explain(model, processor, ["a", "b"], images=[random_image(16, 16)])


def test_llava_full_feature_strategy(monkeypatch):
    model, processor = tiny_vlm("llava")
    monkeypatch.setattr(model.config, "vision_feature_select_strategy", "full")
    with pytest.raises(NotImplementedError, match="CLS token"):
        encode_image_prompts(processor, model, "What is this?", random_image(16, 16))
