"""The configuration every MACS entry point shares, validated once before any generation: `MacsConfig`, the one
list of MACS's option names and their defaults. Entry points build it once and pass the object on; the names a
request, vLLM or an evaluation method may set are read from it (`option_names`), never listed again.
"""
from __future__ import annotations

import dataclasses

# The paper's floor weight: every signature that takes alpha defaults to this (the ops' own copy,
# ops._checks.DEFAULT_ALPHA, lives below this layer; tests/core/test_core.py keeps the two equal).
DEFAULT_ALPHA = 0.8
# What an option is, for who may set it: "rows" changes the rows (a request of any serving engine, an evaluation
# method); "pass" changes how a request's pass computes them (continuous batching and the server, per request);
# "engine" is one per engine (its kernels).
OPTION_KINDS = ("rows", "pass", "engine")
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

    alpha: float = dataclasses.field(default=DEFAULT_ALPHA, metadata={"kind": "rows"})
    pooling: str = dataclasses.field(default="max", metadata={"kind": "rows"})
    redistribute: bool = dataclasses.field(default=True, metadata={"kind": "rows"})
    attention: str = dataclasses.field(default="softmax", metadata={"kind": "rows"})
    backend: str | None = dataclasses.field(default=None, metadata={"kind": "engine"})
    fused_decode: bool | None = dataclasses.field(default=None, metadata={"kind": "pass"})

    def __post_init__(self):
        # The ops' checks (ops/_checks.py) import torch: they load when a config is made, so that reading the
        # configuration's names (the command line's --help) imports no torch.
        from macs_kernels.ops._checks import check_options

        check_options(alpha=self.alpha, pooling=self.pooling, redistribute=self.redistribute, backend=self.backend)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTIONS}")
        if self.fused_decode is not None and not isinstance(self.fused_decode, bool):
            raise TypeError(f"fused_decode must be True, False or None, got {self.fused_decode!r}")
        if self.fused_decode and self.attention != "softmax":
            raise ValueError(f"fused_decode=True fuses softmax rows only; attention={self.attention!r} rows need the "
                             "attention output first: leave fused_decode unset")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def option_names(*kinds: str) -> tuple[str, ...]:
    """MacsConfig's option names of these kinds (OPTION_KINDS; all of them when none is given), in field order."""
    unknown = set(kinds) - set(OPTION_KINDS)
    if unknown:
        raise ValueError(f"unknown option kinds {sorted(unknown)}; choose from {OPTION_KINDS}")
    return tuple(f.name for f in dataclasses.fields(MacsConfig) if not kinds or f.metadata["kind"] in kinds)


def config_of(config: MacsConfig | None, options: dict) -> MacsConfig:
    """An entry point's MacsConfig: `config` as given (the object passed on from the caller's entry point), or the
    MacsConfig of `options` (its fields by name); not both."""
    if config is None:
        return MacsConfig(**options)
    if options:
        raise TypeError(f"pass config= or MacsConfig's options, not both (got config and {sorted(options)})")
    if not isinstance(config, MacsConfig):
        raise TypeError(f"config must be a MacsConfig, got {type(config).__name__}")
    return config
