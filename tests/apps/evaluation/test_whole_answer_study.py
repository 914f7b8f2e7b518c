"""The whole-answer study's candidates (benchmarks/whole_answer.py) against their definitions and the shipped
scores."""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from macs_kernels.apps.evaluation.record import macs_from_record
from macs_kernels.core.scores import DEFAULT_AGGREGATION, log_zscores, whole_answer_scores
from macs_kernels.ops import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import whole_answer  # noqa: E402

CHOSEN = "max z minus mean z, sink out of each step's statistics"


def random_record(steps, layers, heads, n, seed=0):
    generator = np.random.default_rng(seed)
    logits = generator.normal(scale=3.0, size=(steps, layers, heads, n + 4))
    rows = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return {"rows": rows[..., :n].astype(np.float16), "mass": rows[..., n:].sum(-1)}


def sample_of(n, generated):
    prompt = np.arange(100, 100 + n)
    return {"context": (3, n - 2), "prompt": prompt, "generated": np.asarray(generated)}


def test_the_chosen_candidate_is_the_shipped_score_of_the_records_log_c():
    record = random_record(steps=6, layers=3, heads=4, n=113)
    candidates, per_layer = whole_answer.layer_candidates(sample_of(113, [5] * 6), record)
    shipped = whole_answer_scores(torch.from_numpy(macs_from_record(record)), "max_minus_mean_sinkless_z")
    np.testing.assert_allclose(candidates[CHOSEN], shipped.double().numpy(), rtol=1e-5, atol=1e-5)
    assert per_layer.shape == (113, 3)


def test_one_layer_and_all_copying_steps_reduce_to_the_chosen_score():
    record = random_record(steps=5, layers=1, heads=3, n=37, seed=1)
    copying = sample_of(37, [100 + 10] * 5)  # every generated token is a context token
    candidates, per_layer = whole_answer.layer_candidates(copying, record)
    for name in ("layers weighted alike (each layer's sinkless z summed)",
                 "each layer's max minus mean, summed over layers",
                 "max over the steps that copy a context token, minus the mean over all"):
        np.testing.assert_allclose(candidates[name], candidates[CHOSEN], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(per_layer[:, 0], candidates[CHOSEN], rtol=1e-12, atol=1e-12)
    # With no copying step every step counts; with some, only they give the maximum.
    partly = whole_answer.layer_candidates(sample_of(37, [110, 5, 5, 5, 5]), record)[0]
    z = whole_answer._sinkless_z(macs_from_record(record))
    np.testing.assert_allclose(partly["max over the steps that copy a context token, minus the mean over all"],
                               z[0] - z.mean(0), rtol=1e-12, atol=1e-12)


def test_the_answered_split_pairs_each_group_with_attnlrp():
    generator = np.random.default_rng(1)
    answered = {0: 3, 1: None, 2: 0, 3: None, 4: None}  # sample -> the step of its answer (None: no gold answer)
    samples = {i: {"answer_step": step} for i, step in answered.items()}
    lrp_name = "attnlrp: mean (relevance of the summed answer logits)"
    norm_name = f"norm-weighted rows (attention='norm'), {whole_answer.CHOSEN_AGGREGATION}"
    aps = {name: {i: float(generator.uniform()) for i in answered} for name in (lrp_name, norm_name, CHOSEN)}
    summary = {}
    lines = whole_answer.answered_split(samples, aps, whole_answer.chosen_names(CHOSEN), summary)
    assert len(lines) == 7 and lines[-2].startswith("| generation contains a gold answer | 2 |")
    for label, members in (("generation contains a gold answer", [0, 2]), ("it does not", [1, 3, 4])):
        row = summary["answered_split"][label]
        assert row["n"] == len(members)
        for name, key in (("chosen (softmax rows)", CHOSEN), ("chosen (norm-weighted rows)", norm_name)):
            want = np.mean([aps[key][i] - aps[lrp_name][i] for i in members])
            assert np.isclose(row[name + " minus attnlrp"]["mean"], want)


def test_step_weights_reduce_to_the_chosen_score_when_no_attention_falls_on_generated_tokens():
    record = random_record(steps=6, layers=3, heads=4, n=113, seed=2)
    record["rows"] = (record["rows"] / record["rows"].astype(np.float64).sum(-1, keepdims=True)).astype(np.float16)
    record["mass"] = np.zeros_like(record["mass"])
    candidates = whole_answer.layer_candidates(sample_of(113, [5] * 6), record)[0]
    for name in ("steps weighted by their attention on the prompt: max of w z, minus mean z",
                 "the same weight in log space: max of z + log w, minus mean z",
                 "the first 16 steps only: their max z minus their mean",
                 "generated tokens' attention left out (no redistribution)",
                 "generated tokens' attention redistributed in proportion to the prompt row"):
        np.testing.assert_allclose(candidates[name], candidates[CHOSEN], rtol=1e-9, atol=1e-9, err_msg=name)


def test_step_weights_follow_their_definitions_on_the_records_log_c():
    steps = 20  # more than the 16 first steps one candidate keeps
    record = random_record(steps=steps, layers=2, heads=3, n=41, seed=3)
    candidates = whole_answer.layer_candidates(sample_of(41, [5] * steps), record)[0]
    z = log_zscores(torch.from_numpy(macs_from_record(record)), sinkless=True).double().numpy()
    discounted = [max(z[t, j] - 0.5 * np.log(t + 1) for t in range(steps)) - z[:, j].mean() for j in range(41)]
    np.testing.assert_allclose(candidates["later steps discounted: max of z - 0.5 log(step + 1), minus mean z"],
                               discounted, rtol=1e-9, atol=1e-9)
    fused = np.zeros(41)
    for row in z:
        for place, j in enumerate(sorted(range(41), key=lambda j: -row[j])):
            fused[j] += 1 / (place + 2)
    np.testing.assert_allclose(candidates["reciprocal-rank fusion over steps, sum of 1 / (rank + 2)"], fused)
    share = 1 - np.asarray(record["mass"]).mean((1, 2))
    weighted = [max(share[t] * z[t, j] for t in range(steps)) - z[:, j].mean() for j in range(41)]
    np.testing.assert_allclose(candidates["steps weighted by their attention on the prompt: max of w z, minus mean z"],
                               weighted, rtol=1e-9, atol=1e-9)
    in_log_space = [max(z[t, j] + np.log(share[t]) for t in range(steps)) - z[:, j].mean() for j in range(41)]
    np.testing.assert_allclose(candidates["the same weight in log space: max of z + log w, minus mean z"],
                               in_log_space, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(candidates["the first 16 steps only: their max z minus their mean"],
                               z[:16].max(0) - z[:16].mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(candidates["mean excess of z over 2 (steps where the token stands out)"],
                               [sum(max(z[t, j] - 2, 0) for t in range(steps)) / steps for j in range(41)])
    # In proportion: each head's row over the prompt divided by its share of the prompt, i.e. a record whose rows
    # carry all the mass, scored without redistribution.
    rows = np.asarray(record["rows"], np.float64)
    scaled = {"rows": rows / (1 - np.asarray(record["mass"]))[..., None], "mass": np.zeros_like(record["mass"])}
    z_scaled = log_zscores(torch.from_numpy(macs_from_record(scaled)), sinkless=True).double().numpy()
    np.testing.assert_allclose(
        candidates["generated tokens' attention redistributed in proportion to the prompt row"],
        z_scaled.max(0) - z_scaled.mean(0), rtol=1e-9, atol=1e-9)
    # The same weight on a record's norm-weighted rows, with their own mass.
    other = random_record(steps=steps, layers=2, heads=3, n=41, seed=5)
    record |= {"norm_rows": other["rows"], "norm_mass": other["mass"]}
    with_norm = whole_answer.layer_candidates(sample_of(41, [5] * steps), record)[0]
    z_norm = log_zscores(torch.from_numpy(macs_from_record(record, attention="norm")), sinkless=True).double().numpy()
    share_norm = 1 - np.asarray(other["mass"]).mean((1, 2))
    np.testing.assert_allclose(with_norm[f"norm-weighted rows: {whole_answer.PROMPT_WEIGHTED}"],
                               (share_norm[:, None] * z_norm).max(0) - z_norm.mean(0), rtol=1e-9, atol=1e-9)
    # Mass on generated tokens: spreading it in proportion is not spreading it evenly.
    assert not np.allclose(candidates["generated tokens' attention redistributed in proportion to the prompt row"],
                           candidates[CHOSEN], atol=1e-3)


def test_the_goal_is_paired_with_attnlrp_on_each_part_of_its_samples():
    generator = np.random.default_rng(4)
    scored = [10, 120, 200, 260, 300]  # AttnLRP's samples; 30 and 340 have MACS's scores only
    norm_name = f"norm-weighted rows (attention='norm'), {whole_answer.CHOSEN_AGGREGATION}"
    aps = {name: {i: float(generator.uniform()) for i in [*scored, 30, 340]} for name in (norm_name, CHOSEN)}
    aps[whole_answer.ATTNLRP] = {i: float(generator.uniform()) for i in scored}
    summary = {}
    lines = whole_answer.against_attnlrp(aps, whole_answer.chosen_names(CHOSEN), summary)
    parts = {"development half 0-174": [10, 120], "confirmation half 175-349": [200, 260, 300],
             "held-out 250-349": [260, 300], "all": scored}
    assert list(summary["against_attnlrp"]) == list(parts) and len(lines) == 5 + len(parts)
    for label, members in parts.items():
        row = summary["against_attnlrp"][label]
        assert row["n"] == len(members)
        want = np.mean([aps[CHOSEN][i] - aps[whole_answer.ATTNLRP][i] for i in members])
        assert np.isclose(row["chosen (softmax rows) minus attnlrp"]["mean"], want)


def test_direct_logit_rows_add_up_to_what_attention_writes_into_each_generated_tokens_logit():
    """Sixth round: summed over keys, a step's DLA row is every layer's attention output (after o_proj, read from
    the model) projected on the direction that the final norm and the unembedding give the generated token."""
    from tests.helpers import tiny_llama

    model = tiny_llama(heads=6, kv_heads=2, layers=3)  # GQA 3:1
    model.set_attn_implementation("eager")
    with torch.no_grad():  # the final norm's weight counts (it is all ones at initialisation)
        model.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    prompt, generated = np.arange(3, 3 + 17), np.array([5, 9, 2, 11, 7])
    rows = whole_answer.direct_logit_rows(model, prompt, generated)
    n, steps = len(prompt), len(generated)
    assert rows.shape == (steps, n + steps - 1)
    for k in range(steps):
        assert not rows[k, n + k:].any()  # keys after the query
    written, final = [], {}
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda module, args, out: written.append(out[0].double()))
             for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_hook(
        lambda module, args, out: final.update(x=args[0][0].double(), y=out[0].double())))
    with torch.no_grad():
        model(torch.as_tensor(np.r_[prompt, generated[:-1]])[None])
    for hook in hooks:
        hook.remove()
    queries = torch.arange(n - 1, n - 1 + steps)
    # y = (norm weight / rms) * x elementwise: the direction of token t is W_U[t] * y / x.
    unembedding = model.lm_head.weight.detach().double()[torch.as_tensor(generated)]
    directions = unembedding * final["y"][queries] / final["x"][queries]
    want = sum((out[queries] * directions).sum(-1) for out in written).numpy()
    np.testing.assert_allclose(rows.sum(1), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).min() > 1e-3  # the identity is not 0 = 0


def test_logit_candidates_follow_their_definitions():
    generator = np.random.default_rng(3)
    steps, n = 7, 113
    sample = {"log_c": generator.normal(size=(steps, n)) - 5, "norm_log_c": generator.normal(size=(steps, n)) - 5,
              "logit": generator.normal(size=(steps, n))}
    candidates = whole_answer.logit_candidates(sample)

    def shipped(log_c):
        return whole_answer_scores(torch.from_numpy(log_c), "max_minus_mean_sinkless_z").double().numpy()

    np.testing.assert_allclose(candidates[CHOSEN], shipped(sample["log_c"]), rtol=1e-5, atol=1e-5)
    mean = sample["logit"].mean(0)
    z_mean = (mean - mean.mean()) / mean.std()
    np.testing.assert_allclose(candidates["chosen score + z of the DLA mean"] - candidates[CHOSEN], z_mean,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        candidates["softmax and norm-weighted rows: log c summed (c multiplied), then the chosen score"],
        shipped(sample["log_c"] + sample["norm_log_c"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(candidates["softmax and norm-weighted rows: their chosen scores summed"],
                               shipped(sample["log_c"]) + shipped(sample["norm_log_c"]), rtol=1e-5, atol=1e-5)
    # A soft maximum lies between the mean and the maximum, nearer the maximum at the lower temperature.
    cold = candidates["soft maximum over steps, T log mean exp(z / T) minus mean z, T = 0.5"]
    warm = candidates["soft maximum over steps, T log mean exp(z / T) minus mean z, T = 1.0"]
    assert (warm >= -1e-9).all() and (cold >= warm - 1e-9).all() and (cold <= candidates[CHOSEN] + 1e-9).all()
    assert "norm-weighted rows' chosen score + 0.5 z of the DLA mean" not in whole_answer.logit_candidates(
        {k: v for k, v in sample.items() if k != "norm_log_c"})


def test_the_first_rounds_candidates_include_the_shipped_score():
    """study's candidates (macs_candidates) run on a sample, and the chosen one is the shipped definition."""
    generator = np.random.default_rng(4)
    steps, n = 6, 41
    sample = {"log_c": generator.normal(size=(steps, n)) - 5, "context": (3, n - 2),
              "token_logp": np.log(generator.uniform(0.1, 1.0, size=steps)), "entropy": generator.uniform(size=steps),
              "ended": True}
    candidates = whole_answer.macs_candidates(sample)
    shipped = whole_answer_scores(torch.from_numpy(sample["log_c"]), "max_minus_mean_sinkless_z").double().numpy()
    np.testing.assert_allclose(candidates[CHOSEN], shipped, rtol=1e-5, atol=1e-5)
    z = (sample["log_c"] - sample["log_c"].mean(-1, keepdims=True)) / sample["log_c"].std(-1, keepdims=True)
    np.testing.assert_allclose(candidates["max z minus mean z"], z.max(0) - z.mean(0), rtol=1e-9, atol=1e-9)


def test_run_candidates_follow_their_definitions_and_the_default_is_one_of_them():
    """Seventh round: each candidate is the chosen score plus weight x (best run - mean z), the runs by brute
    force; the shipped default equals runs of 3 steps at weight 1 (the one the development half picked)."""
    generator = np.random.default_rng(7)
    steps, n = 6, 41
    sample = {"log_c": generator.normal(size=(steps, n)) - 5, "norm_log_c": generator.normal(size=(steps, n)) - 5}
    sample["log_c"][1:5, 20:24] += np.diag([3.0] * 4)  # a copied run, so the runs differ from the maxima
    candidates = whole_answer.run_candidates(sample)
    z = whole_answer._sinkless_z(sample["log_c"])
    chosen, mean = z.max(0) - z.mean(0), z.mean(0)
    np.testing.assert_allclose(candidates[CHOSEN], chosen, rtol=1e-12, atol=1e-12)
    for length in whole_answer.RUN_LENGTHS:
        runs = reference.best_runs_reference(torch.from_numpy(z), length).numpy()
        assert not np.allclose(runs, z.max(0))
        for weight in whole_answer.RUN_WEIGHTS:
            want = chosen + weight * (runs - mean)
            np.testing.assert_allclose(candidates[whole_answer.run_name(length, weight)], want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(candidates[whole_answer.SHIPPED], candidates[whole_answer.run_name(3, 1.0)],
                               rtol=1e-5, atol=1e-5)
    runs = reference.best_runs_reference(torch.from_numpy(z), 3).numpy()
    clipped = candidates[whole_answer.CLIPPED]
    np.testing.assert_allclose(clipped, chosen + np.maximum(runs - mean, 0.0), rtol=1e-9, atol=1e-9)
    assert (clipped >= chosen).all() and (clipped > chosen).any() and (runs < mean).any()
    norm_z = whole_answer._sinkless_z(sample["norm_log_c"])
    norm_runs = reference.best_runs_reference(torch.from_numpy(norm_z), 3).numpy()
    np.testing.assert_allclose(candidates[f"norm-weighted rows (attention='norm'), {DEFAULT_AGGREGATION}"],
                               norm_z.max(0) + norm_runs - 2 * norm_z.mean(0), rtol=1e-5, atol=1e-5)


def test_the_runs_round_picks_on_dev_and_pairs_the_default_with_attnlrp(monkeypatch, tmp_path):
    """runs() on a small rows file: every candidate gets a row, the best on dev is named, and the goal tables pair
    the default with AttnLRP on its samples."""
    generator = np.random.default_rng(8)
    samples = {}
    for index in (10, 20, 200, 300):
        steps, n = 5, 30
        log_c = generator.normal(size=(steps, n)) - 5
        samples[index] = {"log_c": log_c, "context": (3, n - 2), "labels": [generator.uniform(size=n - 5) > 0.8],
                          "answer_step": 1 if index in (10, 200) else None,
                          "attnlrp": generator.normal(size=(steps, n))}
    monkeypatch.setattr(whole_answer, "load", lambda path: samples)
    monkeypatch.setattr(whole_answer, "plot_layers", lambda *args, **kwargs: None)
    whole_answer.runs(type("Args", (), {"rows": None, "out": tmp_path / "runs"})())
    summary = json.loads((tmp_path / "runs.json").read_text())
    family = [whole_answer.run_name(k, w) for k in whole_answer.RUN_LENGTHS for w in whole_answer.RUN_WEIGHTS]
    assert (set(family) | {CHOSEN, whole_answer.SHIPPED, whole_answer.CLIPPED, whole_answer.ATTNLRP}
            == set(summary["candidates"]))
    dev = {name: summary["candidates"][name]["dev"]["mean"] for name in family}
    assert summary["best_on_dev"] == max(dev, key=dev.get)
    lrp = {i: whole_answer._attnlrp_ap(s) for i, s in samples.items()}
    shipped = {i: whole_answer._ap(whole_answer.run_candidates(s)[whole_answer.SHIPPED][3:28], s["labels"])
               for i, s in samples.items()}
    row = summary["against_attnlrp"]["all"]
    assert row["n"] == 4 and "default (norm-weighted rows)" not in row  # no norm rows recorded: no column
    assert np.isclose(row["default (softmax rows) minus attnlrp"]["mean"], np.mean([shipped[i] - lrp[i] for i in lrp]))
    assert summary["answered_split"]["generation contains a gold answer"]["n"] == 2


def test_faithfulness_masks_each_candidates_context_scores_pairs_them_with_the_default_and_resumes(monkeypatch,
                                                                                                  tmp_path):
    """faithfulness() hands each candidate's context slice to the masking curves (stubbed: SRGs that are functions
    of the scores they get), reports SRG and AUC-PR paired with the default, and a rerun reads its lines back."""
    import macs_kernels.api.models as models_module
    import macs_kernels.apps.evaluation.faithfulness as faithfulness_module

    generator = np.random.default_rng(9)
    samples = {}
    for index in (250, 251, 252):
        steps, n = 5, 30
        log_c = generator.normal(size=(steps, n)) - 5
        log_c[1:4, 10:13] += np.diag([3.0] * 3)
        samples[index] = {"log_c": log_c, "context": (3, n - 2), "labels": [generator.uniform(size=n - 5) > 0.8],
                          "prompt": np.arange(n), "generated": np.arange(steps)}
    calls = []

    def curves(model, tokenizer, prompt, generated, context, scores, *, max_new_tokens):
        calls.append((context, max_new_tokens, np.asarray(scores)))
        return {"srg": {"perplexity": float(scores[0]), "mean_logit": float(np.sum(scores)),
                        "rouge_l": float(np.argmax(scores))}}

    monkeypatch.setattr(whole_answer, "load", lambda path: samples)
    monkeypatch.setattr(whole_answer, "plot_faithfulness", lambda *args: None)
    monkeypatch.setattr(faithfulness_module, "faithfulness_curves", curves)
    monkeypatch.setattr(models_module, "load_model", lambda: (None, None))
    args = type("Args", (), {"rows": None, "samples": (251, 260), "max_new_tokens": 7,
                             "lines": tmp_path / "lines.jsonl", "out": tmp_path / "faith"})()
    whole_answer.faithfulness(args)
    names = whole_answer.FAITHFULNESS_CANDIDATES
    assert len(calls) == 2 * len(names) and all(c[0] == (3, 28) and c[1] == 7 for c in calls)
    summary = json.loads((tmp_path / "faith.json").read_text())
    assert summary["samples"] == [251, 252] and list(summary["candidates"]) == list(names)
    candidates = {i: whole_answer.run_candidates(samples[i]) for i in (251, 252)}
    for name in names:
        context = {i: candidates[i][name][3:28] for i in candidates}
        for i in candidates:
            np.testing.assert_allclose(calls[(i - 251) * len(names) + names.index(name)][2], context[i])
        shipped = {i: candidates[i][whole_answer.SHIPPED][3:28] for i in candidates}
        row = summary["candidates"][name]
        assert np.isclose(row["logit_minus_default"]["mean"],
                          np.mean([context[i].sum() - shipped[i].sum() for i in candidates]))
        assert np.isclose(row["auc_pr_minus_default"]["mean"], np.mean(
            [whole_answer._ap(context[i], samples[i]["labels"]) - whole_answer._ap(shipped[i], samples[i]["labels"])
             for i in candidates]))
    calls.clear()
    args.samples = (250, 253)
    whole_answer.faithfulness(args)  # only sample 250 is new
    assert len(calls) == len(names) and len((tmp_path / "lines.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "faith.json").read_text())["samples"] == [250, 251, 252]
