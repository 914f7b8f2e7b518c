"""The configuration every MACS entry point shares, validated once before any generation."""
from __future__ import annotations

import dataclasses

ATTENTIONS = ("softmax", "efficient", "norm")
# The rows AT2's features average: "norm" weighs MACS's rows only.
AT2_ATTENTIONS = ("softmax", "efficient")


@dataclasses.dataclass(frozen=True)
class MacsConfig:
    """MACS hyper-parameters (paper defaults) and the backend that computes them.

    alpha: floor weight, m = alpha * m' + (1 - alpha); alpha = 1 removes the floor.
    pooling: how the per-head rows of one layer are pooled ("max" in the paper).
    redistribute: spread the attention that falls on generated tokens evenly over the inputs.
    attention: "softmax" rows, "efficient" rows (the part of each row the output depends on), or "norm" rows
        (each key's attention weighted by the norm of its value through the output projection, renormalised:
        macs_kernels.core.methods.norm; model.generate only).
    backend: "torch", "triton", "cuda" or None (the fastest one available for the tensors' device).
    fused_decode: on decode steps, compute the attention output with the backend's decode kernel, which
        also yields the MACS term from the same single read of the key cache, instead of calling the
        wrapped implementation. None: on for triton and cuda; off for torch, whose output is then exactly
        the wrapped implementation's (fused, it equals it within float rounding and saves a pass over K).
        Softmax rows only: efficient and norm rows need the attention output first, so they never fuse.
    """

    alpha: float = 0.8
    pooling: str = "max"
    redistribute: bool = True
    attention: str = "softmax"
    backend: str | None = None
    fused_decode: bool | None = None

    def __post_init__(self):
        # The ops' checks (ops/_checks.py) import torch: they load when a config is made, so that reading the
        # configuration's names (the command line's --help) imports no torch.
        from macs_kernels.ops._checks import check_options

        check_options(alpha=self.alpha, pooling=self.pooling, redistribute=self.redistribute, backend=self.backend)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTIONS}")
        if self.fused_decode is not None and not isinstance(self.fused_decode, bool):
            raise TypeError(f"fused_decode must be True, False or None, got {self.fused_decode!r}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
