"""Which transformers models the engines can trace: one attention module per layer, routed through
transformers' AttentionInterface, with attention the MACS rows can follow."""
from __future__ import annotations

import functools
import inspect

import torch

from macs_kernels.core import support
from macs_kernels.ops.variant import PLAIN, Variant


def compiled_forward(model) -> bool:
    """Whether the model's forward was replaced by a torch.compile'd one."""
    function = getattr(model, "forward", None)
    return hasattr(function, "_torchdynamo_orig_callable") or hasattr(function, "_orig_mod")


def _text_config_key(model) -> str | None:
    """The sub-config key of a multimodal model's language model (its text config); None for a text model."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text is config:
        return None
    for key in config.sub_configs:
        if getattr(config, key, None) is text:
            return key
    raise TypeError(f"{type(model).__name__}: its text config is none of its sub-configs {list(config.sub_configs)}")


def language_model(model) -> torch.nn.Module:
    """The module whose attention layers MACS traces: a multimodal model's language model (its vision tower may
    use the same attention functions, and its layers are not the text's), else the model itself."""
    if _text_config_key(model) is None:
        return model
    decoder = model.get_decoder()
    if decoder.config is not model.config.get_text_config(decoder=True):
        raise TypeError(f"{type(model).__name__}: could not find its language model (get_decoder() returned "
                        f"{type(decoder).__name__}, which does not run its text config)")
    return decoder


def text_attention(model) -> str:
    """The attention implementation of the model's language model."""
    key = _text_config_key(model)
    return (model.config if key is None else getattr(model.config, key))._attn_implementation


def set_text_attention(model, implementation: str) -> None:
    """Route the language model's attention through `implementation`; a vision tower keeps its own."""
    key = _text_config_key(model)
    model.set_attn_implementation(implementation if key is None else {key: implementation})


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    modules = {}
    for module in language_model(model).modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            modules[module.layer_idx] = module
    return modules


def check_model(model) -> dict[int, torch.nn.Module]:
    """The model's attention modules by layer, or a clear error when MACS cannot trace this model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers model")
    if not getattr(model, "_supports_attention_backend", False):
        raise TypeError(
            f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, "
            "so macs_kernels cannot trace it"
        )
    text_model = language_model(model)
    if text_model is not model and not getattr(text_model, "_supports_attention_backend", False):
        raise TypeError(
            f"{type(model).__name__}'s language model ({type(text_model).__name__}) does not run its attention "
            "through transformers' AttentionInterface, so macs_kernels cannot trace it"
        )
    modules = _attention_modules(model)
    if sorted(modules) != list(range(len(modules))) or not modules:
        raise TypeError(f"could not find one attention module per layer in {type(model).__name__}")
    return modules


def passed_cache(kwargs: dict):
    """The cache a forward or generate call was handed, or None: transformers 5.24 names it `cache`, earlier
    releases `past_key_values` (5.24 still takes the old name)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


@functools.cache
def takes_cache(module_class: type) -> bool:
    """Whether the class's forward takes its cache as `cache` (transformers 5.24 on) rather than `past_key_values`;
    looked up once per class, as forwards run per token."""
    return "cache" in inspect.signature(module_class.forward).parameters


def cache_argument(model, cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward: `cache` from transformers 5.24 on (which
    still takes `past_key_values`, with a deprecation warning), `past_key_values` before."""
    return {"cache" if takes_cache(type(model)) else "past_key_values": cache}


def returned_cache(output):
    """The cache a forward returned: `output.cache` from transformers 5.24 on, `output.past_key_values` before."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


def attention_variants(model) -> tuple[str, ...]:
    """The attention variants of the model's layers, as the support table's layouts: "sliding_window" (some
    layer's cache keeps only a window), "softcap" (attention logit softcapping), "sinks" (learned per-head
    sink logits in the softmax denominator)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = any("sliding" in str(kind) for kind in layer_types)
    else:  # transformers' caches treat every layer as sliding then (Mistral)
        sliding = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
    modules = _attention_modules(model).values()
    sinks = any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in modules)
    return tuple(name for name, present in (
        ("sliding_window", sliding), ("softcap", bool(getattr(config, "attn_logit_softcapping", None))),
        ("sinks", sinks),
    ) if present)


def check_variants(model, engine: str, method: str) -> tuple[str, ...]:
    """The model's attention variants, or the support table's refusal (naming the model type) when `engine`
    cannot follow one of them with `method`."""
    found = attention_variants(model)
    for layout in found:
        refusal = support.message(engine, method, layout)
        if refusal is not None:
            raise NotImplementedError(f"{model.config.model_type}: {refusal}")
    return found


def window_key_offset(cache, layer: int, keys: int) -> int:
    """The token that key slot 0 of `layer` holds in the pass in progress, from the cache the model updates: a
    sliding-window cache layer (dynamic or static) counts every token handed to it (through crops and rolls)
    and hands over the last `keys` of them, or, static and not yet full, its buffer from token 0 on. A full
    layer's (or a cacheless pass's) slot j is token j."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers) or not getattr(layers[layer], "is_sliding", False):
        return 0
    entry = layers[layer]
    tokens = getattr(entry, "cumulative_length_int", getattr(entry, "cumulative_length", None))
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 0 and not tokens.is_floating_point():
        # transformers 5.17's dynamic sliding layer keeps a tensor after a crop by a tensor count (assisted decoding
        # and prompt lookup, which read their candidates on the host anyway); its static one keeps an int beside.
        tokens = int(tokens)
    if not isinstance(tokens, int):
        raise NotImplementedError(
            f"a sliding-window cache layer of type {type(entry).__name__} is not supported: the tracer cannot read "
            "how many tokens it holds"
        )
    return max(tokens - keys, 0)


def layer_variant(kwargs: dict, key_offset: int) -> Variant:
    """The layer's attention variant from what the model hands its attention function: `sliding_window`,
    `softcap` (Gemma 2) and `s_aux` (gpt-oss's sinks); its keys start at token key_offset."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None and key_offset == 0:
        return PLAIN  # every layer of a plain model, every pass: no object to build and check
    return Variant(window=window, key_offset=key_offset, softcap=softcap, sinks=sinks)
