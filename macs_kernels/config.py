"""The configuration every MACS entry point shares, validated once before any generation."""
from __future__ import annotations

import dataclasses

POOLINGS = ("max", "mean", "min")
ATTENTIONS = ("softmax", "efficient", "norm")
# The rows AT2's features average: "norm" weighs MACS's rows only.
AT2_ATTENTIONS = ("softmax", "efficient")
BACKENDS = ("torch", "triton", "cuda", "numba")


@dataclasses.dataclass(frozen=True)
class MacsConfig:
    """MACS hyper-parameters (paper defaults) and the backend that computes them.

    alpha: floor weight, m = alpha * m' + (1 - alpha); alpha = 1 removes the floor.
    pooling: how the per-head rows of one layer are pooled ("max" in the paper).
    redistribute: spread the attention that falls on generated tokens evenly over the inputs.
    attention: "softmax" rows, "efficient" rows (the part of each row the output depends on), or "norm" rows
        (each key's attention weighted by the norm of its value through the output projection, renormalised:
        macs_kernels.norm; model.generate only).
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
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"alpha must be a number in (0, 1], got {self.alpha!r}")
        if not 0.0 < float(self.alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {POOLINGS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTIONS}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {BACKENDS} or None")
        if not isinstance(self.redistribute, bool):
            raise TypeError(f"redistribute must be True or False, got {self.redistribute!r}")
        if self.fused_decode is not None and not isinstance(self.fused_decode, bool):
            raise TypeError(f"fused_decode must be True, False or None, got {self.fused_decode!r}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
