"""User-facing scores rank as log c does (the paper's z-scores of c tie under the attention sink); top_k;
the same definition in JSON; errors before generation for ids outside the vocabulary and for
return_dict_in_generate."""
import json

import numpy as np
import pytest
import torch

from macs_kernels import explain
from macs_kernels.api.explanation import AGGREGATIONS, DEFAULT_AGGREGATION, Explanation, log_zscores
from macs_kernels.apps.evaluation.alignment import align_qa
from macs_kernels.core.scores import RunningWholeAnswer
from macs_kernels.ops import reference
from tests.helpers import QUESTIONS, default_model, tiny_llama

TOLERANCE = 1e-5
# Differences in log c above this must show in the scores with the same sign.
LOG_GAP = 1e-3


def _explanation(log_c, source_span=None):
    steps, n = log_c.shape
    return Explanation(
        input_ids=torch.arange(n), generated_ids=torch.arange(steps), input_tokens=[f"t{i}" for i in range(n)],
        generated_tokens=[f"g{k}" for k in range(steps)], step_log_c=log_c, config={}, source_span=source_span,
    )


def _order_violations(log_c: torch.Tensor, scores: torch.Tensor) -> int:
    """Pairs of tokens whose log c differ by more than LOG_GAP but whose scores do not order them alike."""
    d_log = log_c.double()[:, None] - log_c.double()[None, :]
    d_score = scores.double()[:, None] - scores.double()[None, :]
    apart = d_log.abs() > LOG_GAP
    return int((torch.sign(d_log[apart]) != torch.sign(d_score[apart])).sum())


def _sink_row(n=60, seed=0):
    """A prompt's log c as on a real model: the sink near 0, every other token near -35."""
    generator = torch.Generator().manual_seed(seed)
    row = -35.0 + 3.0 * torch.rand(n, generator=generator)
    row[0] = -0.01
    return row


def test_log_zscores_match_the_reference_with_underflow_and_constant_rows():
    log_c = torch.randn(4, 113) * 5 - 20
    log_c[1, [3, 50]] = float("-inf")
    log_c[2] = -7.0
    log_c[3] = float("-inf")
    got = log_zscores(log_c)
    assert got.dtype == torch.float32 and got.shape == log_c.shape
    ref = reference.log_zscore_reference(log_c)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite) and (got[~finite] == float("-inf")).all()
    assert (got.double()[finite] - ref[finite]).abs().max() <= TOLERANCE
    assert not got[2].any()  # equal log c: all scores 0


def test_scores_rank_as_log_c_where_the_paper_form_ties():
    log_c = torch.stack([_sink_row(seed=k) for k in range(3)])
    explanation = _explanation(log_c)
    for k in range(3):
        assert _order_violations(log_c[k], explanation.step_scores[k]) == 0
        assert _order_violations(log_c[k], explanation.paper_step_scores[k]) > 100  # ties in float32
    mean = log_c.mean(0)
    assert _order_violations(mean, explanation.whole_answer("mean_log_c")) == 0
    assert _order_violations(mean, explanation.paper_scores) > 100
    assert torch.allclose(explanation.paper_step_scores.double(),
                          reference.macs_zscore_reference(log_c, torch.full((3,), 60)), atol=1e-5)


def test_top_k_steps_spans_and_ties():
    log_c = torch.tensor([[0.0, -3.0, -1.0, -2.0, float("-inf"), -1.0],
                          [0.0, -1.0, -4.0, -2.0, -3.0, -5.0]])
    explanation = _explanation(log_c, source_span=(1, 5))
    # over steps: mean log c = [0, -2, -2.5, -2, -inf, -3]; ties keep prompt order
    assert [i for i, _, _ in explanation.top_k(6, span="all", how="mean_log_c")] == [0, 1, 3, 2, 5, 4]
    # max z - mean z over the steps (z of the finite entries): [0.046, 1.224, 0.635, 0.441, -inf, 0.928]
    assert [i for i, _, _ in explanation.top_k(6, span="all", how="max_minus_mean_z")] == [1, 5, 2, 3, 0, 4]
    assert explanation.top_k(1, span="all", how="max_minus_mean_z")[0][2] == pytest.approx(1.224, abs=1e-3)
    # the same with each step's mean and deviation taken without its top token (token 0 at both steps):
    # z = [2.111, -1.508, 0.905, -0.302, -inf, 0.905] and [2.121, 1.414, -0.707, 0.707, 0, -1.414],
    # max - mean = [0.005, 1.461, 0.806, 0.504, -inf, 1.159]
    sinkless = explanation.top_k(6, span="all", how="max_minus_mean_sinkless_z")
    assert [i for i, _, _ in sinkless] == [1, 5, 2, 3, 0, 4]
    assert sinkless[0][2] == pytest.approx(1.461, abs=1e-3) and sinkless[1][2] == pytest.approx(1.159, abs=1e-3)
    # the default adds each token's best run minus its mean; two steps make runs of 2, the first step's -inf
    # counted at its lowest finite z (-1.508): runs from tokens 0-4 are worth [1.414, -1.508, 0.707, -0.302,
    # -1.508], so the best run per token is [1.414, 1.414, 0.707, 0.707, -0.302, -1.508] and the scores
    # [-0.697, 2.922, 1.414, 1.009, -inf, -0.095]
    assert [i for i, _, _ in explanation.top_k(6, span="all")] == [1, 2, 3, 5, 0, 4]
    best = explanation.top_k(2, span="all")
    assert best[0][:2] == (1, "t1") and best[0][2] == pytest.approx(2.922, abs=1e-3)
    assert best[1][2] == pytest.approx(1.414, abs=1e-3)
    assert [i for i, _, _ in explanation.top_k(2, span="all", step=0)] == [0, 2]
    assert [i for i, _, _ in explanation.top_k(3, span="all", step=-1)] == [0, 1, 3]
    assert [i for i, _, _ in explanation.top_k(10, span=True)] == [1, 2, 3, 4]  # all of the span, -inf last
    assert explanation.top_k(10, span=True)[-1][2] == float("-inf")
    assert [i for i, _, _ in explanation.top_k(1, step=1, span=(2, 6))] == [3]


@pytest.mark.parametrize("call, message", [
    (lambda e: e.top_k(0), "k must be an integer >= 1"),
    (lambda e: e.top_k(True), "k must be an integer >= 1"),
    (lambda e: e.top_k(2, step=2), "step 2 is out of range: 2 tokens"),
    (lambda e: e.top_k(2, step=-3), "step -3 is out of range"),
    (lambda e: e.top_k(2, span=(3, 3)), r"span \[3, 3\) is not a non-empty range of the 6 prompt tokens"),
    (lambda e: e.top_k(2, span=(0, 7)), r"span \[0, 7\)"),
    (lambda e: e.top_k(2, span="context"), 'span must be None, True, "all" or a'),
    (lambda e: _explanation(e.step_log_c).top_k(2, span=True), "span=True needs a source_span"),
    (lambda e: e.top_k(2, how="median"),
     "unknown aggregation 'median'; choose one of max_plus_run_minus_mean_sinkless_z, max_minus_mean_sinkless_z"),
    (lambda e: e.top_k(2, step=0, how="max_z"), "a step or an aggregation"),
])
def test_bad_top_k_arguments_raise(call, message):
    explanation = _explanation(torch.randn(2, 6), source_span=(1, 5))
    with pytest.raises(ValueError, match=message):
        call(explanation)


def test_json_holds_both_forms_and_null_for_underflow():
    log_c = torch.stack([_sink_row(8), _sink_row(8, seed=1)])
    log_c[1, 3] = float("-inf")
    explanation = _explanation(log_c)
    text = explanation.to_json()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text)
    assert data["step_scores"][1][3] is None and data["step_log_c"][1][3] is None and data["scores"][3] is None
    finite = torch.isfinite(explanation.step_scores)
    got = torch.tensor([[v if v is not None else float("-inf") for v in row] for row in data["step_scores"]])
    torch.testing.assert_close(got[finite], explanation.step_scores[finite], rtol=0, atol=6e-5)  # 4 decimals
    stored = torch.tensor([[v if v is not None else float("-inf") for v in row] for row in data["step_log_c"]])
    torch.testing.assert_close(stored, log_c, rtol=6e-7, atol=0)  # float32's 7 significant digits
    assert "log consistency" in data["score_definition"] and DEFAULT_AGGREGATION in data["score_definition"]
    assert data["aggregation"] == DEFAULT_AGGREGATION


# ---- on the default model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hamlet():
    model, tokenizer = default_model()
    question, context = QUESTIONS[0]
    alignment = align_qa(tokenizer, question, context)
    explanation = explain(model, tokenizer, input_ids=torch.tensor(alignment.input_ids), max_new_tokens=5,
                          backend="torch")
    explanation.source_span = alignment.context_tokens
    return explanation


def test_real_model_scores_are_distinct_and_rank_as_log_c(hamlet):
    n = len(hamlet.input_ids)
    mean = hamlet.step_log_c.mean(0)
    assert torch.isfinite(mean).all()
    distinct_log_c = torch.unique(torch.round(mean / LOG_GAP)).numel()
    assert distinct_log_c > 0.9 * n
    assert torch.unique(hamlet.whole_answer("mean_log_c")).numel() >= distinct_log_c
    assert _order_violations(mean, hamlet.whole_answer("mean_log_c")) == 0
    assert torch.unique(hamlet.scores).numel() > 0.9 * n
    torch.testing.assert_close(hamlet.scores.double(), _whole_answer_reference(hamlet.step_log_c, DEFAULT_AGGREGATION),
                               rtol=0, atol=TOLERANCE)
    assert _order_violations(mean, hamlet.paper_scores) > 0  # what users got before: ties under the sink
    for k in range(len(hamlet.generated_ids)):
        assert _order_violations(hamlet.step_log_c[k], hamlet.step_scores[k]) == 0
    ref = reference.log_zscore_reference(hamlet.step_log_c)
    assert (hamlet.step_scores.double() - ref).abs().max() <= TOLERANCE


def test_real_model_top_k_is_the_argsort_of_log_c(hamlet):
    mean = hamlet.step_log_c.mean(0)
    assert [i for i, _, _ in hamlet.top_k(10, span="all", how="mean_log_c")] == torch.argsort(mean, descending=True)[
        :10].tolist()
    whole = _whole_answer_reference(hamlet.step_log_c, DEFAULT_AGGREGATION)
    assert [i for i, _, _ in hamlet.top_k(10, span="all")] == torch.argsort(whole, descending=True)[:10].tolist()
    for k in range(len(hamlet.generated_ids)):
        want = torch.argsort(hamlet.step_log_c[k], descending=True)[:5].tolist()
        assert [i for i, _, _ in hamlet.top_k(5, span="all", step=k)] == want
    start, end = hamlet.source_span
    in_context = [i for i, _, _ in hamlet.top_k(5, span=True)]
    assert in_context == (start + torch.argsort(whole[start:end], descending=True)[:5]).tolist()
    assert all(hamlet.input_tokens[i] == token for i, token, _ in hamlet.top_k(5, span=True))


# ---- errors before generation -------------------------------------------------------------------------
@pytest.fixture
def no_generation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("generation ran")

    model, tokenizer = default_model()
    monkeypatch.setattr(model, "generate", refuse)
    return model, tokenizer


@pytest.mark.parametrize("bad", [49152, -1], ids=["vocab", "negative"])
def test_input_ids_outside_the_vocabulary_raise_before_generation(no_generation, bad):
    model, tokenizer = no_generation
    with pytest.raises(ValueError, match=rf"input_ids: 1 token id\(s\) outside the model's vocabulary \[0, 49152\): "
                                         rf"{bad} \(prompt 0, position 2\)"):
        explain(model, tokenizer, input_ids=torch.tensor([1, 5, bad, 7]), max_new_tokens=2)


def test_a_tokenizer_of_another_model_is_named():
    _, tokenizer = default_model()
    with pytest.raises(ValueError, match=r"the tokenizer's ids \(is it the model's tokenizer\?\).*\[0, 97\)"):
        explain(tiny_llama(), tokenizer, "Who wrote Hamlet?", max_new_tokens=2)


def test_return_dict_in_generate_is_refused_before_generation(no_generation):
    model, tokenizer = no_generation
    with pytest.raises(ValueError, match="return_dict_in_generate=True is not supported"):
        explain(model, tokenizer, "Who wrote Hamlet?", max_new_tokens=2, return_dict_in_generate=True)


def test_a_generation_config_asking_for_a_dict_still_explains():
    _, tokenizer = default_model()
    model = tiny_llama()
    model.generation_config.return_dict_in_generate = True
    explanation = explain(model, tokenizer, input_ids=torch.tensor([1, 5, 9, 14, 20]), max_new_tokens=3)
    assert isinstance(explanation, Explanation) and explanation.step_log_c.shape[1] == 5


# ---- the whole-answer score family ----------------------------------------------------------------------
def _whole_answer_reference(log_c: torch.Tensor, how: str) -> torch.Tensor:
    """Each aggregation written out in numpy, row by row (population std over the finite entries of a row)."""
    rows = log_c.double().numpy()

    def z(row, sinkless=False):
        finite = np.isfinite(row)
        counted = finite.copy()
        if sinkless:  # the statistics leave out the row's top entry, which is still scored
            counted[np.argmax(row)] = False
        values = row[counted]
        std = values.std()
        if sinkless and std == 0:  # nothing but the top varies: the plain z-scores
            return z(row)
        return np.where(finite, (row - values.mean()) / std if std > 0 else 0.0, -np.inf)

    if how == "mean_log_c":
        return torch.from_numpy(z(rows.mean(0)))
    if how == "paper_mean_z":
        out = []
        for row in rows:
            c = np.exp(row - row.max())
            out.append((c - c.mean()) / c.std())
        return torch.from_numpy(np.mean(out, 0))
    zs = np.stack([z(row, sinkless=how.endswith("_sinkless_z")) for row in rows])
    top, mean = zs.max(0), zs.mean(0)
    if len(rows) == 1:  # nothing to stand out from: the step's own z-scores
        return torch.from_numpy(top)
    if how in ("max_minus_mean_z", "max_minus_mean_sinkless_z"):
        return torch.from_numpy(np.where(np.isfinite(mean), top - mean, -np.inf))
    if how == "max_plus_run_minus_mean_sinkless_z":
        runs = reference.best_runs_reference(torch.from_numpy(zs), 3).numpy()
        return torch.from_numpy(np.where(np.isfinite(mean), top - mean + runs - mean, -np.inf))
    return torch.from_numpy({"max_z": top, "mean_z": mean}[how])


@pytest.mark.parametrize("steps", [7, 1])
@pytest.mark.parametrize("how", list(AGGREGATIONS))
def test_every_whole_answer_score_equals_its_reference(how, steps):
    generator = torch.Generator().manual_seed(3)
    log_c = -30 + 4 * torch.randn(steps, 50, generator=generator)
    log_c[:, 0] = -0.01  # the attention sink
    if how != "paper_mean_z":  # the paper's z of c has no -inf: c = 0 is a value there
        log_c[min(2, steps - 1), [5, 9]] = float("-inf")
    explanation = _explanation(log_c)
    got = explanation.whole_answer(how)
    want = _whole_answer_reference(log_c, how)
    assert got.dtype == torch.float32 and got.shape == (50,)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got.double()[finite] - want[finite]).abs().max() <= TOLERANCE
    assert (got[~finite] == float("-inf")).all()


@pytest.mark.parametrize("log_c", [[[-0.1, -30.0]], [[-0.1, -30.0, -30.0, float("-inf")]]],
                         ids=["two_tokens", "equal_rest"])
def test_sinkless_zscores_of_a_row_with_nothing_but_the_top_varying_keep_its_order(log_c):
    """Without its top token such a row has no spread: it keeps the plain z-scores, the top still first."""
    log_c = torch.tensor(log_c)
    got = log_zscores(log_c, sinkless=True)
    assert torch.equal(got, log_zscores(log_c)) and got[0, 0] > got[0, 1]
    whole = _explanation(torch.cat([log_c, log_c])).scores
    assert torch.equal(torch.isfinite(whole), torch.isfinite(log_c[0]))


def test_a_streams_running_whole_answer_equals_the_reference_at_every_step():
    """The server's per-token whole-answer score from running statistics equals the default aggregation of
    every row so far (-inf entries included)."""
    log_c = -30 + 4 * torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    log_c[:, 0] = -0.01
    log_c[2, [5, 9]] = float("-inf")
    running = RunningWholeAnswer()
    for k in range(len(log_c)):
        got = running.add(log_c[k])
        want = _whole_answer_reference(log_c[: k + 1], DEFAULT_AGGREGATION)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        assert (got.double()[finite] - want[finite]).abs().max() <= TOLERANCE


def test_the_score_family_is_consistent():
    log_c = -30 + 4 * torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    explanation = _explanation(log_c)
    assert torch.equal(explanation.scores, explanation.whole_answer(DEFAULT_AGGREGATION))
    assert torch.equal(explanation.scores, explanation.whole_answer())
    assert torch.equal(explanation.score_row(), explanation.scores)
    assert torch.equal(explanation.score_row(how="mean_z"), explanation.step_scores.double().mean(0).float())
    assert torch.equal(explanation.paper_scores, explanation.paper_step_scores.mean(0))
    # max_minus_mean_z is max_z - mean_z, and a token that stands out at one step outranks one that is always high
    torch.testing.assert_close(explanation.whole_answer("max_minus_mean_z"),
                               explanation.whole_answer("max_z") - explanation.whole_answer("mean_z"))
    peaked = log_c.clone()
    peaked[:, 1] = -25.0  # always above the crowd
    peaked[:, 2] = -34.0
    peaked[3, 2] = -15.0  # far above it once
    for how in ("max_minus_mean_sinkless_z", "max_plus_run_minus_mean_sinkless_z"):
        scores = _explanation(peaked).whole_answer(how)
        assert scores[2] > scores[1]
    assert torch.equal(_explanation(torch.zeros(0, 6)).scores, torch.zeros(6))
    assert _explanation(torch.zeros(2, 0)).scores.shape == (0,)


def test_a_copied_run_outranks_a_lone_peak():
    """Tokens 20-23 read one further at each of steps 1-4 (a span being copied) outrank token 8, attended far
    more but at one step only, under the default; the score without runs ranks token 8 first."""
    log_c = -30 + torch.randn(6, 40, generator=torch.Generator().manual_seed(6))
    log_c[:, 0] = -0.01
    for step, token in zip(range(1, 5), range(20, 24)):
        log_c[step, token] = -26.0
    log_c[2, 8] = -20.0
    explanation = _explanation(log_c)
    copied, lone = explanation.scores[20:24], explanation.scores[8]
    assert (copied > lone).all()
    assert torch.topk(explanation.scores, 4).indices.sort().values.tolist() == [20, 21, 22, 23]
    without_runs = explanation.whole_answer("max_minus_mean_sinkless_z")
    assert (without_runs[20:24] < without_runs[8]).all()


def test_a_one_token_answer_ranks_its_tokens_by_its_step():
    """With one step, "above the mean over steps" is 0 for every token: the whole-answer scores would all tie (the
    CLI printed the prompt's first tokens at +0.00 as its top tokens). They are that step's z-scores instead."""
    log_c = -30 + 4 * torch.randn(1, 40, generator=torch.Generator().manual_seed(6))
    log_c[0, 0] = -0.01
    explanation = _explanation(log_c)
    assert torch.equal(explanation.scores, log_zscores(log_c, sinkless=True)[0])
    assert torch.equal(explanation.whole_answer("max_minus_mean_z"), explanation.step_scores[0])
    assert explanation.scores.unique().numel() == 40
    assert [i for i, _, _ in explanation.top_k(3)] == [i for i, _, _ in explanation.top_k(3, step=0)]
