"""Where each image's tokens lie in a prompt and which part of the image each covers, following the model's own
merge of vision patches into language tokens:

- Qwen2-VL / Qwen2.5-VL: the image, resized to a multiple of patch_size * spatial_merge_size (aspect kept), gives
  image_grid_thw = (1, h, w) patches; each token merges spatial_merge_size**2 neighbouring patches, the tokens in
  raster order over an (h / merge, w / merge) grid;
- Gemma 3: the image, resized to the vision tower's square, gives a patch grid average-pooled to
  mm_tokens_per_image tokens, a sqrt(mm_tokens_per_image)-sided square in raster order;
- LLaVA: the image (padded to a square when the image processor pads, resized, centre-cropped) gives
  (image_size / patch_size)**2 patch tokens in raster order (the "default" feature strategy drops CLS).
"""
from __future__ import annotations

import dataclasses
import math

import torch

QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")
SUPPORTED_TYPES = (*QWEN_TYPES, "gemma3", "llava")


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """One image of a prompt: its tokens' prompt indices, in raster order over a (rows, cols) grid, and the box
    (left, top, right, bottom, in the original image's pixels) that the grid covers; the box reaches past the image
    where the image processor padded it, and inside it where it cropped."""

    positions: tuple[int, ...]
    grid: tuple[int, int]
    box: tuple[float, float, float, float]
    size: tuple[int, int]  # the original image's (width, height)
    image: object = dataclasses.field(default=None, repr=False, compare=False)  # the PIL image, for rendering

    def grid_of(self, row: torch.Tensor) -> torch.Tensor:
        """(rows, cols) of a prompt-token row (N,): this image's tokens in place."""
        return row[list(self.positions)].reshape(self.grid)

    def as_dict(self) -> dict:
        return {"positions": list(self.positions), "grid": list(self.grid), "box": list(self.box),
                "size": list(self.size)}


def model_type(model_config) -> str:
    """The model type whose image-token layout macs_kernels knows, or an error naming the ones it knows."""
    kind = getattr(model_config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise NotImplementedError(
            f"no image-token layout for model type {kind!r}: macs_kernels maps image tokens back to the image for "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    return kind


def image_token_id(model_config) -> int:
    value = getattr(model_config, "image_token_id", None)
    if value is None:
        value = getattr(model_config, "image_token_index", None)
    if value is None:
        raise ValueError(f"{model_config.model_type}: the config names no image token id")
    return int(value)


def _token_grids(model_config, image_inputs: dict, count: int) -> list[tuple[int, int]]:
    """(rows, cols) of each of the `count` images of a processor call, in order."""
    kind = model_type(model_config)
    vision = model_config.vision_config
    if kind in QWEN_TYPES:
        merge = vision.spatial_merge_size
        grids = image_inputs["image_grid_thw"].tolist()
        if any(t != 1 for t, _, _ in grids):
            raise NotImplementedError("image_grid_thw with several frames (t > 1) is a video: video inputs are not "
                                      "supported")
        return [(h // merge, w // merge) for _, h, w in grids]
    if kind == "gemma3":
        side = math.isqrt(model_config.mm_tokens_per_image)
        return [(side, side)] * count
    strategy = getattr(model_config, "vision_feature_select_strategy", "default")
    if strategy != "default":
        raise NotImplementedError(f"LLaVA with vision_feature_select_strategy={strategy!r}: its image tokens include "
                                  "the vision tower's CLS token, which has no place on the image")
    side = vision.image_size // vision.patch_size
    return [(side, side)] * count


def _llava_box(image_processor, width: int, height: int) -> tuple[float, float, float, float]:
    """The part of the original image that LLaVA's image processor keeps: padded to a centred square when it pads,
    resized (shortest edge, or to a fixed size), centre-cropped."""
    left, top, right, bottom = 0.0, 0.0, float(width), float(height)
    if getattr(image_processor, "do_pad", False):
        side = max(width, height)
        left, top = -(side - width) / 2, -(side - height) / 2
        right, bottom = left + side, top + side
    box_w, box_h = right - left, bottom - top
    size = image_processor.size  # a dict or transformers' SizeDict: both answer .get
    if getattr(image_processor, "do_resize", True) and size.get("shortest_edge"):
        scale_x = scale_y = size.get("shortest_edge") / min(box_w, box_h)
    elif getattr(image_processor, "do_resize", True) and size.get("height"):
        scale_x, scale_y = size.get("width") / box_w, size.get("height") / box_h
    else:
        scale_x = scale_y = 1.0
    if getattr(image_processor, "do_center_crop", False):
        crop = image_processor.crop_size
        crop_w, crop_h = crop.get("width") / scale_x, crop.get("height") / scale_y
        left, top = left + (box_w - crop_w) / 2, top + (box_h - crop_h) / 2
        right, bottom = left + crop_w, top + crop_h
    return left, top, right, bottom


def _box(kind: str, image_processor, width: int, height: int) -> tuple[float, float, float, float]:
    if kind == "llava":
        return _llava_box(image_processor, width, height)
    return 0.0, 0.0, float(width), float(height)  # Qwen and Gemma 3 resize the whole image


def image_layouts(model_config, image_processor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  image_inputs: dict, images: list[list]) -> list[list[ImageTokens]]:
    """Per prompt (rows of the left-padded `input_ids`), its images' ImageTokens; positions are indices into the
    prompt without its pads. images: per prompt its PIL images, in the order the processor took them."""
    kind = model_type(model_config)
    if int(torch.as_tensor(image_inputs.get("num_crops", 0)).sum()) > 0:
        raise NotImplementedError("pan-and-scan crops (do_pan_and_scan) are not mapped back to the image: turn "
                                  "them off in the image processor")
    token = image_token_id(model_config)
    grids = iter(_token_grids(model_config, image_inputs, sum(len(prompt_images) for prompt_images in images)))
    layouts = []
    for ids, mask, prompt_images in zip(input_ids, attention_mask, images):
        positions = (ids[mask.bool()] == token).nonzero()[:, 0].tolist()
        prompt_layout, used = [], 0
        for image in prompt_images:
            rows, cols = next(grids)
            mine = positions[used: used + rows * cols]
            if len(mine) != rows * cols or mine[-1] - mine[0] != rows * cols - 1:
                raise ValueError(f"the prompt's image tokens do not match its images: expected a run of {rows * cols}"
                                 f" image tokens (id {token}) for image {len(prompt_layout)}")
            used += rows * cols
            width, height = image.size
            prompt_layout.append(ImageTokens(tuple(mine), (rows, cols), _box(kind, image_processor, width, height),
                                             (width, height), image))
        if used != len(positions):
            raise ValueError(f"the prompt holds {len(positions)} image tokens (id {token}), its {len(prompt_images)} "
                             f"image(s) {used}")
        layouts.append(prompt_layout)
    return layouts
