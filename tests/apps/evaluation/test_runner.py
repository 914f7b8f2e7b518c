"""The evaluation runner: recorded rows against explain() and the float64 references, rollout against an
independent computation, and the `macs-kernels eval` command end to end (smoke run, report, resume)."""
import json

import numpy as np
import pytest
import torch

from macs_kernels import explain, ops
from macs_kernels.apps.evaluation.methods import MethodUnavailable, parse_method
from macs_kernels.apps.evaluation.record import (
    attention_mean_from_record,
    generate_record,
    macs_from_record,
    rollout_rows,
)
from macs_kernels.apps.evaluation.scoring import at2_from_record
from macs_kernels.ops import reference
from tests.apps.evaluation import stqa_350
from tests.helpers import default_model, qa, tiny_llama

ABLATIONS = [
    {}, {"pooling": "mean"}, {"pooling": "min"}, {"alpha": 0.2}, {"alpha": 0.5}, {"alpha": 1.0},
    {"redistribute": False},
]


def test_record_of_one_generation_gives_explains_log_c():
    model, tokenizer = default_model()
    explanation = explain(model, tokenizer, qa(0), max_new_tokens=6, backend="torch")
    record, generated, tracer_log_c = generate_record(
        model, tokenizer, explanation.input_ids, max_new_tokens=6, backend="torch"
    )
    assert torch.equal(generated, explanation.generated_ids)
    steps, n = explanation.step_log_c.shape
    assert record["rows"].shape == (steps, 30, 9, n) and record["mass"].shape == (steps, 30, 9)
    # Step 0 is the prefill (no generated key); later steps put mass on the generated tokens.
    assert np.all(record["mass"][0] == 0) and np.all(record["mass"][1:] > 0)
    np.testing.assert_allclose(record["rows"].sum(-1) + record["mass"], 1.0, atol=1e-5)
    for config in ({}, {"pooling": "min", "alpha": 1.0, "redistribute": False}):
        explained = explain(model, tokenizer, input_ids=explanation.input_ids, max_new_tokens=6, backend="torch",
                            **config) if config else explanation
        log_c = macs_from_record(record, **config)
        # The tracer sums 30 float32 terms: its error grows with |log c| (about 400 at alpha = 1).
        np.testing.assert_allclose(log_c, explained.step_log_c.double().numpy(), rtol=1e-6, atol=1e-4)
    assert torch.allclose(tracer_log_c, explanation.step_log_c)


def test_recorded_norm_rows_give_explains_norm_log_c_and_the_eager_reference():
    from tests.helpers import eager_norm_log_c

    model, tokenizer = default_model()
    explanation = explain(model, tokenizer, qa(1), max_new_tokens=5, backend="torch", attention="norm")
    record, generated, _ = generate_record(model, tokenizer, explanation.input_ids, max_new_tokens=5,
                                           attentions=("norm",), backend="torch")
    assert torch.equal(generated, explanation.generated_ids) and "efficient_rows" not in record
    np.testing.assert_allclose(record["norm_rows"].sum(-1) + record["norm_mass"], 1.0, atol=1e-5)
    log_c = macs_from_record(record, attention="norm")
    np.testing.assert_allclose(log_c, explanation.step_log_c.double().numpy(), rtol=1e-6, atol=1e-4)
    reference = eager_norm_log_c(model, explanation.input_ids, generated).numpy()
    np.testing.assert_allclose(log_c, reference, rtol=0, atol=1e-3)
    assert np.abs(log_c - macs_from_record(record)).max() > 0.1  # the weighting matters on this model


def test_at2_from_the_record_equals_at2_attributor_token_scores():
    from macs_kernels.apps.at2 import AT2Attributor
    from macs_kernels.apps.evaluation.alignment import align_qa
    from tests.helpers import QUESTIONS

    model, tokenizer = default_model()
    question, context = QUESTIONS[0]
    alignment = align_qa(tokenizer, question, context)
    record, generated, _ = generate_record(model, tokenizer, torch.tensor(alignment.input_ids), max_new_tokens=6)
    theta = torch.rand(30, 9)
    response = generated[:-1] if int(generated[-1]) == tokenizer.eos_token_id else generated
    want = AT2Attributor(model, tokenizer, theta).explain(question, context, response_ids=response, sources="token")
    per_step, aggregate = at2_from_record(record, theta.double().numpy(), len(response))
    start, stop = alignment.context_tokens
    assert per_step.shape == (len(generated), len(alignment.input_ids))
    np.testing.assert_allclose(aggregate[start:stop], want.scores.double().numpy(), rtol=1e-5, atol=1e-6)


def _synthetic_record(rng, steps=3, layers=4, heads=3, n=7, negative=False):
    full, rows, mass = [], [], []
    for k in range(steps):
        p = rng.dirichlet(np.full(n + k, 0.3), size=(layers, heads))
        if negative:  # efficient rows: same sums, some negative entries
            p = p + rng.normal(0, 0.05, p.shape)
            p -= (p.sum(-1, keepdims=True) - 1) / p.shape[-1]
        full.append(p)
        rows.append(p[..., :n])
        mass.append(p[..., n:].sum(-1))
    return full, {"rows": np.stack(rows), "mass": np.stack(mass)}


@pytest.mark.parametrize("config", ABLATIONS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "paper")
def test_macs_from_record_equals_the_layer_reference(config):
    rng = np.random.default_rng(3)
    full, record = _synthetic_record(rng)
    eff_full, eff = _synthetic_record(rng, negative=True)
    record |= {"efficient_rows": eff["rows"], "efficient_mass": eff["mass"]}
    for attention, rows in (("softmax", full), ("efficient", eff_full)):
        got = macs_from_record(record, attention=attention, **config)
        for k, step in enumerate(rows):
            # The record keeps one mass column for the generated keys; the references see every key.
            want = sum(reference.layer_log_term_reference(torch.from_numpy(layer), 7, **config) for layer in step)
            np.testing.assert_allclose(got[k], want.numpy(), rtol=1e-12, atol=1e-12)
            # And the torch backend, which shares no code with the reference, in float32.
            backend = torch.zeros(1, 7)
            for layer in step:
                ops.macs_update_rows(torch.from_numpy(layer)[None].float(), backend, input_start=0, input_end=7,
                                     kv_len=layer.shape[-1], backend="torch", **config)
            np.testing.assert_allclose(got[k], backend[0].double().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention_mean_from_record(record)[1], np.mean([r[:, :7] for r in full[1]], axis=(0, 1)))
    with pytest.raises(ValueError, match="no efficient rows"):
        macs_from_record({"rows": record["rows"], "mass": record["mass"]}, attention="efficient")


def test_macs_aggregate_is_the_explanations_whole_answer_score():
    """The eval's aggregate row is Explanation.scores (the named default), cut to the context; every named
    whole-answer score's AUC-PR is kept beside it."""
    from macs_kernels.api.explanation import Explanation
    from macs_kernels.apps.evaluation.metrics import average_precision
    from macs_kernels.apps.evaluation.scoring import method_scores, score_auc
    from macs_kernels.core.scores import AGGREGATIONS, DEFAULT_AGGREGATION

    _, record = _synthetic_record(np.random.default_rng(5), steps=4, n=9)
    log_c = macs_from_record(record)
    explanation = Explanation(input_ids=torch.arange(9), generated_ids=torch.arange(4), input_tokens=["t"] * 9,
                              generated_tokens=["g"] * 4, step_log_c=torch.from_numpy(log_c).float(), config={})
    scores = method_scores(parse_method("macs"), 0, record, None, 4, 9, (2, 8))
    np.testing.assert_allclose(scores["aggregate"], explanation.scores[2:8].double().numpy(), rtol=1e-5, atol=1e-5)
    assert set(scores["aggregates"]) == set(AGGREGATIONS)
    assert scores["aggregate"] is scores["aggregates"][DEFAULT_AGGREGATION]
    for name in AGGREGATIONS:
        np.testing.assert_allclose(scores["aggregates"][name], explanation.whole_answer(name)[2:8].double().numpy(),
                                   rtol=1e-5, atol=1e-5)
    labels = [np.array([0, 1, 1, 0, 0, 0]), np.array([0, 0, 0, 0, 1, 0])]
    line = score_auc(parse_method("macs"), 0, scores, labels)
    for name, value in line["aggregates"].items():
        assert value == np.mean([average_precision(scores["aggregates"][name], y) for y in labels])
    assert line["aggregate"] == line["aggregates"][DEFAULT_AGGREGATION]


@torch.no_grad()
def test_rollout_equals_a_per_step_vector_recursion():
    model = tiny_llama()
    torch.manual_seed(1)
    prompt, generated = torch.randint(2, 90, (9,)), torch.randint(2, 90, (4,))
    previous = model.config._attn_implementation
    got = rollout_rows(model, prompt, generated)
    assert model.config._attn_implementation == previous
    ids = torch.cat([prompt, generated])
    for k in range(4):
        # Independent: a forward over this step's prefix only, the rollout row pulled back layer by layer.
        prefix = ids[: 9 + k][None]
        model.set_attn_implementation("eager")
        attentions = model(prefix, output_attentions=True).attentions
        model.set_attn_implementation(previous)
        row = np.zeros(9 + k)
        row[-1] = 1.0
        for layer in reversed(attentions):
            a = layer[0].double().mean(0).numpy() + np.eye(9 + k)
            row = row @ (a / a.sum(1, keepdims=True))
        np.testing.assert_allclose(got[k], row[:9], rtol=1e-5, atol=1e-9)  # float32 attentions of two forwards


def test_method_names():
    assert parse_method("macs").name == "macs"
    assert parse_method("macs:pool=max").name == "macs"
    assert parse_method("macs:alpha=1").name == "macs:alpha=1.0"
    config = parse_method("macs:alpha=0.5:redistribute=off").macs
    assert (config.alpha, config.redistribute, config.pooling) == (0.5, False, "max")
    assert parse_method("attention-mean").faithfulness and not parse_method("rollout").faithfulness
    for bad, match in (("lime", "unknown method"), ("macs:pool=median", "pooling"), ("macs:beta=1", "bad MACS"),
                       ("rollout:alpha=1", "takes no options"), ("macs:alpha=2", "alpha")):
        with pytest.raises(ValueError, match=match):
            parse_method(bad)
    try:
        parse_method("at2")
    except MethodUnavailable as error:
        assert "at2" in str(error)


def test_all_methods_and_method_ranges():
    from macs_kernels.apps.evaluation.data import QASample
    from macs_kernels.apps.evaluation.methods import ALL_METHODS, parse_method_ranges, parse_methods

    try:
        methods = parse_methods("all", parse_method_ranges(["attnlrp=250:260", "macs:pool=max=0:5"]))
    except MethodUnavailable:  # no AT2 coefficients in this installation
        pytest.skip("at2 unavailable")
    assert [m.name for m in methods] == [parse_method(n).name for n in ALL_METHODS]
    ranged = {m.name: m for m in methods}
    assert ranged["attnlrp"].indices == (250, 260) and ranged["macs"].indices == (0, 5)  # canonical name
    at = [QASample(index, "a question?", "a context.", ()) for index in (250, 260)]
    assert ranged["attnlrp"].scores_sample(at[0]) and not ranged["attnlrp"].scores_sample(at[1])
    assert ranged["at2"].scores_sample(at[0])  # a question its coefficients never saw (test_at2_holdout)
    assert ranged["atman"].indices is None and ranged["attnlrp"] == parse_method("attnlrp")  # not in its identity
    for bad, match in ((["attnlrp"], "METHOD=START:STOP"), (["attnlrp=5:2"], "START must be below STOP"),
                       (["attnlrp=1:2", "attnlrp=3:4"], "twice"), (["atman=a:b"], "METHOD=START:STOP")):
        with pytest.raises(ValueError, match=match):
            parse_method_ranges(bad)
    with pytest.raises(ValueError, match="not among the methods"):
        parse_methods("macs,random", {"attnlrp": (0, 1)})


def test_eval_command_smoke_report_and_resume(tmp_path, capsys):
    _eval_smoke_report_and_resume(tmp_path, capsys, faithfulness=False)


@pytest.mark.slow  # the masking curves rerun the model on every masked variant of a SQuAD context: minutes here
def test_eval_command_smoke_report_and_resume_with_faithfulness(tmp_path, capsys):
    _eval_smoke_report_and_resume(tmp_path, capsys, faithfulness=True)


def _eval_smoke_report_and_resume(tmp_path, capsys, faithfulness: bool):
    from macs_kernels.apps.cli import main

    data = stqa_350()
    out, records = tmp_path / "eval.jsonl", tmp_path / "records"
    command = ["eval", "--data", str(data), "--n", "3", "--max-new-tokens", "8", "--methods", "macs,random",
               "--faithfulness-n", str(int(faithfulness)), "--out", str(out), "--records", str(records),
               "--no-progress", "--threads", "1", "--cost-n", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(command) == 0
        first = capsys.readouterr().out
        summary = json.loads(out.with_suffix(".json").read_text())
        assert out.with_suffix(".md").read_text().startswith("Model: SmolLM2-135M-Instruct")
        assert out.with_suffix(".png").stat().st_size > 0
        assert "eval: 3 generations this run, 0 taken from the record cache" in first
        assert {"model", "data", "n", "skipped", "methods"} <= set(summary)
        assert summary["n"] == 3 and summary["skipped"] == {}
        for name in ("macs", "random"):
            row = summary["methods"][name]
            assert row["n"] == 3
            assert {"auc_pr", "auc_pr_step_mean", "auc_pr_aggregate", "srg", "ties"} <= set(row)
            assert 0 <= row["auc_pr"]["mean"] <= 1 and row["auc_pr"]["ci"][0] <= row["auc_pr"]["mean"]
            assert row["auc_pr_step_mean"]["mean"] <= row["auc_pr"]["mean"]
            if faithfulness:
                assert set(row["srg"]) == {"perplexity", "rouge_l", "logit"} and row["srg"]["logit"]["n"] == 1
        lines = out.read_text().splitlines()
        # run, samples, AUC per (sample, method), faithfulness, cost of macs, random and plain generation on sample 0
        assert len(lines) == 1 + 3 + 6 + 2 * faithfulness + 3
        costs = [line for line in map(json.loads, lines) if line["kind"] == "cost"]
        steps = {line["index"]: line["steps"] for line in map(json.loads, lines) if line["kind"] == "sample"}
        assert sorted(c["method"] for c in costs) == ["generation", "macs", "random"]
        assert all(c["index"] == 0 and c["steps"] == steps[0] and c["seconds"] > 0 for c in costs)
        assert summary["methods"]["macs"]["cost"]["samples"] == [0] == summary["generation_cost"]["samples"]
        assert summary["methods"]["macs"]["cost"]["seconds_per_token"]["mean"] == pytest.approx(
            next(c["seconds"] for c in costs if c["method"] == "macs") / steps[0])

        # Resumed: nothing generated again; an added ablation is scored from the stored records, and the
        # masking curves of a later sample (--faithfulness-from) come from them too.
        methods = command.index("--methods") + 1
        resumed = command[:methods] + ["macs,random,macs:pool=mean"] + command[methods + 1:]
        assert main(resumed + ["--faithfulness-from", "2"]) == 0
        second = capsys.readouterr().out
        assert "eval: 0 generations this run" in second
        assert f"AUC-PR lines: 3 scored, 6 reused; faithfulness curves: {2 * faithfulness} computed, 0 reused" in second
        assert out.read_text().splitlines()[: len(lines)] == lines
        assert json.loads(out.with_suffix(".json").read_text())["methods"]["macs:pool=mean"]["n"] == 3
        curves = [line for line in map(json.loads, out.read_text().splitlines()) if line["kind"] == "faithfulness"]
        assert sorted((c["index"], c["method"]) for c in curves) == (
            [(0, "macs"), (0, "random"), (2, "macs"), (2, "random")] if faithfulness else [])

        assert main(["eval", "--report-only", "--out", str(out)]) == 0
        assert "| macs:pool=mean | 3 |" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
