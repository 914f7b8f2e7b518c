"""Small random vision-language models of four families with processors built from local pieces: the default
model's tokenizer with the family's image tokens added, and the family's slow (PIL) image processor. The Gemma 3 and
LLaVA processors carry a multimodal chat template (explain() goes through it); the Qwen ones have none (explain()
wraps the image placeholders and the text in the tokenizer's chat template)."""
from __future__ import annotations

import functools

import numpy as np
import torch
from PIL import Image

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "gemma3", "llava")


@functools.cache
def _base_tokenizer():
    from macs_kernels.api.models import load_tokenizer

    return load_tokenizer()


def _tokenizer(tokens: list[str]):
    import copy

    tokenizer = copy.deepcopy(_base_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def _ids(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(token) for token in tokens]


def _text(tokenizer, **extra) -> dict:
    # Peaked attention (initializer_range 0.2): near-uniform rows make z-scores of nearly equal values.
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                **extra)


def _qwen(version: str):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[version]
    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    start, image, video = _ids(tokenizer, "<|vision_start|>", "<|image_pad|>", "<|video_pad|>")

    class ImageProcessorOnly(getattr(transformers, f"{prefix}Processor")):
        """The Qwen-VL processor without its video processor, which needs torchvision (not installed here)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = image, video
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    image_processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                               max_pixels=32 * 32)
    vision = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    vision |= (dict(embed_dim=32, hidden_size=32, mlp_ratio=2) if version == "qwen2_vl" else
               dict(hidden_size=32, intermediate_size=64, out_hidden_size=32, window_size=8, fullatt_block_indexes=[1]))
    config = getattr(transformers, f"{prefix}Config")(
        text_config=_text(tokenizer, head_dim=8,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=vision, image_token_id=image, video_token_id=video, vision_start_token_id=start,
    )
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    return model, ImageProcessorOnly(image_processor, tokenizer)


def _gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    boi, eoi, image = _ids(tokenizer, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = ("<start_of_image>", "<end_of_image>",
                                                                       "<image_soft_token>")
    tokenizer.boi_token_id, tokenizer.image_token_id = boi, image
    config = Gemma3Config(
        # One sliding-window layer (window 6, shorter than the prompts) and one full layer.
        text_config=_text(tokenizer, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_id=image, boi_token_id=boi, eoi_token_id=eoi,
    )
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 16, "width": 16}), tokenizer,
                                chat_template=chat_template("<start_of_image>"), image_seq_length=4)
    model = Gemma3ForConditionalGeneration(config)
    # Gemma 3 initialises its image projection to zeros: every image token would embed alike.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model, processor


def _llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    (image,) = _ids(tokenizer, "<image>")
    config = LlavaConfig(
        text_config=dict(model_type="llama", **_text(tokenizer)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32),
        image_token_id=image, vision_feature_layer=-1,
    )
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor, tokenizer, patch_size=4, vision_feature_select_strategy="default",
                               chat_template=chat_template("<image>"), num_additional_image_tokens=1)
    return LlavaForConditionalGeneration(config), processor


def chat_template(placeholder: str) -> str:
    """A chat template that renders content lists, an image part as the model's placeholder (as real VLM
    processors' templates do)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
            "{% if part['type'] == 'image' %}" + placeholder + "{% else %}{{ part['text'] }}{% endif %}"
            "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def tiny_vlm(family: str):
    """(model, processor) of a small random model of `family` (FAMILIES), eval mode, float32."""
    torch.manual_seed(0)
    builders = {"qwen2_5_vl": lambda: _qwen("qwen2_5_vl"), "qwen2_vl": lambda: _qwen("qwen2_vl"), "gemma3": _gemma3,
                "llava": _llava}
    model, processor = builders[family]()
    return model.eval(), processor


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@torch.no_grad()
def eager_vlm_log_c(model, prompt_ids: torch.Tensor, image_inputs: dict, generated_ids: torch.Tensor) -> torch.Tensor:
    """(steps, N) float64 log c recomputed independently: one eager forward with output_attentions over the prompt
    (with its images) and the generated tokens but the last; step k's row is the query at N - 1 + k over its causal
    prefix. Per-token inputs of the processor (token type ids) extend over the generated tokens as text (0)."""
    from macs_kernels.ops import reference

    n, full = len(prompt_ids), torch.cat([prompt_ids, generated_ids[:-1]])[None]
    inputs = {key: torch.cat([value, value.new_zeros(1, full.shape[1] - n)], dim=1)
              if value.dim() == 2 and value.shape == (1, n) else value for key, value in image_inputs.items()}
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attentions = model(full, attention_mask=torch.ones_like(full), output_attentions=True, **inputs).attentions
    finally:
        model.set_attn_implementation(previous)
    assert len(attentions) == model.config.get_text_config().num_hidden_layers
    rows = []
    for k in range(len(generated_ids)):
        query = n - 1 + k
        rows.append(reference.macs_step_reference([layer[0, :, query, : query + 1] for layer in attentions], n)[0])
    return torch.stack(rows)
