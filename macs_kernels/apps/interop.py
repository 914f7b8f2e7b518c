"""MACS's intermediate tensors for other attribution tools: `trace_tensors` (no printing, no files).

The generation is teacher-forced: one prefill over the prompt, then the generated tokens fed one at a
time through the KV cache, exactly the passes `generate` makes, so the rows equal `explain`'s for the
same tokens. The last generated token is never fed: no step explains the token after it.
"""
from __future__ import annotations

import dataclasses

import torch

from macs_kernels.core.config import MacsConfig
from macs_kernels.core.scores import paper_zscores
from macs_kernels.engines.generate import attach, check_model
from macs_kernels.engines.hf_models import cache_argument, returned_cache


@dataclasses.dataclass
class TraceTensors:
    """Per generation step k (row k explains generated token k), float32 on the CPU, N prompt tokens.

    pooled: (steps, L, N) the head-pooled (and, when configured, redistributed) attention m' of the pass's
        last query on each input, per layer, before the floor: log_c[k] = sum over l of
        log(alpha * pooled[k, l] + 1 - alpha).
    log_c: (steps, N) the log consistency state. z_scores: (steps, N) the paper's z-scores of exp(log_c)
        (Explanation.paper_step_scores); they tie for every token but the attention sink, so rank with log_c
        or `macs_kernels.api.explanation.log_zscores(log_c)` (Explanation.step_scores).
    at2_features: (steps, L, H, N) when asked for: per layer and query head, the softmax attention of step
        k's query row on each input token (AT2's features; no redistribution, no pooling).
    """

    pooled: torch.Tensor
    log_c: torch.Tensor
    z_scores: torch.Tensor
    at2_features: torch.Tensor | None = None


def _ids(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 or int32 torch.Tensor of token ids")
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1 or value.numel() == 0:
        raise ValueError(f"{name} must be a non-empty (T,) or (1, T) tensor, got shape {tuple(value.shape)}")
    return value.long()


@torch.inference_mode()
def trace_tensors(model, input_ids, generated_ids, *, at2: bool = False, **config) -> TraceTensors:
    """MACS's per-step tensors for `generated_ids` (T,) continuing the prompt `input_ids` (N,) (no pads).

    config: MacsConfig fields (alpha, pooling, redistribute, backend); attention must be "softmax" (the
    pooled rows are softmax rows). at2=True adds AT2's per-step features (macs_kernels.apps.at2.features).
    """
    macs_config = MacsConfig(**config)
    if macs_config.attention != "softmax":
        raise NotImplementedError(
            f"trace_tensors records softmax rows; attention={macs_config.attention!r} is not supported"
        )
    check_model(model)
    prompt, generated = _ids("input_ids", input_ids), _ids("generated_ids", generated_ids)
    device = next(model.parameters()).device
    hooks = []
    if at2:
        from macs_kernels.apps.at2.features import QueryCapture

        capture = QueryCapture()
        hooks.append(capture)
    with attach(model, hooks=hooks, keep_pooled=True, **macs_config.as_dict()) as tracer:
        output = model(input_ids=prompt[None].to(device), use_cache=True, logits_to_keep=1)
        cache = returned_cache(output)
        for token in generated[:-1].tolist():
            model(input_ids=torch.tensor([[token]], device=device), **cache_argument(model, cache), use_cache=True,
                  logits_to_keep=1)
    log_c = tracer.rows(0)[0]
    features = None
    if at2:
        n = prompt.numel()
        features = torch.stack([
            capture.features(source_start=0, source_end=n, target_start=k, target_end=k + 1,
                             backend=macs_config.backend)[0]
            for k in range(generated.numel())
        ]).cpu()
    return TraceTensors(
        pooled=tracer.pooled_rows(0), log_c=log_c, z_scores=paper_zscores(log_c),
        at2_features=features,
    )
