"""The configuration every MACS entry point shares, validated once before any generation."""
from __future__ import annotations

import dataclasses

POOLINGS = ("max", "mean", "min")
ATTENTIONS = ("softmax", "efficient", "norm")
# The rows AT2's features average: "norm" weighs MACS's rows only.
AT2_ATTENTIONS = ("softmax", "efficient")
BACKENDS = ("torch", "triton", "cuda", "numba")

# Whole-answer scores: how the per-step rows become one score per prompt token. Each name is one definition
# (core.scores.whole_answer_scores); Explanation.scores is the default, Explanation.whole_answer(name) any of them.
AGGREGATIONS = {
    "max_plus_run_minus_mean_sinkless_z": "per prompt token, max_minus_mean_sinkless_z plus its best run minus its "
                                          "mean: a run is 3 consecutive steps attending to 3 consecutive prompt "
                                          "tokens, one token further at each step (how a model reads a span it "
                                          "copies), worth the smallest of its 3 sinkless z-scores (shorter runs when "
                                          "fewer steps or tokens), and a token's best run is the largest of those it "
                                          "is part of (default; chosen on stqa_350 "
                                          "samples 0-174, confirmed on 175-349: "
                                          "benchmarks/results/whole_answer_runs.md)",
    "max_minus_mean_sinkless_z": "per prompt token, the largest of its sinkless step z-scores minus their mean over "
                                 "steps: how far it stood out at the step that attended to it most, above its usual "
                                 "level; each step's z-scores standardised by the mean and spread of the prompt tokens "
                                 "other than the step's top one (the attention sink, whose log c lies far above the "
                                 "rest and would otherwise set the scale) (Explanation.scores before the copied runs; "
                                 "benchmarks/results/whole_answer.md)",
    "max_minus_mean_z": "per prompt token, the largest of its step_scores minus their mean over steps "
                        "(Explanation.scores before the sinkless z-scores)",
    "max_z": "per prompt token, the largest of its step_scores over the steps",
    "mean_z": "per prompt token, the mean of its step_scores over the steps",
    "mean_log_c": "z-scores of the mean over steps of log c (the log of c's geometric mean over steps; "
                  "Explanation.scores before the whole-answer study)",
    "paper_mean_z": "the mean over steps of the paper's z-scores of c = exp(log c) (paper_step_scores), which "
                    "tie for every token but the attention sink (Explanation.paper_scores)",
}
DEFAULT_AGGREGATION = "max_plus_run_minus_mean_sinkless_z"


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
