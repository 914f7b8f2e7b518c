"""The scores a user reads, each a named object whose definition sits next to the code that computes it: what
every engine's rows (log c) become. `SCORES` is the registry; `Explanation` exposes them."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from macs_kernels.ops.torch import backend as torch_backend

# A copied span shows in the rows as RUN_STEPS consecutive steps attending to as many consecutive prompt tokens,
# one token further at each step (a head reading the span it repeats): the tokens of such a run are the ones the
# answer came from.
RUN_STEPS = 3


def log_zscores(log_c: torch.Tensor, sinkless: bool = False) -> torch.Tensor:
    """The scores users rank by: z-scores of log c along the last dimension, float32 (computed in float64).

    An affine map of log c, so they rank tokens exactly as log c does. The paper's z-scores of c = exp(log c)
    do not: the attention sink has c ~ 1 and every other token c ~ 1e-15, so all non-sink tokens share one
    z-score to 7 digits. Population standard deviation over the finite entries; a row whose finite entries
    are all equal scores 0; -inf (attention underflow at alpha = 1) stays -inf, below everything.
    sinkless: the mean and deviation leave out each row's largest entry (still scored): the attention sink's
    log c lies so far above the rest that it alone would set the row's spread.
    """
    values = log_c.double()
    finite = torch.isfinite(values)
    counted = finite
    if sinkless and values.shape[-1] > 1:
        counted = finite & ~torch.zeros_like(finite).scatter_(-1, values.argmax(dim=-1, keepdim=True), True)
    count = counted.sum(dim=-1, keepdim=True).clamp_min(1)
    mean = torch.where(counted, values, 0.0).sum(dim=-1, keepdim=True) / count
    centred = torch.where(finite, values - mean, 0.0)
    std = torch.sqrt(torch.where(counted, centred, 0.0).square().sum(dim=-1, keepdim=True) / count)
    z = torch.where(std > 0, centred / std, 0.0)
    if sinkless:  # nothing but the top varies (two tokens, underflow): the plain z-scores still rank the top first
        z = torch.where(std > 0, z, log_zscores(log_c).double())
    return torch.where(finite, z, values).float()


def paper_zscores(log_c: torch.Tensor) -> torch.Tensor:
    """The paper's z-scores of c = exp(log c), per row of `log_c` (steps, N), float32 (steps, N).

    Computed from log c only when asked for: no engine pays for them per pass."""
    if log_c.dim() == 1:
        return paper_zscores(log_c[None])[0]
    steps, n = log_c.shape
    return torch_backend.macs_zscore(log_c.float(), torch.full((steps,), n, device=log_c.device))


# JSON's precision: a z-score to SCORE_DIGITS decimals (float32 noise in log c moves it by ~1e-5), log c to
# LOG_C_DIGITS significant digits (float32's own precision; more digits would be float64 noise).
SCORE_DIGITS = 4
LOG_C_DIGITS = 7
TOP_TOKENS = 10  # the best tokens as_dict lists and the page shows


def json_values(values: torch.Tensor, digits: int | None = None) -> list:
    """Nested lists of `values` (rounded to `digits` when given) with -inf as None: JSON has no infinities."""
    if values.dim() > 1:
        return [json_values(row, digits) for row in values]
    return [None if v == float("-inf") else v if digits is None else round(v, digits) for v in values.tolist()]


@dataclasses.dataclass(frozen=True)
class ZAggregation:
    """A whole-answer score that aggregates each token's step z-scores of log c: from their max and mean over the
    steps and, with `runs`, each token's best copied run (float64, `StepStatistics`). sinkless: each step is
    standardised without its top token (`log_zscores(sinkless=True)`)."""

    sinkless: bool
    runs: bool
    combine: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (top, mean, runs) -> (N,)

    def of(self, step_log_c: torch.Tensor) -> torch.Tensor:
        z = log_zscores(step_log_c, sinkless=self.sinkless).double()
        runs = None
        if self.runs:
            steps = StepStatistics()
            for row in z:
                steps.add(row)
            runs = steps.best_runs()
        return self.finish(z.amax(dim=0), z.mean(dim=0), runs, steps=z.shape[0])

    def finish(self, top: torch.Tensor, mean: torch.Tensor, runs: torch.Tensor | None, steps: int) -> torch.Tensor:
        # One step has nothing to stand out from: every score "above the mean" would be 0 for every token, so a
        # one-token answer scores its step's z-scores.
        if steps == 1:
            return top.float()
        return self.combine(top, mean, runs).float()


def _above_mean(score: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """`score` less the mean; a token that underflowed at some step (mean -inf) stays -inf, below everything."""
    return torch.where(torch.isfinite(mean), score, float("-inf"))


@dataclasses.dataclass(frozen=True)
class Score:
    """A named score of the prompt tokens computed from the rows log c (steps, N) by `of`: per step ((steps, N),
    per_step) or for the whole answer ((N,)). definition: what it computes, in the words users read."""

    name: str
    definition: str
    of: Callable[[torch.Tensor], torch.Tensor]
    per_step: bool = False
    over_z: ZAggregation | None = None  # how a stream keeps a whole-answer score of step z-scores running


def _z_score(name: str, definition: str, aggregation: ZAggregation) -> Score:
    return Score(name, definition, aggregation.of, over_z=aggregation)


def _mean_log_c(step_log_c: torch.Tensor) -> torch.Tensor:
    return log_zscores(step_log_c.double().mean(dim=0))


def _paper_mean_z(step_log_c: torch.Tensor) -> torch.Tensor:
    return paper_zscores(step_log_c).mean(dim=0)


_RUN_DEFINITION = (f"a run is {RUN_STEPS} consecutive steps attending to {RUN_STEPS} consecutive prompt tokens, one "
                   "token further at each step (how a model reads a span it copies), worth the smallest of its "
                   f"{RUN_STEPS} z-scores (shorter runs when fewer steps or tokens); a token's best run is the "
                   "largest of those it is part of")
_SINKLESS_DEFINITION = ("each step's z-scores standardised by the mean and spread of the prompt tokens other than "
                        "the step's top one (the attention sink, whose log c lies far above the rest and would "
                        "otherwise set the scale)")

SCORES = {score.name: score for score in (
    Score("log_z", "per step, the z-scores over the prompt tokens of the step's log consistency log c (an affine map "
          "of log c: they rank tokens exactly as log c does); -inf is an underflowed token (Explanation.step_scores)",
          log_zscores, per_step=True),
    Score("paper_z", "per step, the paper's z-scores of c = exp(log c), which tie for every token but the attention "
          "sink (Explanation.paper_step_scores)", paper_zscores, per_step=True),
    _z_score("max_plus_run_minus_mean_sinkless_z",
             "per prompt token, (the largest of its sinkless step z-scores minus their mean over steps) plus (its "
             f"best run minus that mean): {_RUN_DEFINITION}; {_SINKLESS_DEFINITION} (Explanation.scores; "
             "benchmarks/results/whole_answer_runs.md)",
             ZAggregation(True, True, lambda top, mean, runs: _above_mean(top + runs - 2 * mean, mean))),
    _z_score("max_minus_mean_sinkless_z",
             "per prompt token, the largest of its sinkless step z-scores minus their mean over steps: how far it "
             f"stood out at the step that attended to it most, above its usual level; {_SINKLESS_DEFINITION}",
             ZAggregation(True, False, lambda top, mean, runs: _above_mean(top - mean, mean))),
    _z_score("max_minus_mean_z", "per prompt token, the largest of its step z-scores (log_z) minus their mean over "
             "steps", ZAggregation(False, False, lambda top, mean, runs: _above_mean(top - mean, mean))),
    _z_score("max_z", "per prompt token, the largest of its step z-scores (log_z) over the steps",
             ZAggregation(False, False, lambda top, mean, runs: top)),
    _z_score("mean_z", "per prompt token, the mean of its step z-scores (log_z) over the steps",
             ZAggregation(False, False, lambda top, mean, runs: mean)),
    Score("mean_log_c", "z-scores of the mean over steps of log c (the log of c's geometric mean over steps)",
          _mean_log_c),
    Score("paper_mean_z", "the mean over steps of the paper's z-scores of c = exp(log c) (paper_z), which tie for "
          "every token but the attention sink (Explanation.paper_scores)", _paper_mean_z),
)}
DEFAULT_STEP_SCORE = "log_z"
DEFAULT_AGGREGATION = "max_plus_run_minus_mean_sinkless_z"
# The whole-answer scores by name, with their definitions: Explanation.whole_answer(name) takes any of them.
AGGREGATIONS = {name: score.definition for name, score in SCORES.items() if not score.per_step}
SCORE_DEFINITION = (
    "step_scores[k]: " + SCORES[DEFAULT_STEP_SCORE].definition.removeprefix("per step, ") + "; scores: the "
    "whole-answer score, " + DEFAULT_AGGREGATION + ": " + SCORES[DEFAULT_AGGREGATION].definition
    + "; -inf (null in JSON) is an underflowed token. paper_step_scores / paper_scores: the paper's z-scores of "
    "c = exp(log c) and their mean over steps, which tie for every token but the attention sink."
)


def step_scores(step_log_c: torch.Tensor, name: str = DEFAULT_STEP_SCORE) -> torch.Tensor:
    """(steps, N) float32 per-step score `name` of the rows log c (steps, N): what every engine's readers return
    next to the rows."""
    score = SCORES.get(name)
    if score is None or not score.per_step:
        raise ValueError(f"unknown step score {name!r}; choose one of "
                         f"{', '.join(n for n, s in SCORES.items() if s.per_step)}")
    return score.of(step_log_c)


def whole_answer_scores(step_log_c: torch.Tensor, how: str = DEFAULT_AGGREGATION) -> torch.Tensor:
    """(N,) float32 whole-answer score of each prompt token from the (steps, N) rows log c, by the name `how`
    (AGGREGATIONS). Underflowed entries (-inf, alpha = 1 only): a token with one at any step scores -inf
    under the means (its mean is -inf), max_z takes the largest finite step, and a run through one counts it at
    its step's lowest finite z-score; one step: that step's z-scores (sinkless ones for the sinkless scores), since
    nothing stands out from a single step; no steps: zeros."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; choose one of {', '.join(AGGREGATIONS)}")
    if step_log_c.dim() != 2:
        raise ValueError(f"step_log_c must be (steps, N), got shape {tuple(step_log_c.shape)}")
    if step_log_c.shape[0] == 0:
        return torch.zeros(step_log_c.shape[1])
    return SCORES[how].of(step_log_c)


class StepStatistics:
    """What the z-score aggregations need of the steps so far, taken one (N,) row of z-scores (float64) at a
    time: their max and sum and the best run of k = min(run_steps, steps, N) steps starting at each token (the
    smallest z-score along it), from the last run_steps - 1 rows. k only grows, so only the runs of the current
    k are kept. A stream pays O(N * run_steps) per token."""

    def __init__(self, run_steps: int = RUN_STEPS):
        self.run_steps = run_steps
        self.top = self.total = None
        self.steps = 0
        self.recent: list[torch.Tensor] = []  # underflow replaced by the row's lowest finite z-score
        self.run_starts: torch.Tensor | None = None  # (N - k + 1,) best run of the current k starting at each token

    def add(self, z: torch.Tensor) -> None:
        self.top = z if self.top is None else torch.maximum(self.top, z)
        self.total = z if self.total is None else self.total + z
        self.steps += 1
        finite = torch.isfinite(z)
        floor = z[finite].min() if finite.any() else 0.0
        window = [*self.recent, torch.where(finite, z, floor)]
        n = z.shape[0]
        k = min(self.run_steps, n, len(window))
        if k > 1:
            runs = torch.stack([window[j - k][j:n - k + 1 + j] for j in range(k)]).amin(dim=0)
            longer = self.run_starts is None or self.run_starts.shape[0] != runs.shape[0]
            self.run_starts = runs if longer else torch.maximum(self.run_starts, runs)
        self.recent = window[1 - self.run_steps:] if self.run_steps > 1 else []

    def score(self, aggregation: ZAggregation) -> torch.Tensor:
        """(N,) float32 `aggregation` of the z-scores added so far (at least one step)."""
        return aggregation.finish(self.top, self.total / self.steps, self.best_runs() if aggregation.runs else None,
                                  self.steps)

    def best_runs(self) -> torch.Tensor:
        """(N,) the best run each token is part of, runs as long as the steps and tokens allow (<= run_steps); a
        run of one step is the token's max (-inf where it underflowed: its mean is -inf and masks it anyway)."""
        k = min(self.run_steps, self.steps, self.top.shape[0])
        if k <= 1:
            return self.top
        padded = F.pad(self.run_starts, (k - 1, k - 1), value=float("-inf"))
        return padded.unfold(0, k, 1).amax(dim=-1)


class RunningWholeAnswer:
    """The default whole-answer score of the steps so far, kept from running statistics so that a stream pays
    O(N) per token rather than re-aggregating every earlier row."""

    def __init__(self):
        self.aggregation = SCORES[DEFAULT_AGGREGATION].over_z
        self.steps = StepStatistics()

    def add(self, log_c: torch.Tensor) -> torch.Tensor:
        """Take one step's (N,) row log c; return whole_answer_scores of every step so far."""
        self.steps.add(log_zscores(log_c, sinkless=self.aggregation.sinkless).double())
        return self.steps.score(self.aggregation)
