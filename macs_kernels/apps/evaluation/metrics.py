"""AUC-PR of context-token scores against gold answers, ties, confidence intervals, faithfulness AUC and SRG.

Everything here is numpy on small arrays: one sample's (steps, n_context) score matrix at a time.
"""
from __future__ import annotations

import math

import numpy as np

FRACTIONS = (0.0, 0.01, 0.05, 0.10, 0.15, 0.20)


def average_precision(scores, labels) -> float:
    """Step-wise average precision, as sklearn.metrics.average_precision_score (no interpolation).

    AP = sum over distinct score thresholds, highest first, of (R_k - R_{k-1}) * P_k; tokens with equal
    scores enter together. With no positive label the result is 0.0 (the paper's score for an answer
    that maps to no context token); sklearn warns and returns 0 there too.
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} differ in length")
    if scores.size == 0:
        raise ValueError("no scores")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinity")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0/1")
    labels = labels.astype(np.float64)
    order = np.argsort(-scores, kind="mergesort")
    ranked, hits = scores[order], labels[order]
    last_of_each_value = np.r_[np.flatnonzero(np.diff(ranked)), ranked.size - 1]
    true_pos = np.cumsum(hits)[last_of_each_value]
    if true_pos[-1] == 0:
        return 0.0
    precision = true_pos / (last_of_each_value + 1)
    recall = true_pos / true_pos[-1]
    return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def auc_pr_sample(step_scores, gold_labels, *, aggregate=None) -> dict:
    """The paper's per-sample AUC-PR.

    step_scores: (steps, n_context), row k-1 = the scores after generated token k (any monotone form:
    log c ranks like z without z's ties). gold_labels: one 0/1 vector (n_context,) per gold answer.
    aggregate: the (n_context,) score of the aggregate row; default the mean of the step rows.
    Returns {"best": max over steps of the mean-over-answers AP, "best_step": its zero-based row (the
    first on ties), "step_mean": mean over steps, "aggregate": AP of the aggregate row, "per_step": list,
    "unmatched_answers": how many gold vectors mark no token (each scored 0)}.
    """
    step_scores = np.asarray(step_scores, dtype=np.float64)
    if step_scores.ndim != 2 or step_scores.shape[0] == 0 or step_scores.shape[1] == 0:
        raise ValueError(f"step_scores must be (steps >= 1, n_context >= 1), got {step_scores.shape}")
    if len(gold_labels) == 0:
        raise ValueError("no gold answer: skip (and count) such questions before scoring")
    per_step = [float(np.mean([average_precision(row, y) for y in gold_labels])) for row in step_scores]
    best_step = int(np.argmax(per_step))
    aggregate = step_scores.mean(axis=0) if aggregate is None else np.asarray(aggregate, dtype=np.float64)
    return {
        "best": per_step[best_step],
        "best_step": best_step,
        "step_mean": float(np.mean(per_step)),
        "aggregate": float(np.mean([average_precision(aggregate, y) for y in gold_labels])),
        "per_step": per_step,
        "unmatched_answers": int(sum(not np.any(y) for y in gold_labels)),
    }


def count_ties(scores) -> int:
    """How many entries of a 1-D score vector equal at least one other entry."""
    scores = np.asarray(scores).ravel()
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    return int(np.sum(counts[inverse] > 1))


def paper_form_zscores(log_c, dtype=np.float32) -> np.ndarray:
    """z-scores computed as the paper writes them: c = exp(log c) in `dtype`, with no shift by the maximum.

    At alpha = 1 a deep model's log c falls below log(tiny) and c underflows to exact zeros: the ties that
    count_ties measures. log_c: (..., N) -> (..., N) in `dtype` (zeros where the standard deviation is 0).
    """
    c = np.exp(np.asarray(log_c, dtype=dtype))
    std = c.std(axis=-1, keepdims=True)
    centred = c - c.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(std > 0, centred / np.where(std > 0, std, 1), 0).astype(dtype)


def mean_ci(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student-t interval mean +- t * s / sqrt(n) (the normal one for large n).

    One value gives (v, nan, nan): no spread can be estimated from a single sample.
    """
    values = np.asarray(values, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("no values")
    mean = float(values.mean())
    if values.size == 1:
        return mean, math.nan, math.nan
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def curve_auc(values, fractions=FRACTIONS) -> float:
    """AUC of a faithfulness curve: values / values[0], trapezoid over the fractions, divided by their span.

    values[i] is the metric with fractions[i] of the context masked; fractions[0] must be 0. NaN when the
    curve cannot be normalised (values[0] == 0, e.g. a ROUGE-L of 0 at f = 0, or a non-finite value):
    count such samples rather than drop them silently.
    """
    values = np.asarray(values, dtype=np.float64)
    fractions = np.asarray(fractions, dtype=np.float64)
    if values.shape != fractions.shape or fractions.size < 2:
        raise ValueError(f"need one value per fraction (>= 2), got {values.shape} and {fractions.shape}")
    if fractions[0] != 0 or np.any(np.diff(fractions) <= 0):
        raise ValueError("fractions must start at 0 and increase")
    if values[0] == 0 or not np.isfinite(values).all():
        return math.nan
    relative = values / values[0]
    area = float(np.sum(np.diff(fractions) * (relative[1:] + relative[:-1]) / 2))
    return area / float(fractions[-1])


def srg(lif_values, mif_values, fractions=FRACTIONS) -> float:
    """Symmetric relevance gain: AUC of the least-important-first curve minus that of the most-important-first.

    Positive for a faithful method when higher metric values are better (ROUGE-L, mean logit); negative
    when lower is better (perplexity).
    """
    return curve_auc(lif_values, fractions) - curve_auc(mif_values, fractions)


def share_before_answer(best_steps, answer_steps) -> dict:
    """Share of samples whose best step comes no later than the step that generates the answer's first token.

    Both are zero-based step rows; row k scores the pass that produces generated token k, so a best step
    equal to the answer step was computed before the answer token existed. answer_steps entries of None
    (the gold answer never appears in the generation) are counted apart.
    """
    if len(best_steps) != len(answer_steps):
        raise ValueError("one answer step per best step")
    found = [(b, a) for b, a in zip(best_steps, answer_steps) if a is not None]
    return {
        "share": float(np.mean([b <= a for b, a in found])) if found else math.nan,
        "n": len(found),
        "n_answer_not_generated": len(best_steps) - len(found),
    }
