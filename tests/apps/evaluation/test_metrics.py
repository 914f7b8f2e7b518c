import math

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from macs_kernels.apps.evaluation.metrics import (
    auc_pr_sample,
    average_precision,
    count_ties,
    curve_auc,
    mean_ci,
    paper_form_zscores,
    share_before_answer,
    srg,
)


@pytest.mark.parametrize(
    "scores, labels, expected",
    [
        # P = 1 at R = 1/2, then 2/3 at R = 1.
        ([0.9, 0.8, 0.7, 0.6], [1, 0, 1, 0], 0.5 * 1 + 0.5 * 2 / 3),
        # A tie enters as one threshold: (R, P) = (1/2, 1/2), (1, 1/2). Ranking the positive first would give 0.75.
        ([1.0, 1.0, 0.0, 0.0], [1, 0, 0, 1], 0.5),
        ([3, 2, 2, 2, 1], [0, 1, 0, 0, 1], 0.5 * 1 / 4 + 0.5 * 2 / 5),
        # A one-token answer ranked second.
        ([0.1, 0.5, 0.3, 0.2, 0.0], [0, 0, 1, 0, 0], 0.5),
        # An answer that maps to no context token scores 0.
        ([0.1, 0.5, 0.3], [0, 0, 0], 0.0),
        ([7.0], [1], 1.0),
    ],
)
def test_average_precision_hand_values(scores, labels, expected):
    assert average_precision(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_average_precision_matches_sklearn_on_random_cases():
    rng = np.random.default_rng(0)
    for case in range(200):
        n = int(rng.integers(1, 60))
        labels = rng.random(n) < rng.uniform(0.05, 0.5)
        labels[rng.integers(n)] = True
        # Every other case draws scores from a few values: ties everywhere.
        scores = rng.integers(0, 4, n).astype(float) if case % 2 else rng.normal(size=n)
        assert average_precision(scores, labels) == pytest.approx(average_precision_score(labels, scores), abs=1e-12)


def test_average_precision_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        average_precision([0.1, math.nan], [1, 0])
    with pytest.raises(ValueError, match="differ"):
        average_precision([0.1, 0.2], [1, 0, 1])
    with pytest.raises(ValueError, match="0/1"):
        average_precision([0.1, 0.2], [2, 0])


def test_auc_pr_sample_several_gold_answers():
    steps = [[4, 3, 2, 1], [1, 2, 3, 4]]
    gold = [np.array([1, 0, 0, 0]), np.array([0, 0, 1, 1])]
    # step 0: AP = 1 and 1/2 * 1/3 + 1/2 * 2/4 = 5/12; step 1: 1/4 and 1. The mean row ties everywhere.
    result = auc_pr_sample(steps, gold)
    assert result["per_step"] == pytest.approx([17 / 24, 15 / 24])
    assert result["best"] == pytest.approx(17 / 24)
    assert result["best_step"] == 0
    assert result["step_mean"] == pytest.approx(16 / 24)
    assert result["aggregate"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    # An unmatched gold answer counts as 0 in the mean over answers; an explicit aggregate row is used as given.
    with_missing = auc_pr_sample(steps, [*gold, np.zeros(4, dtype=int)], aggregate=[0, 0, 1, 1])
    assert with_missing["best"] == pytest.approx(17 / 24 * 2 / 3)
    assert (with_missing["best_step"], with_missing["unmatched_answers"], result["unmatched_answers"]) == (0, 1, 0)
    assert with_missing["aggregate"] == pytest.approx((1 / 4 + 1 + 0) / 3)  # A ties with all four at 0


def test_auc_pr_sample_best_step_is_the_later_row_when_it_wins():
    result = auc_pr_sample([[0, 1, 2], [2, 1, 0], [2, 1, 0]], [np.array([1, 0, 0])])
    assert (result["best"], result["best_step"]) == (1.0, 1)
    with pytest.raises(ValueError, match="no gold answer"):
        auc_pr_sample([[0, 1, 2]], [])


def test_ties_of_the_paper_form():
    assert count_ties([1, 2, 2, 3, 3, 3]) == 5
    assert count_ties([0.5, -0.5, 1.5]) == 0
    # exp underflows to 0 in float32 below about -104; the log-domain scores stay distinct.
    log_c = np.array([0.0, -5.0, -200.0, -300.0, -400.0])
    z = paper_form_zscores(log_c)
    assert z.dtype == np.float32
    assert count_ties(z) == 3
    assert count_ties(log_c) == 0
    assert average_precision(log_c, [0, 0, 1, 0, 0]) == pytest.approx(1 / 3)
    assert average_precision(z, [0, 0, 1, 0, 0]) == pytest.approx(1 / 5)
    np.testing.assert_array_equal(paper_form_zscores(np.full((2, 3), -500.0)), np.zeros((2, 3)))


def test_mean_ci_student_t():
    mean, low, high = mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t(0.975, 3) * s / sqrt(n)
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - half, 2.5 + half))
    single = mean_ci([0.3])
    assert single[0] == 0.3 and math.isnan(single[1]) and math.isnan(single[2])


def test_curve_auc_and_srg_hand_values():
    # relative [1, 1, .9, .8, .7, .5]: trapezoids .01 + .038 + .0425 + .0375 + .03 = .158, / .2
    assert curve_auc([2, 2, 1.8, 1.6, 1.4, 1.0]) == pytest.approx(0.79)
    assert srg([3] * 6, [2, 2, 1.8, 1.6, 1.4, 1.0]) == pytest.approx(0.21)
    # Perplexity rises faster when the important tokens go first: SRG is negative for a faithful method.
    assert srg([10, 10, 10, 10, 10, 11], [10, 12, 15, 20, 25, 30]) == pytest.approx(1.0125 - 2.0125)
    assert curve_auc([4, 2], fractions=[0, 0.5]) == pytest.approx(0.75)
    assert math.isnan(curve_auc([0, 0.2, 0.1, 0, 0, 0]))
    with pytest.raises(ValueError, match="one value per fraction"):
        curve_auc([1, 2, 3])


def test_share_before_answer():
    result = share_before_answer([0, 3, 2, 5], [1, 3, None, 4])
    assert result == {"share": pytest.approx(2 / 3), "n": 3, "n_answer_not_generated": 1}
