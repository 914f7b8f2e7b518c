"""Each method's token scores from one recorded generation, and the AUC-PR line of one (sample, method).

Bump a kind's SCORING_VERSIONS entry when what its scores or AUC-PR lines mean changes: it is part of every
cached AUC-PR and faithfulness line's key, so results computed by the old code are scored again (and only
those of that kind).
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from macs_kernels.apps.evaluation.methods import MODEL_METHODS, Method, MethodUnavailable
from macs_kernels.apps.evaluation.metrics import auc_pr_sample, average_precision, count_ties, paper_form_zscores
from macs_kernels.core.scores import AGGREGATIONS, DEFAULT_AGGREGATION, whole_answer_scores

# 5 (macs): a one-step answer's whole-answer scores are its step's z-scores (they were 0 for every token); 4: the
# aggregate is the whole-answer score Explanation.scores (core.DEFAULT_AGGREGATION, with copied runs:
# max_plus_run_minus_mean_sinkless_z), every named aggregation's AUC-PR is kept too; 3: max_minus_mean_sinkless_z;
# 2: max_minus_mean_z; 1: the mean of the paper's step z-scores.
SCORING_VERSIONS = {"macs": 5}
RANDOM_SEED = 20250921


@functools.cache
def at2_coefficients() -> tuple[np.ndarray, str]:
    """The packaged AT2 coefficients (L, H) as float64, and the SHA-1 of their file (results depend on it)."""
    from macs_kernels.apps.at2 import DEFAULT_COEFFICIENTS, load_coefficients

    digest = hashlib.sha1(DEFAULT_COEFFICIENTS.read_bytes()).hexdigest()
    return load_coefficients(DEFAULT_COEFFICIENTS)[0].double().numpy(), digest


def method_identity(method: Method) -> dict:
    """What a method's scores depend on besides the sample: its name, the scoring code, AT2's coefficients."""
    identity = {"method": method.name, "scoring_version": SCORING_VERSIONS.get(method.kind, 1)}
    if method.kind == "at2":
        identity["at2_coefficients_sha1"] = at2_coefficients()[1]
    return identity


def at2_from_record(record: dict, theta: np.ndarray, response_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """AT2 token scores from the recorded rows: (per step (steps, N), aggregate (N,)).

    Step k's row is the query that predicts response token k, so theta . rows[k] is AT2's score with
    target token k alone; the aggregate averages the first `response_steps` rows (AT2's target: the
    response without its end-of-sequence token), as AT2Attributor.explain(sources="token") does.
    """
    rows = np.asarray(record["rows"], dtype=np.float64)
    if theta.shape != rows.shape[1:3]:
        raise ValueError(f"AT2 coefficients {theta.shape} do not match the record's (layers, heads) {rows.shape[1:3]}")
    per_step = np.einsum("slhn,lh->sn", rows, theta)
    return per_step, per_step[:response_steps].mean(0)


def record_log_c(record: dict, method: Method) -> np.ndarray:
    from macs_kernels.apps.evaluation.record import macs_from_record

    config = method.macs
    return macs_from_record(record, alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
                            attention=config.attention)


def method_scores(method: Method, index: int, record, model_rows, steps: int, n_input: int, context,
                  response_steps: int | None = None) -> dict:
    """{"rank": (steps, n_context) scores to rank by, "aggregate": (n_context,), "paper_form": (steps, n_context)}
    and, for MACS, "aggregates": {name: (n_context,)} of every whole-answer score in core.AGGREGATIONS.

    MACS ranks by log c (the z-score is monotone in c, and log c keeps apart what c = exp(log c) rounds
    together); its aggregate row is its whole-answer score Explanation.scores (core.DEFAULT_AGGREGATION,
    computed over every prompt token as explain() does, then cut to the context). "paper_form" is the score
    as the paper computes it, whose ties are counted. response_steps: the steps before an
    end-of-sequence token (AT2's aggregate target; default all). model_rows: the (steps, N) scores of a method
    computed from the model (rollout, attnlrp, atman; see MODEL_METHODS), else None.
    """
    response_steps = steps if response_steps is None else response_steps
    start, stop = context
    if method.kind == "macs":
        log_c = record_log_c(record, method)
        rank = np.maximum(log_c, np.finfo(np.float64).min)[:, start:stop]
        # -inf (underflow at alpha = 1) ranks last as the lowest float: average precision takes finite scores.
        aggregates = {name: np.maximum(whole_answer_scores(torch.from_numpy(log_c), name).double().numpy(),
                                       np.finfo(np.float64).min)[start:stop] for name in AGGREGATIONS}
        return {"rank": rank, "aggregate": aggregates[DEFAULT_AGGREGATION], "aggregates": aggregates,
                "paper_form": paper_form_zscores(log_c)[:, start:stop]}
    if method.kind == "attention-mean":
        from macs_kernels.apps.evaluation.record import attention_mean_from_record

        full = attention_mean_from_record(record)
    elif method.kind == "at2":
        per_step, aggregate = at2_from_record(record, at2_coefficients()[0], response_steps)
        return {"rank": per_step[:, start:stop], "aggregate": aggregate[start:stop],
                "paper_form": per_step[:, start:stop].astype(np.float32)}
    elif method.kind in MODEL_METHODS:
        full = model_rows
    elif method.kind == "random":
        full = np.random.default_rng([RANDOM_SEED, index, 0]).random((steps, n_input))
    else:
        raise MethodUnavailable(f"method {method.name!r} cannot be scored")
    rank = full[:, start:stop]
    return {"rank": rank, "aggregate": rank.mean(0), "paper_form": rank.astype(np.float32)}


def score_auc(method: Method, index: int, scores: dict, labels) -> dict:
    """The "auc" results line of one (sample, method) from method_scores' output and the gold label vectors."""
    result = auc_pr_sample(scores["rank"], labels, aggregate=scores["aggregate"])
    tied = [count_ties(row) for row in scores["paper_form"]]
    extra = {}
    if "aggregates" in scores:
        extra["aggregates"] = {name: float(np.mean([average_precision(row, y) for y in labels]))
                               for name, row in scores["aggregates"].items()}
    return extra | {
        "kind": "auc", "index": index, "method": method.name,
        "best": result["best"], "best_step": result["best_step"], "step_mean": result["step_mean"],
        "aggregate": result["aggregate"], "per_step": result["per_step"],
        "ties": {"tied_tokens": int(sum(tied)), "rows": len(tied), "rows_with_ties": int(sum(t > 0 for t in tied))},
    }
