"""Prompts with images through the model's processor: the token ids, the tensors generate passes the vision tower
(pixel_values, image_grid_thw, token type ids), and where each image's tokens lie."""
from __future__ import annotations

import os

from macs_kernels.api.prompts import is_messages
from macs_kernels.api.vision.layout import QWEN_TYPES, image_layouts, model_type

# Processor outputs that are the prompt itself; the rest go to generate as the model's image inputs.
_PROMPT_KEYS = ("input_ids", "attention_mask")


def load_image(image):
    """A PIL RGB image from a PIL image or a path."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as opened:
            return opened.convert("RGB")
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    raise TypeError(f"an image must be a PIL image or a path, got {type(image).__name__}")


def _per_prompt(images, prompts: int, batched: bool) -> list[list]:
    """Per prompt its list of images: one image or a list for a single prompt; for a batch, one entry (an image
    or a list of images) per prompt."""
    if not batched:
        images = [images]
    if not isinstance(images, (list, tuple)) or len(images) != prompts:
        raise ValueError(f"images: give one entry (an image or a list of images) per prompt; {prompts} prompts")
    per_prompt = [list(entry) if isinstance(entry, (list, tuple)) else [entry] for entry in images]
    if not any(per_prompt):
        raise ValueError("images is empty: give at least one image, or explain without images=")
    return [[load_image(image) for image in entry] for entry in per_prompt]


def placeholder(processor, model_config) -> str:
    """The text that stands for one image in a prompt, which the processor expands into the image's tokens (used
    when the processor has no chat template to write it)."""
    if model_type(model_config) in QWEN_TYPES:  # as its chat template writes it (transformers 4.x finds images by it)
        return f"<|vision_start|>{processor.image_token}<|vision_end|>"
    return getattr(processor, "boi_token", None) or processor.image_token


def _prompt_text(processor, model_config, prompt, count: int) -> tuple[str, bool]:
    """(text with the images' placeholders, whether a chat template made it)."""

    tokenizer = processor.tokenizer
    if is_messages(prompt):
        if not getattr(processor, "chat_template", None):
            raise ValueError("chat messages with images need the processor's chat template; this processor has none: "
                             "give the prompt as a string")
        return processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), True
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("a prompt with images must be a non-empty string or a list of chat messages")
    if getattr(processor, "chat_template", None):
        content = [{"type": "image"}] * count + [{"type": "text", "text": prompt}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False), True
    text = placeholder(processor, model_config) * count + prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False), True
    return text, False


def encode_image_prompts(processor, model, prompt, images):
    """(input_ids (B, N_max) left-padded, attention_mask, batched, image inputs for generate, per prompt its
    ImageTokens) of prompts with images, through the model's processor (its chat template when it has one, else
    the tokenizer's around the images' placeholders and the text)."""

    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise TypeError(f"prompts with images need the model's processor (image processor and tokenizer), got "
                        f"{type(processor).__name__}")
    config = model.config
    model_type(config)
    batched = isinstance(prompt, list) and not is_messages(prompt)
    prompts = prompt if batched else [prompt]
    per_prompt = _per_prompt(images, len(prompts), batched)
    texts, templated = zip(*(_prompt_text(processor, config, p, len(i)) for p, i in zip(prompts, per_prompt)))
    encoded = processor(text=list(texts), images=per_prompt,
                        return_tensors="pt", padding=True, padding_side="left", add_special_tokens=not any(templated))
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    inputs = {key: value for key, value in encoded.items() if key not in _PROMPT_KEYS}
    layouts = image_layouts(config, processor.image_processor, ids, mask, inputs, per_prompt)
    return ids, mask, batched, inputs, layouts
