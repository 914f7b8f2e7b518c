"""Which transformers models the engines can trace: one attention module per layer, routed through
transformers' AttentionInterface, with attention the MACS rows can follow."""
from __future__ import annotations

import torch


def _compiled(function) -> bool:
    return hasattr(function, "_torchdynamo_orig_callable") or hasattr(function, "_orig_mod")


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    modules = {}
    for module in model.modules():
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
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "attn_logit_softcapping", None):
        raise NotImplementedError(
            f"attention logit softcapping (attn_logit_softcapping={text_config.attn_logit_softcapping}) is not "
            "supported: the MACS rows would be computed without the tanh cap the model applies"
        )
    layer_types = getattr(text_config, "layer_types", None) or []
    if any("sliding" in str(kind) for kind in layer_types) or (
        getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True)
    ):
        raise NotImplementedError(
            "sliding-window attention layers are not supported: their cache keeps only the window, so key "
            "slots no longer map to tokens"
        )
    if _compiled(getattr(model, "forward", None)):
        raise NotImplementedError(
            "the model's forward is torch.compile'd: the tracer keeps host-side state per pass and cannot run "
            "inside a compiled graph; use the uncompiled forward (drop torch.compile)"
        )
    modules = _attention_modules(model)
    if sorted(modules) != list(range(len(modules))) or not modules:
        raise TypeError(f"could not find one attention module per layer in {type(model).__name__}")
    return modules
