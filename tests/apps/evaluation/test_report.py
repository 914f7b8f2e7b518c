"""The results table: a method scored on fewer samples (at2 on its held-out questions) is also compared with
every other method on exactly those samples."""
import json

import pytest

from macs_kernels.apps.evaluation.report import markdown, summarise

TIES = {"rows": 4, "tied_tokens": 0, "rows_with_ties": 0}


def _lines():
    yield {"kind": "run", "model": "m", "dtype": "float32", "max_new_tokens": 4, "data": "d"}
    for index in range(4):
        yield {"kind": "sample", "index": index, "answer_step": 1, "unmatched_answers": 0, "n_answers": 1}
    macs = {0: (0.9, 0.5), 1: (0.2, 0.1), 2: (0.6, 0.3), 3: (0.4, 0.2)}
    for index, (best, aggregate) in macs.items():
        yield {"kind": "auc", "index": index, "method": "macs", "best": best, "best_step": 0, "step_mean": best / 2,
               "aggregate": aggregate, "ties": TIES}
    for index, (best, aggregate) in {2: (0.5, 0.5), 3: (0.7, 0.4)}.items():
        yield {"kind": "auc", "index": index, "method": "at2", "best": best, "best_step": 0, "step_mean": best,
               "aggregate": aggregate, "ties": TIES}


def test_methods_are_compared_on_the_samples_the_smaller_method_scores(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in _lines()))
    summary = summarise(path)
    assert summary["methods"]["macs"]["auc_pr"]["mean"] == pytest.approx(0.525)  # all four samples
    assert set(summary["subsets"]) == {"at2"}  # macs scores every sample: no subset of its own
    subset = summary["subsets"]["at2"]
    assert subset["samples"] == 2
    assert subset["indices"] == [2, 3] and subset["baseline"] == "macs"
    macs, at2 = subset["methods"]["macs"], subset["methods"]["at2"]
    assert macs["n"] == 2 and macs["auc_pr"]["mean"] == pytest.approx(0.5)  # samples 2 and 3 only
    # Paired per sample against macs: (0.5 - 0.6, 0.7 - 0.4) and (0.5 - 0.3, 0.4 - 0.2).
    assert at2["auc_pr_minus_macs"]["mean"] == pytest.approx(0.1)
    assert at2["auc_pr_aggregate_minus_macs"]["mean"] == pytest.approx(0.2)
    assert at2["auc_pr_aggregate_minus_macs"]["ci"] == pytest.approx([0.2, 0.2])  # equal differences: no spread
    # Student-t, 1 degree of freedom: 0.1 +- 12.706 * 0.2828 / sqrt(2).
    assert at2["auc_pr_minus_macs"]["ci"] == pytest.approx([-2.441, 2.641], abs=2e-3)
    assert macs["auc_pr_minus_macs"]["mean"] == 0
    assert "On the 2 samples that at2 scores" in markdown(summary)


def test_macs_named_whole_answer_scores_are_paired_with_every_other_method_on_its_samples(tmp_path):
    lines = list(_lines())
    for line in lines:
        if line.get("method") == "macs":
            line["aggregates"] = {"a": line["aggregate"], "b": line["aggregate"] / 2}
    pooled = {"kind": "auc", "index": 0, "method": "macs:pool=mean", "best": 0.1, "best_step": 0, "step_mean": 0.1,
              "aggregate": 0.1, "ties": TIES}  # a MACS configuration: no row of its own
    rollout = {**pooled, "method": "rollout", "index": 1, "aggregate": 0.05}
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [*lines, pooled, rollout]))
    summary = summarise(path)
    against = summary["macs_whole_answer_against"]
    assert set(against) == {"at2", "rollout"}
    # at2 on samples 2 and 3 (aggregates 0.5, 0.4); macs's aggregates there 0.3 and 0.2.
    assert against["at2"]["n"] == 2 and against["at2"]["aggregate"]["mean"] == pytest.approx(0.45)
    assert against["at2"]["minus"]["a"]["mean"] == pytest.approx(-0.2)
    assert against["at2"]["minus"]["b"]["mean"] == pytest.approx((0.15 - 0.5 + 0.1 - 0.4) / 2)
    assert against["rollout"]["n"] == 1 and against["rollout"]["minus"]["a"]["mean"] == pytest.approx(0.1 - 0.05)
    text = markdown(summary)
    assert "| method | n | its aggregate | a minus it | b minus it |" in text
    assert "| at2 | 2 | 0.450" in text
