"""How MACS's per-step rows should become one whole-answer score per prompt token (issue 28, point 4).

    python benchmarks/whole_answer.py extract --results R.jsonl   # per-step rows -> whole_answer_rows.npz
    python benchmarks/whole_answer.py study                        # candidate table -> whole_answer.{md,json}
    python benchmarks/whole_answer.py layers --results R.jsonl    # recorded-row candidates -> whole_answer_layers.*
    python benchmarks/whole_answer.py logit                        # logit-scaled candidates -> whole_answer_logit.*
    python benchmarks/whole_answer.py runs                         # copied runs -> whole_answer_runs.*
    python benchmarks/whole_answer.py faithfulness                 # their masking curves -> whole_answer_faithfulness.*

extract reads an eval results stream (macs-kernels eval --out R.jsonl) and the record cache it filled, and
keeps, per scored sample: the default MACS configuration's log c of every step over every prompt token
(float32), the generated ids and each one's probability and the entropy of its next-token distribution
(one teacher-forced forward), the prompt ids, the context range, the gold label vectors and, where the run
computed them, the AttnLRP and AtMan rows and the log c of the norm-weighted rows (attention="norm"). Every
aggregation below is then computed offline from that file.

study scores each candidate aggregation by its whole-answer AUC-PR (one score per context token, mean AP
over the gold answers, as the eval's aggregate column) on the development half (samples 0-174, where the
choice is made) and the confirmation half (175-349, looked at once the choice is made), and on the samples
that AttnLRP and AtMan scored, with paired differences against the chosen one; the fourth round adds the named
whole-answer scores (core.AGGREGATIONS) of the norm-weighted rows (a better row rather than another
aggregation).

layers (the third round) reads the per-layer rows from the record cache (each step's last-query rows per layer
and head, as the eval recorded them) and scores the candidates that need them: layers weighted alike or only
some layers, attention aggregated over steps before the floor and the product, steps that copy a context token,
and a per-layer weighting fitted on the development half's gold labels (a supervised probe of what the rows
hold, not a candidate for the default: it learns from the labels the metric uses). The fifth round adds, from the
same records, candidates that weigh the steps unequally (step_candidates).

logit (the sixth round) adds a row scaled by the logit, as AttnLRP's relevance is: the direct logit attribution
through attention of each step's generated token (direct_logit_rows, one teacher-forced eager forward per sample,
kept in the rows file), alone and added to the chosen score, and combinations of the softmax and norm-weighted rows
and soft maxima over the steps (logit_candidates).

runs (the seventh round) adds to the chosen score each token's best copied run (core.scores.StepStatistics): k
consecutive steps attending to k consecutive prompt tokens, one token further at each step, worth the smallest
of their sinkless z-scores, for k in RUN_LENGTHS and weights in RUN_WEIGHTS (run_candidates); the one best on the
development half became the default whole-answer score (core.DEFAULT_AGGREGATION), and the same with its bonus
clipped at zero (CLIPPED) beside it.

faithfulness masks each sample's context tokens in the order of the chosen score, the default and the clipped one
(the eval's masking curves, evaluation.faithfulness) and reports their SRG paired with the default: what the runs
cost in faithfulness and what clipping gives back. One line per sample is kept in --lines, so a rerun resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.evaluation.record import macs_from_record  # noqa: E402
from macs_kernels.apps.evaluation.report import cell, indices_text, stats  # noqa: E402
from macs_kernels.core.scores import (  # noqa: E402
    DEFAULT_AGGREGATION,  # noqa: E402
    RUN_STEPS,
    StepStatistics,
    log_zscores,
    whole_answer_scores,
)

RESULTS = ROOT / "benchmarks" / "results"
ROWS = RESULTS / "whole_answer_rows.npz"
DEV, CONFIRM = (0, 175), (175, 350)
# The first six rounds' choice (CHOSEN_AGGREGATION in core.AGGREGATIONS, the default before the seventh round)
# under its name in the study's tables.
CHOSEN = "max z minus mean z, sink out of each step's statistics"
CHOSEN_AGGREGATION = "max_minus_mean_sinkless_z"


def extract(args) -> None:
    from macs_kernels.api.models import load_model
    from macs_kernels.apps.evaluation.alignment import align_qa
    from macs_kernels.apps.evaluation.data import load_qa
    from macs_kernels.apps.evaluation.record_cache import load_record, load_rows, records_dir
    from macs_kernels.apps.evaluation.report import current_lines
    from macs_kernels.apps.evaluation.store import read_results

    # Every sample line, not only the latest run's: the expensive methods' run lists just their samples.
    lines = read_results(args.results)
    run = lines[("run", None, None)]
    samples = {s.index: s for s in load_qa(run["data"])}
    from macs_kernels.api.generation import eos_ids

    model, tokenizer = load_model()
    eos = eos_ids(model, tokenizer)
    folder = records_dir(args.records)
    out: dict[str, np.ndarray] = {}
    if args.out.is_file():  # samples already extracted are kept; only their AttnLRP/AtMan rows may be new
        with np.load(args.out) as old:
            out = {k: old[k] for k in old.files if k != "indices"}
    # AttnLRP's and AtMan's rows where the latest run scored them: the record cache may hold rows of other runs.
    scored = {(k[1], k[2]) for k in current_lines(lines) if k[0] == "auc" and k[2] in ("attnlrp", "atman")}

    def baseline_rows(index, generation, generated):
        prefix = f"s{index}_"
        for kind in ("attnlrp", "atman"):
            rows = load_rows(folder, generation, kind, generated) if (index, kind) in scored else None
            if rows is None:
                out.pop(prefix + kind, None)
            else:
                out[prefix + kind] = rows[0].astype(np.float32)

    indices = sorted(k[1] for k in lines if k[0] == "sample")
    for index in indices:
        line = lines[("sample", index, None)]
        prefix = f"s{index}_"
        if prefix + "log_c" in out:
            generated = out[prefix + "generated"]
            baseline_rows(index, line["generation"], generated)
            cached = load_record(folder, line["generation"], out[prefix + "prompt"])
            if cached is not None and "norm_rows" in cached[0]:
                out[prefix + "norm_log_c"] = macs_from_record(cached[0], attention="norm").astype(np.float32)
            continue
        sample = samples[index]
        alignment = align_qa(tokenizer, sample.question, sample.context)
        prompt = torch.tensor(alignment.input_ids)
        cached = load_record(folder, line["generation"], prompt)
        if cached is None:
            print(f"sample {index}: no record in {folder}; skipped")
            continue
        record, generated = cached
        log_c = macs_from_record(record)
        ids = torch.cat([prompt, torch.from_numpy(generated)])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1: ids.shape[1] - 1].double()
        logp = logits.log_softmax(-1)
        token_logp = logp.gather(-1, torch.from_numpy(generated)[:, None].long())[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        labels = np.stack(alignment.answer_labels(sample.answers)).astype(np.int8)
        out |= {prefix + "log_c": log_c.astype(np.float32), prefix + "generated": generated,
                prefix + "prompt": prompt.numpy(), prefix + "token_logp": token_logp.numpy().astype(np.float32),
                prefix + "entropy": entropy.numpy().astype(np.float32), prefix + "labels": labels,
                prefix + "meta": np.array([*line["context_tokens"], -1 if line["answer_step"] is None
                                           else line["answer_step"], int(generated[-1]) in eos])}
        if "norm_rows" in record:
            out[prefix + "norm_log_c"] = macs_from_record(record, attention="norm").astype(np.float32)
        baseline_rows(index, line["generation"], generated)
    out["indices"] = np.array(sorted(int(k[1:].split("_")[0]) for k in out if k.split("_", 1)[1] == "log_c"))
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}: {len(out['indices'])} samples")


def load(path=ROWS) -> dict[int, dict]:
    data = np.load(path)
    samples = {}
    for index in data["indices"].tolist():
        prefix = f"s{index}_"
        sample = {k[len(prefix):]: data[k] for k in data.files if k.startswith(prefix)}
        start, stop, answer, ended = sample.pop("meta").tolist()
        sample |= {"context": (start, stop), "answer_step": None if answer < 0 else answer, "ended": bool(ended)}
        samples[index] = sample
    return samples


# ---- candidates ----------------------------------------------------------------------------------
def _z(rows: np.ndarray, keep=None) -> np.ndarray:
    """Row-wise z-scores (population std) over the columns in `keep` (default all); others z'd alike."""
    sub = rows if keep is None else rows[:, keep]
    mean, std = sub.mean(-1, keepdims=True), sub.std(-1, keepdims=True)
    return (rows - mean) / np.where(std > 0, std, 1.0)


def _robust_z(rows: np.ndarray) -> np.ndarray:
    median = np.median(rows, -1, keepdims=True)
    mad = np.median(np.abs(rows - median), -1, keepdims=True) * 1.4826
    return (rows - median) / np.where(mad > 0, mad, 1.0)


def _weighted(z: np.ndarray, w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    return (w[:, None] * z).sum(0) / max(w.sum(), 1e-12)


def _top_k_mean(z: np.ndarray, k: int) -> np.ndarray:
    k = min(k, len(z))
    return np.sort(z, axis=0)[-k:].mean(0)


def _eos_dropped(sample: dict, rows: np.ndarray) -> np.ndarray:
    return rows[:-1] if sample["ended"] and len(rows) > 1 else rows


def macs_candidates(sample: dict) -> dict[str, np.ndarray]:
    """Every candidate whole-answer score of one sample, (N,) over all prompt tokens."""
    log_c = sample["log_c"].astype(np.float64)
    log_c = np.maximum(log_c, -1e4)  # alpha < 1 never underflows; a guard for the z-scores
    start, stop = sample["context"]
    n = log_c.shape[1]
    z = _z(log_c)
    no_sink = np.ones(n, bool)
    no_sink[0] = False
    template = np.ones(n, bool)
    template[: start] = False  # everything before the context: the template, system prompt and question
    template[stop:] = False
    z_ctx = _z(log_c, template)
    p = np.exp(sample["token_logp"].astype(np.float64))
    entropy = sample["entropy"].astype(np.float64)
    z_no_eos = _eos_dropped(sample, z)
    c_rows = np.exp(log_c - log_c.max(-1, keepdims=True))
    share = c_rows / c_rows.sum(-1, keepdims=True)
    concentration = 1 - (-(share * np.log(np.maximum(share, 1e-300))).sum(-1)) / np.log(n)
    ranks = log_c.argsort(-1).argsort(-1) / (n - 1)
    return {
        "mean log c (Explanation.scores before)": log_c.mean(0),
        "mean paper z of c (the eval's aggregate before)": _z(np.exp(log_c)).mean(0),
        "mean z": z.mean(0),
        "mean z, EOS step dropped": z_no_eos.mean(0),
        "mean z without the sink token": _z(log_c, no_sink).mean(0),
        "mean z over the context": z_ctx.mean(0),
        "mean robust z (median/MAD)": _robust_z(log_c).mean(0),
        "mean rank": ranks.mean(0),
        "max z": z.max(0),
        "max z over the context": z_ctx.max(0),
        "max z without the sink token": _z(log_c, no_sink).max(0),
        "max z, EOS step dropped": z_no_eos.max(0),
        "max robust z (median/MAD)": _robust_z(log_c).max(0),
        "max z minus mean z": z.max(0) - z.mean(0),
        # the first six rounds' choice (the z-scores' mean and spread without each step's top token, the sink)
        CHOSEN: whole_answer_scores(torch.from_numpy(log_c), CHOSEN_AGGREGATION).double().numpy(),
        "max z plus mean z": z.max(0) + z.mean(0),
        "top-2 mean z": _top_k_mean(z, 2),
        "max z, steps after the first": z[1:].max(0) if len(z) > 1 else z.max(0),
        "max log c minus mean log c over steps": log_c.max(0) - log_c.mean(0),
        "q90 z": np.quantile(z, 0.9, axis=0),
        "q75 z": np.quantile(z, 0.75, axis=0),
        "median z": np.median(z, 0),
        "top-3 mean z": _top_k_mean(z, 3),
        "top-3 mean z over the context": _top_k_mean(z_ctx, 3),
        "top-5 mean z over the context": _top_k_mean(z_ctx, 5),
        "logsumexp z": np.log(np.exp(z - z.max(0)).mean(0)) + z.max(0),
        "log mean c": np.log(np.exp(log_c - log_c.max()).mean(0)) + log_c.max(),
        "p-weighted mean z": _weighted(z, p),
        "(1-p)-weighted mean z": _weighted(z, 1 - p),
        "entropy-weighted mean z": _weighted(z, entropy),
        "concentration-weighted mean z": _weighted(z, concentration),
        "p-weighted mean z over the context": _weighted(z_ctx, p),
        "(1-p)-weighted mean z over the context": _weighted(z_ctx, 1 - p),
    }


def norm_candidates(sample: dict) -> dict[str, np.ndarray]:
    """The named whole-answer scores (core.AGGREGATIONS) of the norm-weighted rows' log c (fourth round)."""
    from macs_kernels.core.scores import AGGREGATIONS

    log_c = torch.from_numpy(np.maximum(sample["norm_log_c"].astype(np.float64), -1e4))
    return {f"norm-weighted rows (attention='norm'), {name}": whole_answer_scores(log_c, name).double().numpy()
            for name in AGGREGATIONS}


def baseline_candidates(rows: np.ndarray, context) -> dict[str, np.ndarray]:
    """Whole-answer scores of an after-generation method's rows (AttnLRP, AtMan), over the context tokens."""
    start, stop = context
    rows = np.nan_to_num(rows[:, start:stop].astype(np.float64))
    scale = np.abs(rows).sum(-1, keepdims=True)
    return {
        "mean (relevance of the summed answer logits)": rows.mean(0),
        "mean of L1-normalised rows": (rows / np.where(scale > 0, scale, 1.0)).mean(0),
        "mean z": _z(rows).mean(0),
        "max z": _z(rows).max(0),
        "top-3 mean z": _top_k_mean(_z(rows), 3),
    }


def _ap(score: np.ndarray, labels: np.ndarray) -> float:
    from macs_kernels.apps.evaluation.metrics import average_precision

    return float(np.mean([average_precision(score, y) for y in labels]))


def sample_aps(samples: dict[int, dict]) -> dict[str, dict[int, float]]:
    """{candidate name: {sample index: whole-answer AP}}; AttnLRP/AtMan candidates as 'attnlrp: NAME', on the
    samples that have their rows."""
    table: dict[str, dict[int, float]] = {}
    for index, sample in samples.items():
        start, stop = sample["context"]
        candidates = macs_candidates(sample) | (norm_candidates(sample) if "norm_log_c" in sample else {})
        for name, score in candidates.items():
            table.setdefault(name, {})[index] = _ap(score[start:stop], sample["labels"])
        for kind in ("attnlrp", "atman"):
            if kind in sample:
                for name, score in baseline_candidates(sample[kind], sample["context"]).items():
                    table.setdefault(f"{kind}: {name}", {})[index] = _ap(score, sample["labels"])
    return table


def study(args) -> None:
    samples = load(args.rows)
    # Each baseline is compared where it ran: AttnLRP and AtMan may cover different samples.
    expensive = sorted(i for i, s in samples.items() if ("attnlrp" in s or "atman" in s)
                       and (args.expensive is None or args.expensive[0] <= i < args.expensive[1]))
    aps = sample_aps(samples)
    chosen = args.chosen
    halves = {"dev": DEV, "confirm": CONFIRM}
    summary = {"rows": str(args.rows), "chosen": chosen, "dev": list(DEV), "confirm": list(CONFIRM),
               "expensive_samples": expensive, "candidates": {}}
    for name, by_index in aps.items():
        row = {}
        for half, (a, b) in halves.items():
            vals = [v for i, v in by_index.items() if a <= i < b]
            diffs = [v - aps[chosen][i] for i, v in by_index.items() if a <= i < b and i in aps[chosen]]
            row[half] = stats(vals)
            row[half + "_minus_chosen"] = stats(diffs)
        vals = [by_index[i] for i in expensive if i in by_index]
        row["expensive"] = stats(vals)
        row["expensive_minus_chosen"] = stats([by_index[i] - aps[chosen][i] for i in expensive if i in by_index])
        summary["candidates"][name] = row
    lines = [
        f"Whole-answer AUC-PR of MACS's aggregations (default configuration, SmolLM2-135M-Instruct, stqa_350): "
        f"mean [95% CI] over samples; development half {DEV[0]}-{DEV[1] - 1} (the choice was made here), "
        f"confirmation half {CONFIRM[0]}-{CONFIRM[1] - 1}; 'minus chosen' is the paired difference with the chosen "
        f"aggregation ({chosen!r}). Last columns: the {len(expensive)} samples of --expensive that AttnLRP or AtMan "
        f"scored (indices {indices_text(expensive)}), each baseline on its own samples (n), paired there.",
        "",
        "| aggregation | dev | dev minus chosen | confirm | confirm minus chosen | --expensive samples "
        "| minus chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["candidates"].items():
        lines.append(f"| {name} | {cell(row['dev'])} | {cell(row['dev_minus_chosen'])} | {cell(row['confirm'])} "
                     f"| {cell(row['confirm_minus_chosen'])} | {cell(row['expensive'])} (n={row['expensive']['n']}) "
                     f"| {cell(row['expensive_minus_chosen'])} |")
    lines += answered_split(samples, aps, chosen_names(chosen), summary)
    lines += against_attnlrp(aps, chosen_names(chosen), summary)
    text = "\n".join(lines) + "\n"
    print(text)
    (args.out.with_suffix(".md")).write_text(text)
    (args.out.with_suffix(".json")).write_text(json.dumps(summary, indent=1) + "\n")


HELD_OUT = (250, 350)  # the held-out samples of the first AttnLRP run (AtMan's still), whatever --expensive says
ATTNLRP = "attnlrp: mean (relevance of the summed answer logits)"


def _attnlrp_ap(sample: dict) -> float:
    """AttnLRP's whole-answer AP on one sample (its rows' mean: the relevance of the summed answer logits)."""
    return _ap(baseline_candidates(sample["attnlrp"], sample["context"])[ATTNLRP.split(": ", 1)[1]], sample["labels"])


def chosen_names(softmax: str, aggregation: str = CHOSEN_AGGREGATION, label: str = "chosen") -> dict[str, str]:
    """The columns of the AttnLRP tables: {label: candidate name} of a score on softmax and on norm-weighted rows."""
    return {f"{label} (softmax rows)": softmax,
            f"{label} (norm-weighted rows)": f"norm-weighted rows (attention='norm'), {aggregation}"}


def _versus_attnlrp(title: str, groups: dict[str, list[int]], aps: dict, names: dict[str, str]) -> tuple[list[str],
                                                                                                       dict]:
    """Markdown lines and summary of the scores `names` (chosen_names) against AttnLRP's on each group of samples
    (those of a group that AttnLRP and every score cover), paired per sample; a score no sample has (norm-weighted
    rows where the eval did not record them) gets no column."""
    lrp = aps.get(ATTNLRP, {})
    names = {label: key for label, key in names.items() if key in aps}
    lines = ["", title, "", "| samples | n | AttnLRP | " + " | ".join(f"{n} | minus AttnLRP" for n in names) + " |",
             "|---|---|---|" + "---|---|" * len(names)]
    table = {}
    for label, members in groups.items():
        paired = [i for i in members if i in lrp and all(i in aps.get(key, {}) for key in names.values())]
        if not paired:
            continue
        row = {"n": len(paired), "attnlrp": stats([lrp[i] for i in paired])}
        cells = [label, str(len(paired)), cell(row["attnlrp"])]
        for name, key in names.items():
            row[name] = stats([aps[key][i] for i in paired])
            row[name + " minus attnlrp"] = stats([aps[key][i] - lrp[i] for i in paired])
            cells += [cell(row[name]), cell(row[name + " minus attnlrp"])]
        table[label] = row
        lines.append("| " + " | ".join(cells) + " |")
    return lines, table


def against_attnlrp(aps: dict, names: dict[str, str], summary: dict) -> list[str]:
    """The goal, "MACS's whole answer at least AttnLRP's on the same samples", on each part of the samples
    AttnLRP scored: the development half (where the aggregation was chosen, so biased towards MACS), the
    confirmation half (untouched by the choice), the held-out 250-349 and all of them."""
    parts = {f"development half {DEV[0]}-{DEV[1] - 1}": DEV, f"confirmation half {CONFIRM[0]}-{CONFIRM[1] - 1}":
             CONFIRM, f"held-out {HELD_OUT[0]}-{HELD_OUT[1] - 1}": HELD_OUT, "all": (DEV[0], CONFIRM[1])}
    groups = {label: [i for i in sorted(aps.get(ATTNLRP, {})) if a <= i < b] for label, (a, b) in parts.items()}
    lines, summary["against_attnlrp"] = _versus_attnlrp(
        "The goal on each part of AttnLRP's samples, paired with AttnLRP:", groups, aps, names)
    return lines


def answered_split(samples: dict[int, dict], aps: dict, names: dict[str, str], summary: dict) -> list[str]:
    """Where the gap to AttnLRP lies: its samples split by whether the generation contains a gold answer (the
    model answered from the context) or not."""
    groups = {label: [i for i in sorted(aps.get(ATTNLRP, {})) if (samples[i]["answer_step"] is not None) == answered]
              for label, answered in (("generation contains a gold answer", True), ("it does not", False))}
    lines, summary["answered_split"] = _versus_attnlrp(
        "On AttnLRP's samples, split by whether the generation contains a gold answer, paired with AttnLRP:",
        groups, aps, names)
    return lines


# ---- third and fifth rounds: candidates from the recorded rows -------------------------------------------------------
def _sinkless_z(log_c: np.ndarray) -> np.ndarray:
    return log_zscores(torch.from_numpy(log_c), sinkless=True).double().numpy()


def _max_minus_mean(z: np.ndarray) -> np.ndarray:
    return z.max(0) - z.mean(0)


def layer_candidates(sample: dict, record: dict) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({name: (N,) score}, (N, L) per-layer max-minus-mean features) of one sample, from its eval record."""
    from macs_kernels.ops.torch.backend import log_floor

    rows = np.asarray(record["rows"], np.float64)  # (steps, L, H, N)
    mass = np.asarray(record["mass"], np.float64)  # (steps, L, H)
    pooled = (rows + mass[..., None] / rows.shape[-1]).max(2)  # (steps, L, N)
    terms = log_floor(torch.from_numpy(pooled), 0.8).numpy()
    layers = terms.shape[1]
    z = _sinkless_z(terms.sum(1))
    per_layer = _sinkless_z(terms)  # each layer's own sinkless z-scores (steps, L, N)
    start, stop = sample["context"]
    context = set(sample["prompt"][start:stop].tolist())
    copying = np.array([int(t) in context for t in sample["generated"]])
    copies = z[copying] if copying.any() else z

    def over_steps(layer_m):  # (L, N) attention aggregated over the steps -> the MACS formula's z-scores
        return _sinkless_z(log_floor(torch.from_numpy(layer_m), 0.8).numpy().sum(0)[None])[0]

    peak = over_steps(pooled.max(0))
    candidates = {
        CHOSEN: _max_minus_mean(z),
        "layers weighted alike (each layer's sinkless z summed)": _max_minus_mean(per_layer.sum(1)),
        "each layer's max minus mean, summed over layers": _max_minus_mean(per_layer).sum(0),
        f"later half of the layers only ({layers // 2}-{layers - 1})": _max_minus_mean(
            _sinkless_z(terms[:, layers // 2:].sum(1))),
        f"last third of the layers only ({2 * (layers // 3)}-{layers - 1})": _max_minus_mean(
            _sinkless_z(terms[:, 2 * (layers // 3):].sum(1))),
        f"first half of the layers only (0-{layers // 2 - 1})": _max_minus_mean(
            _sinkless_z(terms[:, : layers // 2].sum(1))),
        "max over steps of each layer's m', then floor, product and z": peak,
        "the same, minus the mean step z": peak - z.mean(0),
        "mean over steps of each layer's m', then floor, product and z": over_steps(pooled.mean(0)),
        "max over the steps that copy a context token, minus the mean over all": copies.max(0) - z.mean(0),
    }
    candidates |= step_candidates(z, rows, mass)
    if "norm_rows" in record:  # the best step weight of the fifth round on the better row
        candidates[f"norm-weighted rows: {PROMPT_WEIGHTED}"] = _prompt_weighted(
            _sinkless_z(macs_from_record(record, attention="norm")), np.asarray(record["norm_mass"], np.float64))
    return candidates, _max_minus_mean(per_layer).T


PROMPT_WEIGHTED = "steps weighted by their attention on the prompt: max of w z, minus mean z"


def _prompt_share(mass: np.ndarray) -> np.ndarray:
    """(steps,) each step's attention on the prompt, layers and heads alike."""
    return np.maximum(1 - mass.mean((1, 2)), 1e-12)


def _prompt_weighted(z: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """max over steps of w z minus the mean z: a weight below 1 shrinks a step's z towards 0, so it demotes the
    peaks of steps that read little of the prompt (and lifts a token's negative z at those steps alike)."""
    return (_prompt_share(mass)[:, None] * z).max(0) - z.mean(0)


def step_candidates(z: np.ndarray, rows: np.ndarray, mass: np.ndarray) -> dict[str, np.ndarray]:
    """Fifth round: the steps weighed unequally ({name: (N,) score}) from the default configuration's step
    z-scores z (steps, N) of a record's rows (steps, L, H, N) and their mass on generated tokens (steps, L, H).

    AttnLRP's whole answer is the relevance of the summed answer logits, and the relevance of a late step flows
    partly into the tokens generated before it rather than into the prompt; MACS's redistribution spreads that
    share evenly over the prompt, which flattens a late step's row and lifts its peak z-scores (an answer that
    lists four names gives the last name a larger maximum than the first). These candidates weigh each step by
    how much it reads the prompt, discount later steps, redistribute in proportion instead of evenly, or rank
    rather than standardise each step."""
    mean = z.mean(0)
    step = np.arange(len(z))[:, None]
    ranks = (-z).argsort(1).argsort(1)  # 0: the step's top token
    first = z[:16]
    return {
        PROMPT_WEIGHTED: _prompt_weighted(z, mass),
        "the same weight in log space: max of z + log w, minus mean z":
            (z + np.log(_prompt_share(mass))[:, None]).max(0) - mean,
        "later steps discounted: max of z - 0.5 log(step + 1), minus mean z": (z - 0.5 * np.log1p(step)).max(0) - mean,
        "the first 16 steps only: their max z minus their mean": first.max(0) - first.mean(0),
        "generated tokens' attention left out (no redistribution)": _max_minus_mean(_sinkless_z(
            macs_from_record({"rows": rows, "mass": mass}, redistribute=False))),
        "generated tokens' attention redistributed in proportion to the prompt row": _max_minus_mean(_sinkless_z(
            macs_from_record({"rows": rows / np.maximum(1 - mass[..., None], 1e-6), "mass": mass},
                             redistribute=False))),
        "reciprocal-rank fusion over steps, sum of 1 / (rank + 2)": (1 / (ranks + 2)).sum(0),
        "mean excess of z over 2 (steps where the token stands out)": np.maximum(z - 2, 0).mean(0),
    }


def _fit_layer_weights(features: list[np.ndarray], labels: list[np.ndarray]) -> np.ndarray:
    """Logistic regression (L2 1e-3) of 'is a gold answer token' on the per-layer features of context tokens."""
    x = torch.from_numpy(np.concatenate(features))
    y = torch.from_numpy(np.concatenate(labels).astype(np.float64))
    weights = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([weights], max_iter=500, line_search_fn="strong_wolfe")

    def loss():
        optimiser.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(x @ weights[1:] + weights[0], y)
        value = value + 1e-3 * weights[1:].square().sum()
        value.backward()
        return value

    optimiser.step(loss)
    return weights.detach()[1:].numpy()


def layers(args) -> None:
    from macs_kernels.apps.evaluation.record_cache import load_record, records_dir
    from macs_kernels.apps.evaluation.store import read_results

    samples = load(args.rows)
    lines = read_results(args.results)
    folder = records_dir(args.records)
    aps: dict[str, dict[int, float]] = {}
    features, labels = {}, {}
    for index, sample in sorted(samples.items()):
        cached = load_record(folder, lines[("sample", index, None)]["generation"], sample["prompt"])
        if cached is None:
            print(f"sample {index}: no record in {folder}; skipped")
            continue
        start, stop = sample["context"]
        candidates, per_layer = layer_candidates(sample, cached[0])
        for name, score in candidates.items():
            aps.setdefault(name, {})[index] = _ap(score[start:stop], sample["labels"])
        features[index], labels[index] = per_layer[start:stop], sample["labels"]
    # The supervised probe: fitted on the development half only, scored everywhere else.
    dev = [i for i in features if DEV[0] <= i < DEV[1]]
    weights = _fit_layer_weights([features[i] for i in dev], [labels[i].max(0) for i in dev])
    probe = "per-layer weights fitted to the dev half's gold labels (supervised probe)"
    aps[probe] = {i: _ap(features[i] @ weights, labels[i]) for i in features if i not in dev}
    chosen = CHOSEN
    attnlrp = {i: _attnlrp_ap(s) for i, s in samples.items() if "attnlrp" in s and i in features
               and (args.expensive is None or args.expensive[0] <= i < args.expensive[1])}
    held = sorted(attnlrp)
    summary = {"chosen": chosen, "held_out": held, "probe_weights": weights.tolist(), "candidates": {}}
    text = [f"Third and fifth rounds: whole-answer AUC-PR of candidates built from the recorded rows (record cache), "
            f"mean [95% CI]; dev {DEV[0]}-{DEV[1] - 1}, confirm {CONFIRM[0]}-{CONFIRM[1] - 1}, and the {len(held)} "
            f"samples of --expensive that AttnLRP scored ({indices_text(held)}), paired with the chosen score and "
            f"with AttnLRP's ({cell(stats([attnlrp[i] for i in held]))}).", "",
            "| candidate | dev | dev minus chosen | confirm | --expensive samples | minus chosen | minus AttnLRP |",
            "|---|---|---|---|---|---|---|"]
    for name, by_index in aps.items():
        row = {half: stats([v for i, v in by_index.items() if a <= i < b]) for half, (a, b) in
               {"dev": DEV, "confirm": CONFIRM}.items()}
        row["dev_minus_chosen"] = stats([v - aps[chosen][i] for i, v in by_index.items() if i < DEV[1]])
        row["held_out"] = stats([by_index[i] for i in held if i in by_index])
        row["held_out_minus_chosen"] = stats([by_index[i] - aps[chosen][i] for i in held if i in by_index])
        row["held_out_minus_attnlrp"] = stats([by_index[i] - attnlrp[i] for i in held if i in by_index])
        summary["candidates"][name] = row
        text.append(f"| {name} | {cell(row['dev'])} | {cell(row['dev_minus_chosen'])} | {cell(row['confirm'])} | "
                    f"{cell(row['held_out'])} | {cell(row['held_out_minus_chosen'])} | "
                    f"{cell(row['held_out_minus_attnlrp'])} |")
    report = "\n".join(text) + "\n"
    print(report)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_layers(summary, stats([attnlrp[i] for i in held]), args.out.with_suffix(".png"))


# ---- sixth round: a logit-scaled row, and the rows combined ---------------------------------------------------------
@torch.no_grad()
def direct_logit_rows(model, prompt, generated) -> np.ndarray:
    """(K, N + K - 1) float64 direct logit attribution through attention of a generation's K tokens.

    Row k (the query at token N - 1 + k, which made generated[k]) holds each key j's part of that token's logit
    that the attention layers write straight into the residual stream: the sum over layers and heads of
    a_kj <W_O^h v_j, g_k>, with g_k = gamma * W_U[generated[k]] / rms(x_k) and x_k the final norm's input (its
    scale held fixed, as AttnLRP holds the norm's). Keys after the query are 0. A Llama-style model (RMSNorm,
    o_proj without bias) in eager attention, so that the forward returns its attention probabilities."""
    layers, norm = model.model.layers, model.model.norm
    if type(norm).__name__ != "LlamaRMSNorm" or any(layer.self_attn.o_proj.bias is not None for layer in layers):
        raise NotImplementedError("direct_logit_rows takes a Llama-style model (LlamaRMSNorm, o_proj without bias)")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n, steps = len(prompt), len(generated)
    ids = torch.as_tensor(np.r_[prompt, generated[:-1]], dtype=torch.long)[None]
    values, final = {}, {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda module, args, out, index=index: values.__setitem__(index, out)) for index, layer in enumerate(layers)]
    hooks.append(norm.register_forward_pre_hook(lambda module, args: final.__setitem__("x", args[0])))
    try:
        attentions = model(ids, output_attentions=True).attentions
    finally:
        for hook in hooks:
            hook.remove()
    queries = torch.arange(n - 1, n - 1 + steps)
    x = final["x"][0, queries].double()
    unembedding = model.lm_head.weight.double()[torch.as_tensor(generated, dtype=torch.long)]
    directions = norm.weight.double() * unembedding / torch.sqrt(x.square().mean(-1, keepdim=True)
                                                                  + norm.variance_epsilon)
    rows = torch.zeros(steps, ids.shape[1], dtype=torch.float64)
    for index, layer in enumerate(layers):
        read = (directions @ layer.self_attn.o_proj.weight.double()).view(steps, heads, head_dim)
        keys = values[index][0].double().view(-1, kv_heads, head_dim).repeat_interleave(heads // kv_heads, dim=1)
        rows += (attentions[index][0][:, queries].double().transpose(0, 1)
                 * torch.einsum("khd,shd->khs", read, keys)).sum(1)
    return rows.numpy()


DLA = "direct logit attribution through attention (DLA)"


def logit_candidates(sample: dict) -> dict[str, np.ndarray]:
    """Sixth round ({name: (N,) score}): the DLA rows of one sample (sample["logit"], (steps, N)) alone and added to
    the chosen score; the softmax and norm-weighted rows together; soft maxima over the steps."""
    z = _sinkless_z(sample["log_c"].astype(np.float64))
    chosen, mean = _max_minus_mean(z), z.mean(0)
    logit = sample["logit"].astype(np.float64)
    dla_mean = _z(logit.mean(0)[None])[0]
    candidates = {
        CHOSEN: chosen,
        f"{DLA}: mean over steps (AttnLRP's aggregation)": logit.mean(0),
        f"{DLA}: mean over steps of its positive part": np.maximum(logit, 0).mean(0),
        f"{DLA}: max z minus mean z": _max_minus_mean(_z(logit)),
        "chosen score + 0.5 z of the DLA mean": chosen + 0.5 * dla_mean,
        "chosen score + z of the DLA mean": chosen + dla_mean,
    }
    for temperature in (0.5, 1.0):
        soft = temperature * np.log(np.exp((z - z.max(0)) / temperature).mean(0)) + z.max(0)
        candidates[f"soft maximum over steps, T log mean exp(z / T) minus mean z, T = {temperature}"] = soft - mean
    if "norm_log_c" in sample:
        norm_log_c = sample["norm_log_c"].astype(np.float64)
        norm = _max_minus_mean(_sinkless_z(norm_log_c))
        candidates |= {
            "softmax and norm-weighted rows: their chosen scores summed": chosen + norm,
            "softmax and norm-weighted rows: log c summed (c multiplied), then the chosen score":
                _max_minus_mean(_sinkless_z(sample["log_c"].astype(np.float64) + norm_log_c)),
            "norm-weighted rows' chosen score + 0.5 z of the DLA mean": norm + 0.5 * dla_mean,
        }
    return candidates


def _paired_table(samples: dict[int, dict], aps: dict, title: str) -> tuple[dict, list[str]]:
    """(summary, markdown lines) of every candidate in `aps` on the two halves, paired with CHOSEN and with
    AttnLRP's whole answer on all its samples, on the confirmation half and on those whose generation contains a
    gold answer."""
    lrp = aps.get(ATTNLRP, {})
    answered = [i for i in lrp if samples[i]["answer_step"] is not None]
    parts = {"dev": [i for i in aps[CHOSEN] if DEV[0] <= i < DEV[1]],
             "confirm": [i for i in aps[CHOSEN] if CONFIRM[0] <= i < CONFIRM[1]]}
    summary = {"chosen": CHOSEN, "attnlrp": stats(list(lrp.values())), "candidates": {}}
    text = [f"{title}, mean [95% CI]; dev {DEV[0]}-{DEV[1] - 1} (where a choice is made), confirm "
            f"{CONFIRM[0]}-{CONFIRM[1] - 1}; paired with the chosen score ({CHOSEN}) and with AttnLRP's whole answer "
            f"({cell(summary['attnlrp'])}, n={len(lrp)}) on all of its samples, on the confirmation half and on the "
            f"{len(answered)} whose generation contains a gold answer.", "",
            "| candidate | dev | dev minus chosen | confirm | confirm minus chosen | all minus AttnLRP "
            "| confirm minus AttnLRP | answered minus AttnLRP |", "|---|---|---|---|---|---|---|---|"]
    for name, by_index in aps.items():  # AttnLRP's own row too: its halves differ (the line is all its samples)
        row = {}
        for part, members in parts.items():
            row[part] = stats([by_index[i] for i in members])
            row[part + "_minus_chosen"] = stats([by_index[i] - aps[CHOSEN][i] for i in members])
        for part, members in (("all", sorted(lrp)), ("confirm", parts["confirm"]), ("answered", answered)):
            row[part + "_minus_attnlrp"] = stats([by_index[i] - lrp[i] for i in members if i in lrp])
        summary["candidates"][name] = row
        text.append(f"| {name} | {cell(row['dev'])} | {cell(row['dev_minus_chosen'])} | {cell(row['confirm'])} | "
                    f"{cell(row['confirm_minus_chosen'])} | {cell(row['all_minus_attnlrp'])} | "
                    f"{cell(row['confirm_minus_attnlrp'])} | {cell(row['answered_minus_attnlrp'])} |")
    return summary, text


def _candidate_aps(samples: dict[int, dict], candidates) -> dict[str, dict[int, float]]:
    """{name: {sample: whole-answer AP over the context}} of `candidates(sample)`'s scores, AttnLRP's beside them."""
    aps: dict[str, dict[int, float]] = {}
    for index, sample in samples.items():
        start, stop = sample["context"]
        for name, score in candidates(sample).items():
            aps.setdefault(name, {})[index] = _ap(score[start:stop], sample["labels"])
        if "attnlrp" in sample:
            aps.setdefault(ATTNLRP, {})[index] = _attnlrp_ap(sample)
    return aps


def logit(args) -> None:
    samples = load(args.rows)
    missing = sorted(i for i, sample in samples.items() if "logit" not in sample)
    if missing:  # one teacher-forced forward per sample, kept in the rows file for the next run
        from tqdm import tqdm

        from macs_kernels.api.models import load_model

        model, _ = load_model(attn_implementation="eager")
        with np.load(args.rows) as stored:
            data = {key: stored[key] for key in stored.files}
        for index in tqdm(missing, desc="DLA rows"):
            sample = samples[index]
            rows = direct_logit_rows(model, sample["prompt"], sample["generated"])[:, : len(sample["prompt"])]
            sample["logit"] = data[f"s{index}_logit"] = rows.astype(np.float32)
        np.savez_compressed(args.rows, **data)
    aps = _candidate_aps(samples, logit_candidates)
    summary, text = _paired_table(
        samples, aps, "Sixth round: whole-answer AUC-PR of logit-scaled and combined candidates")
    # Per step, each row's best step (the eval's best-step column), to set DLA beside the rows it is compared with.
    best = {}
    for kind, label in (("log_c", "MACS (softmax rows)"), ("norm_log_c", "norm-weighted rows"), ("logit", DLA),
                        ("attnlrp", "AttnLRP")):
        best[label] = stats([max(_ap(row[s["context"][0]: s["context"][1]], s["labels"]) for row in s[kind])
                             for s in samples.values() if kind in s])
    summary["best_step"] = best
    text += ["", "Best-step AUC-PR of each row (all samples that have it): "
             + "; ".join(f"{label} {cell(value)}" for label, value in best.items()) + "."]
    report = "\n".join(text) + "\n"
    print(report)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_layers(summary, summary["attnlrp"], args.out.with_suffix(".png"), second=("confirm", "confirm 175-349"))


# ---- seventh round: copied runs ---------------------------------------------------------------------------------
RUN_LENGTHS = (2, 3, 4, 5)
RUN_WEIGHTS = (0.5, 1.0, 2.0)
SHIPPED = f"the default whole-answer score ({DEFAULT_AGGREGATION})"
# The default with its run bonus clipped at zero: a token no run favours keeps its chosen score instead of losing
# (its mean z minus its best run), so single-step peaks are not pushed below the copied span (measured by
# faithfulness below).
CLIPPED = f"chosen + max(0, best run of {RUN_STEPS} steps - mean z)"


def run_name(length: int, weight: float) -> str:
    return f"chosen + {weight:g} x (best run of {length} steps - mean z)"


def run_candidates(sample: dict) -> dict[str, np.ndarray]:
    """Seventh round ({name: (N,) score}): the chosen score plus weight x (each token's best run - its mean z) for
    every run length and weight, the shipped default (which is one of them), CLIPPED, and the default of the
    norm-weighted rows where the sample has them."""
    log_c = sample["log_c"].astype(np.float64)
    z = _sinkless_z(log_c)
    mean = z.mean(0)
    chosen = _max_minus_mean(z)
    candidates = {CHOSEN: chosen}
    for length in RUN_LENGTHS:
        steps = StepStatistics(run_steps=length)
        for row in torch.from_numpy(z):
            steps.add(row)
        runs = steps.best_runs().numpy()
        for weight in RUN_WEIGHTS:
            candidates[run_name(length, weight)] = chosen + weight * (runs - mean)
        if length == RUN_STEPS:
            candidates[CLIPPED] = chosen + np.maximum(runs - mean, 0.0)
    candidates[SHIPPED] = whole_answer_scores(torch.from_numpy(log_c)).double().numpy()
    if "norm_log_c" in sample:
        norm = torch.from_numpy(sample["norm_log_c"].astype(np.float64))
        candidates[f"norm-weighted rows (attention='norm'), {DEFAULT_AGGREGATION}"] = (
            whole_answer_scores(norm).double().numpy())
    return candidates


def runs(args) -> None:
    samples = load(args.rows)
    aps = _candidate_aps(samples, run_candidates)
    summary, text = _paired_table(samples, aps, "Seventh round: whole-answer AUC-PR of the chosen score plus each "
                                                "token's best copied run")
    family = [run_name(length, weight) for length in RUN_LENGTHS for weight in RUN_WEIGHTS]
    best = max(family, key=lambda name: summary["candidates"][name]["dev"]["mean"])
    summary["best_on_dev"] = best
    default = run_name(RUN_STEPS, 1.0)
    text += ["", f"Best on the development half: {best!r}; the default ({DEFAULT_AGGREGATION}) is {default!r}"
                 + ("." if best == default else ": NOT the best on dev any more.")]
    names = chosen_names(SHIPPED, DEFAULT_AGGREGATION, label="default")
    text += against_attnlrp(aps, names, summary)
    text += answered_split(samples, aps, names, summary)
    report = "\n".join(text) + "\n"
    print(report)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_layers(summary, summary["attnlrp"], args.out.with_suffix(".png"), second=("confirm", "confirm 175-349"))


# ---- masking faithfulness of the run candidates ---------------------------------------------------------------------
FAITHFULNESS_CANDIDATES = (CHOSEN, SHIPPED, CLIPPED)


def sample_srg(model, tokenizer, sample: dict, max_new_tokens: int) -> dict[str, dict[str, float]]:
    """{candidate: {metric: SRG}} of one sample: its context tokens masked in the order of each of
    FAITHFULNESS_CANDIDATES (metrics named as in the eval's table, methods.FAITHFULNESS_METRICS)."""
    from macs_kernels.apps.evaluation.faithfulness import faithfulness_curves
    from macs_kernels.apps.evaluation.methods import FAITHFULNESS_METRICS

    start, stop = sample["context"]
    prompt = torch.from_numpy(sample["prompt"])[None]
    generated = torch.from_numpy(sample["generated"])[None]
    candidates = run_candidates(sample)
    result = {}
    for name in FAITHFULNESS_CANDIDATES:
        srg = faithfulness_curves(model, tokenizer, prompt, generated, (start, stop), candidates[name][start:stop],
                                  max_new_tokens=max_new_tokens)["srg"]
        result[name] = {metric: srg[key] for metric, key in FAITHFULNESS_METRICS.items()}
    return result


def faithfulness_table(samples: dict[int, dict], lines: dict[int, dict]) -> tuple[dict, list[str]]:
    """(summary, markdown lines): each candidate's SRG per metric and its whole-answer AUC-PR on the samples of
    `lines` ({index: sample_srg}), paired with the shipped default."""
    from macs_kernels.apps.evaluation.methods import FAITHFULNESS_METRICS

    indices = sorted(lines)
    aps = _candidate_aps({i: samples[i] for i in indices}, run_candidates)
    summary = {"samples": indices, "candidates": {}}
    header = " | ".join(f"SRG {metric} | minus default" for metric in FAITHFULNESS_METRICS)
    text = [f"Masking faithfulness of the copied-run candidates on samples {indices_text(indices)} (the eval's "
            "faithfulness samples): SRG (area between the curves of masking least and most important tokens first; "
            "perplexity: lower is more faithful, ROUGE-L and logit: higher) and whole-answer AUC-PR, mean [95% CI], "
            "paired with the default.", "", f"| candidate | n | {header} | AUC-PR | minus default |",
            "|---|---|" + "---|---|" * (len(FAITHFULNESS_METRICS) + 1)]
    for name in FAITHFULNESS_CANDIDATES:
        row, cells = {}, [name, str(len(indices))]
        for metric in FAITHFULNESS_METRICS:
            row[metric] = stats([lines[i][name][metric] for i in indices])
            row[metric + "_minus_default"] = stats([lines[i][name][metric] - lines[i][SHIPPED][metric]
                                                    for i in indices])
            cells += [cell(row[metric]), cell(row[metric + "_minus_default"])]
        row["auc_pr"] = stats([aps[name][i] for i in indices])
        row["auc_pr_minus_default"] = stats([aps[name][i] - aps[SHIPPED][i] for i in indices])
        cells += [cell(row["auc_pr"]), cell(row["auc_pr_minus_default"])]
        summary["candidates"][name] = row
        text.append("| " + " | ".join(cells) + " |")
    return summary, text


def faithfulness(args) -> None:
    from tqdm import tqdm

    samples = load(args.rows)
    wanted = [i for i in range(*args.samples) if i in samples]
    lines = {}
    if args.lines.is_file():  # a rerun resumes: a sample already measured is read back
        lines = {line["index"]: line["srg"] for line in map(json.loads, args.lines.read_text().splitlines())}
    todo = [i for i in wanted if i not in lines]
    if todo:
        from macs_kernels.api.models import load_model

        model, tokenizer = load_model()
        with args.lines.open("a") as out:
            for index in tqdm(todo, desc="masking curves"):
                lines[index] = sample_srg(model, tokenizer, samples[index], args.max_new_tokens)
                out.write(json.dumps({"index": index, "srg": lines[index]}) + "\n")
                out.flush()
    summary, text = faithfulness_table(samples, {i: lines[i] for i in wanted})
    report = "\n".join(text) + "\n"
    print(report)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_faithfulness(summary, args.out.with_suffix(".png"))


def plot_faithfulness(summary: dict, path: Path) -> None:
    """Each candidate's paired difference with the default (95% CI), one panel per SRG metric and AUC-PR."""
    from macs_kernels.apps.bench.common import pyplot, save_figure

    plt = pyplot()
    names = list(summary["candidates"])
    suffix = "_minus_default"
    measures = [key[: -len(suffix)] for key in summary["candidates"][names[0]] if key.endswith(suffix)]
    figure, axes = plt.subplots(1, len(measures), figsize=(4 * len(measures), 0.5 * len(names) + 1.5), sharey=True)
    for axis, measure in zip(axes, measures):
        for row, name in enumerate(names):
            stat = summary["candidates"][name][measure + "_minus_default"]
            low, high = stat["ci"] or (stat["mean"], stat["mean"])
            axis.errorbar(stat["mean"], row, xerr=[[stat["mean"] - low], [high - stat["mean"]]], fmt="o")
        axis.axvline(0.0, color="grey", linewidth=0.8)
        axis.set_title(f"{measure} minus default", fontsize=9)
    axes[0].set_yticks(range(len(names)), [name if len(name) < 45 else name[:42] + "..." for name in names], fontsize=8)
    axes[0].invert_yaxis()
    save_figure(figure, path)


def plot_layers(summary: dict, attnlrp: dict, path: Path, second=("held_out", "--expensive samples")) -> None:
    """Each candidate's whole-answer AUC-PR on dev and on the `second` part (key in each candidate's row, label)
    of the samples (95% CI), AttnLRP's as a line."""
    from macs_kernels.apps.bench.common import pyplot, save_figure

    plt = pyplot()
    names = list(summary["candidates"])
    figure, axis = plt.subplots(figsize=(10, 0.45 * len(names) + 1.5))
    for offset, (half, colour) in enumerate((("dev", "tab:blue"), (second[0], "tab:orange"))):
        for row, name in enumerate(names):
            stat = summary["candidates"][name][half]
            if stat["mean"] is None:
                continue
            low, high = stat["ci"] or (stat["mean"], stat["mean"])
            y = row + 0.2 * (offset - 0.5)
            axis.errorbar(stat["mean"], y, xerr=[[stat["mean"] - low], [high - stat["mean"]]], fmt="o", color=colour,
                          label={"dev": "dev 0-174", second[0]: second[1]}[half] if row == 0 else None)
    axis.axvline(attnlrp["mean"], color="tab:red", linestyle="--", label=f"AttnLRP {attnlrp['mean']:.3f}")
    axis.set_yticks(range(len(names)), [name if len(name) < 60 else name[:57] + "..." for name in names], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("whole-answer AUC-PR (95% CI)")
    axis.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--results", type=Path, required=True)
    e.add_argument("--records", type=Path, default=None)
    e.add_argument("--out", type=Path, default=ROWS)
    s = sub.add_parser("study")
    s.add_argument("--rows", type=Path, default=ROWS)
    s.add_argument("--chosen", default=CHOSEN)
    s.add_argument("--out", type=Path, default=RESULTS / "whole_answer")
    s.add_argument("--expensive", type=lambda t: tuple(int(v) for v in t.split(":")), default=None,
                   metavar="START:STOP", help="the samples of the last columns (default: every sample with "
                                              "AttnLRP's or AtMan's rows from the eval run)")
    layer = sub.add_parser("layers")
    layer.add_argument("--results", type=Path, required=True)
    layer.add_argument("--records", type=Path, default=None)
    layer.add_argument("--rows", type=Path, default=ROWS)
    layer.add_argument("--out", type=Path, default=RESULTS / "whole_answer_layers")
    layer.add_argument("--expensive", type=lambda t: tuple(int(v) for v in t.split(":")), default=None,
                       metavar="START:STOP", help="the samples to compare with AttnLRP on (default: all it scored)")
    g = sub.add_parser("logit")
    g.add_argument("--rows", type=Path, default=ROWS)
    g.add_argument("--out", type=Path, default=RESULTS / "whole_answer_logit")
    r = sub.add_parser("runs")
    r.add_argument("--rows", type=Path, default=ROWS)
    r.add_argument("--out", type=Path, default=RESULTS / "whole_answer_runs")
    f = sub.add_parser("faithfulness")
    f.add_argument("--rows", type=Path, default=ROWS)
    f.add_argument("--samples", type=lambda t: tuple(int(v) for v in t.split(":")), default=HELD_OUT,
                   metavar="START:STOP", help="the samples to mask (default: the eval's faithfulness samples)")
    f.add_argument("--max-new-tokens", type=int, default=32, help="the eval's generation length (Table 2's: 32)")
    f.add_argument("--lines", type=Path, default=RESULTS / "whole_answer_faithfulness.jsonl")
    f.add_argument("--out", type=Path, default=RESULTS / "whole_answer_faithfulness")
    b = sub.add_parser("best-step")
    b.add_argument("--results", type=Path, required=True)
    b.add_argument("--method", default="macs")
    b.add_argument("--out", type=Path, default=RESULTS / "best_step_readings.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"extract": extract, "study": study, "layers": layers, "logit": logit, "runs": runs,
     "faithfulness": faithfulness, "best-step": best_step}[args.command](args)



# ---- the paper's "best step before the answer" (issue 28, point 5) ---------------------------------------
def _answer_tokens(tokenizer, generated, gold_texts) -> tuple[int, int] | None:
    """(first, last) zero-based generated token of the earliest gold answer in the decoded generation."""
    ids = [int(i) for i in generated]
    text = tokenizer.decode(ids, skip_special_tokens=True).lower()
    found = [(text.find(t.lower()), len(t)) for t in gold_texts if t.strip()]
    found = [(p, n) for p, n in found if p >= 0]
    if not found:
        return None
    start, length = min(found)
    lengths = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    first = next(k for k, n in enumerate(lengths) if n > start)
    last = next(k for k, n in enumerate(lengths) if n >= start + length)
    return first, last


def best_step(args) -> None:
    """Share of samples whose best step (per-step AUC-PR) comes before the answer, under several readings."""
    from macs_kernels.api.models import load_tokenizer
    from macs_kernels.apps.evaluation.data import load_qa
    from macs_kernels.apps.evaluation.store import read_results

    lines = read_results(args.results)
    run = lines[("run", None, None)]
    samples = {s.index: s for s in load_qa(run["data"])}
    tokenizer = load_tokenizer()
    counts: dict[str, list] = {}
    offsets: dict[int, int] = {}
    for (kind, index, method), line in lines.items():
        if kind != "auc" or method != args.method or ("sample", index, None) not in lines:
            continue
        sample_line = lines[("sample", index, None)]
        per_step = np.asarray(line["per_step"])
        first_best = int(np.argmax(per_step))
        last_best = int(len(per_step) - 1 - np.argmax(per_step[::-1]))
        span = _answer_tokens(tokenizer, sample_line["generated_ids"], [t for t, _ in samples[index].answers])
        readings = {"answer found in the generation": span is not None}
        if span is not None:
            first, last = span
            offset = max(min(first_best - first, 4), -4)
            offsets[offset] = offsets.get(offset, 0) + 1
            readings |= {
                "best step <= first answer token's step (ours)": first_best <= first,
                "best step < first answer token's step (strictly before)": first_best < first,
                "best step <= first answer token's step, last of tied best steps": last_best <= first,
                "best step <= the step that reads the first answer token (first + 1)": first_best <= first + 1,
                "best step <= last answer token's step (before the answer ends)": first_best <= last,
                "first answer token at step 0": first == 0,
            }
        readings["all samples: best step <= first answer step, no answer counted as before"] = (
            span is None or first_best <= span[0])
        readings["all samples: best step in the first half of the generation"] = first_best < len(per_step) / 2
        readings["all samples: best step is step 0"] = first_best == 0
        for name, value in readings.items():
            counts.setdefault(name, []).append(bool(value))
    found = counts.pop("answer found in the generation")
    lines_out = [f"Best step (per-step AUC-PR of {args.method}) against the answer's place in the generation, "
                 f"{len(found)} samples, {sum(found)} whose generation contains a gold answer:", "",
                 "| reading | share | of |", "|---|---|---|"]
    for name, values in counts.items():
        lines_out.append(f"| {name} | {np.mean(values):.1%} | {len(values)} |")
    lines_out += ["", "Best step minus the first answer token's step (clipped to +-4), samples whose generation "
                  "contains a gold answer: " + ", ".join(f"{k:+d}: {offsets[k]}" for k in sorted(offsets)) + "."]
    text = "\n".join(lines_out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
