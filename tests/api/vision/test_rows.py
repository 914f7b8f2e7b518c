"""MACS over vision-language models' image tokens: explain(), stream() and attach() on small random Qwen2.5-VL
(M-RoPE), Gemma 3 (bidirectional image blocks, a sliding-window layer) and LLaVA models; every prompt token, image
tokens included, is an input, and each returned sequence's rows equal the teacher-forced eager reference
(|d log c| <= 1e-3). Only the language model's layers are traced."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import attach, explain, stream
from macs_kernels.api.vision import encode_image_prompts, image_scores
from tests.api.vision.tiny import FAMILIES, eager_vlm_log_c, random_image, tiny_vlm

LOG_TOLERANCE = 1e-3
PROMPTS = ["What is in the image?", "Describe the picture in a few words, please."]


def _images():
    # Different sizes and aspect ratios: Qwen2.5-VL gives them different token grids (2x3 and 4x2 tokens here).
    return [random_image(16, 24, seed=1), random_image(32, 16, seed=2)]


def assert_teacher_forced(model, processor, prompt, image, explanation):
    ids, _, _, inputs, layouts = encode_image_prompts(processor, model, prompt, image)
    assert torch.equal(explanation.input_ids, ids[0])
    assert explanation.images == layouts[0]
    reference = eager_vlm_log_c(model, ids[0], inputs, explanation.generated_ids)
    assert explanation.step_log_c.shape == reference.shape == (len(explanation.generated_ids), ids.shape[1])
    assert (explanation.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sample"])
def test_batch_rows_equal_teacher_forced(family, sampling, one_torch_thread):
    model, processor = tiny_vlm(family)
    images = _images()
    torch.manual_seed(3)
    explanations = explain(model, processor, PROMPTS, images=images, max_new_tokens=5, backend="torch",
                           do_sample=sampling)
    assert [len(e.generated_ids) for e in explanations] == [5, 5]
    for prompt, image, explanation in zip(PROMPTS, images, explanations):
        (tokens,) = explanation.images
        # The image's tokens are prompt inputs, and they take part in the scores.
        assert set(tokens.positions) < set(range(len(explanation.input_ids)))
        assert_teacher_forced(model, processor, prompt, image, explanation)


def test_qwen_grids_follow_image_grid_thw():
    model, processor = tiny_vlm("qwen2_5_vl")
    explanations = explain(model, processor, PROMPTS, images=_images(), max_new_tokens=2, backend="torch")
    # 16x24 pixels with 4-pixel patches merged 2x2: 2x3 tokens; 32x16: 4x2.
    assert [e.images[0].grid for e in explanations] == [(2, 3), (4, 2)]
    row = explanations[0].step_scores[1]
    grid = image_scores(explanations[0], step=1)
    positions = explanations[0].images[0].positions
    assert torch.equal(grid.flatten(), row[list(positions)])


def test_stream_rows_equal_explain():
    model, processor = tiny_vlm("qwen2_5_vl")
    image = _images()[1]
    explanation = explain(model, processor, PROMPTS[0], images=image, max_new_tokens=4, backend="torch")
    streamed = list(stream(model, processor, PROMPTS[0], images=image, max_new_tokens=4, backend="torch"))
    assert [token for token, _ in streamed] == explanation.generated_ids.tolist()
    assert torch.allclose(torch.stack([scores for _, scores in streamed]), explanation.step_scores, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_attach_traces_the_language_model_only(family):
    # The vision towers run the same attention functions; before the tracer was restricted to the language model,
    # their calls reached the tracer's registered attention and generate failed.
    model, processor = tiny_vlm(family)
    image = _images()[0]
    ids, mask, _, inputs, _ = encode_image_prompts(processor, model, PROMPTS[0], image)
    vision = model.config.vision_config._attn_implementation
    with torch.no_grad(), attach(model, backend="torch") as tracer:
        assert model.config.vision_config._attn_implementation == vision
        output = model.generate(input_ids=ids, attention_mask=mask, **inputs, max_new_tokens=3, do_sample=False)
    assert tracer.num_layers == model.config.get_text_config().num_hidden_layers
    assert model.config.get_text_config()._attn_implementation == vision  # restored
    log_c, _ = tracer.rows(0)
    generated = output[0, ids.shape[1]:]
    reference = eager_vlm_log_c(model, ids[0], inputs, generated)
    assert (log_c.double() - reference).abs().max() <= LOG_TOLERANCE


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_text_only_prompt_on_a_vision_language_model(family):
    # The processor stands in for the tokenizer; the prompt has no image tokens (Qwen's M-RoPE then counts text only).
    model, processor = tiny_vlm(family)
    explanation = explain(model, processor, PROMPTS[1], max_new_tokens=4, backend="torch")
    assert explanation.images is None
    reference = eager_vlm_log_c(model, explanation.input_ids, {}, explanation.generated_ids)
    assert (explanation.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_beams_with_images_equal_teacher_forced(family):
    # generate repeats each prompt's image inputs per beam (Qwen's by its image_grid_thw): the returned beams'
    # rows still explain their own prompt.
    model, processor = tiny_vlm(family)
    images = _images()
    explanations = explain(model, processor, PROMPTS, images=images, max_new_tokens=4, backend="torch", num_beams=3,
                           num_return_sequences=2)
    assert len(explanations) == 4
    for i, explanation in enumerate(explanations):
        assert_teacher_forced(model, processor, PROMPTS[i // 2], images[i // 2], explanation)
