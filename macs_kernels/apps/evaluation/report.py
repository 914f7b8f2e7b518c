"""The results table of an evaluation run: aggregated from its JSONL at any time (a partial run included),
written as JSON, Markdown and a PNG of the per-sample AUC-PR distributions."""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from macs_kernels.apps.bench.common import source_commit
from macs_kernels.apps.evaluation.costs import GENERATION
from macs_kernels.apps.evaluation.methods import FAITHFULNESS_METRICS
from macs_kernels.apps.evaluation.metrics import mean_ci, share_before_answer
from macs_kernels.apps.evaluation.store import (
    EDITED,
    SUMMARY_FORMAT,
    UNCHECKED,
    check_outputs,
    checksum_problem,
    describe_line,
    read_results,
    summary_paths,
)
from macs_kernels.core.scores import DEFAULT_AGGREGATION

# MACS paper, Llama-3.1-8B on stqa_350 (best-step AUC-PR).
PAPER_AUC_PR = {
    "macs": 0.601, "macs:pool=mean": 0.570, "macs:pool=min": 0.443, "macs:alpha=1.0": 0.546,
    "macs:alpha=0.2": 0.599, "macs:alpha=0.5": 0.599, "macs:redistribute=off": 0.600,
    "attnlrp": 0.565, "atman": 0.315, "rollout": 0.147, "random": 0.113,
}
PAPER_BEST_BEFORE_ANSWER = 0.9768
# Paired differences on a subset of the samples are taken against this method.
BASELINE = "macs"
SUBSET_FIELDS = (("auc_pr", "best"), ("auc_pr_step_mean", "step_mean"), ("auc_pr_aggregate", "aggregate"))


def stats(values) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "ci": None, "n": 0}
    mean, low, high = mean_ci(values)
    return {"mean": mean, "ci": None if math.isnan(low) else [low, high], "n": len(values)}


def summarise(path) -> dict:
    """The table of a results file (see the module docstring of store for its lines)."""
    lines, edited = reportable_lines(path)
    run = lines.get(("run", None, None), {})
    samples = {k[1]: v for k, v in lines.items() if k[0] == "sample"}
    skipped = {k[1]: v for k, v in lines.items() if k[0] == "skipped"}
    reasons: dict[str, int] = {}
    for line in skipped.values():
        reasons[line["reason"]] = reasons.get(line["reason"], 0) + 1
    methods: dict[str, dict] = {}
    order = []
    costs: dict[str, list] = {}
    for (kind, index, method), line in lines.items():
        if kind == "cost" and index in samples:
            costs.setdefault(method, []).append(line)
        if kind in ("auc", "faithfulness") and index in samples:
            if method not in methods:
                methods[method] = {"auc": [], "faithfulness": []}
                order.append(method)
            methods[method][kind].append(line)
    table = {}
    for name in order:
        auc, faith = methods[name]["auc"], methods[name]["faithfulness"]
        ties = [line["ties"] for line in auc]
        rows = sum(t["rows"] for t in ties)
        before = share_before_answer([line["best_step"] for line in auc],
                                     [samples[line["index"]]["answer_step"] for line in auc])
        table[name] = {
            "n": len(auc),
            "skipped": len(samples) - len(auc),
            "auc_pr": stats([line["best"] for line in auc]),
            "best_step": stats([line["best_step"] for line in auc]),
            "auc_pr_step_mean": stats([line["step_mean"] for line in auc]),
            "auc_pr_aggregate": stats([line["aggregate"] for line in auc]),
            "auc_pr_aggregates": _aggregates(auc),
            "srg": {metric: stats([line["srg"][metric] for line in faith]) for metric in FAITHFULNESS_METRICS},
            "ties": {
                "tied_tokens_per_step": sum(t["tied_tokens"] for t in ties) / rows if rows else None,
                "share_of_steps_with_ties": sum(t["rows_with_ties"] for t in ties) / rows if rows else None,
                "samples_with_ties": sum(t["rows_with_ties"] > 0 for t in ties),
            },
            "best_step_before_answer": before,
            "paper_auc_pr": PAPER_AUC_PR.get(name),
            "cost": _cost(costs.get(name, [])),
        }
    scored = list(samples.values())
    largest = max((len(parts["auc"]) for parts in methods.values()), default=0)
    subsets = {name: _on_subset(methods, name) for name in order if 0 < len(methods[name]["auc"]) < largest}
    whole_answer_against = {name: _whole_answer_against(methods, name) for name in order
                            if name.split(":")[0] != BASELINE and methods[name]["auc"]}
    return {
        "format": SUMMARY_FORMAT,
        "model": run.get("model"),
        "dtype": run.get("dtype"),
        "data": run.get("data"),
        "max_new_tokens": run.get("max_new_tokens"),
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(short=True),
        "n": len(scored),
        "skipped": reasons,
        "unmatched_answers": {
            "samples": sum(line["unmatched_answers"] > 0 for line in scored),
            "answers": sum(line["unmatched_answers"] for line in scored),
            "of_answers": sum(line["n_answers"] for line in scored),
        },
        "relocated_answers": {
            "answers": sum(line.get("relocated_answers", 0) for line in scored),
            "samples": sum(line.get("relocated_answers", 0) > 0 for line in scored),
        },
        "answer_not_generated": sum(line["answer_step"] is None for line in scored),
        "method_skips": run.get("method_skips", {}),
        "edited_lines": [describe_line(key) for key in edited],
        "unverified_lines": sum(key[0] != "run" and checksum_problem(line) == UNCHECKED for key, line in lines.items()),
        "methods": table,
        "generation_cost": _cost(costs.get(GENERATION, [])),
        "subsets": subsets,
        "macs_whole_answer_against": whole_answer_against,
        "claims": _claims(table),
    }


def reportable_lines(path) -> tuple[dict[tuple, dict], list[tuple]]:
    """The current lines (current_lines) of the results file `path`, less those that do not match their checksum
    (changed after they were written), and the keys of those left out."""
    lines = read_results(path)
    edited = [key for key, line in lines.items() if checksum_problem(line) == EDITED]
    return current_lines({key: line for key, line in lines.items() if key not in edited}), edited


def current_lines(lines: dict[tuple, dict]) -> dict[tuple, dict]:
    """The lines of the latest run's samples, computed from their current content, and of each method only on
    the samples of its range in that run.

    A results file can hold lines of earlier runs on other data or settings (kept, and reused when their
    key matches); the latest run line lists its samples with their content keys, and only lines computed
    from that content count. Files written before runs listed their samples count whole.
    """
    run = lines.get(("run", None, None), {})
    if "samples" not in run:
        return lines
    keys = {index: key for index, key in run["samples"]}
    # A method limited to a range of samples (--method-range) counts there only, whatever earlier runs left.
    ranges = run.get("method_ranges", {})

    def in_range(method, index) -> bool:
        return method not in ranges or ranges[method][0] <= index < ranges[method][1]

    return {k: line for k, line in lines.items()
            if k[0] == "run" or (k[1] in keys and line.get("sample") == keys[k[1]] and in_range(k[2], k[1]))}


def _cost(lines: list) -> dict:
    """Seconds per generated token (mean [CI] over samples) and peak memory (MB above the process before the
    method: mean and largest over samples) of a method's cost lines (costs.py)."""
    peaks = [line["peak_bytes"] / 2**20 for line in lines if line["peak_bytes"] is not None]
    return {
        "seconds_per_token": stats([line["seconds"] / line["steps"] for line in lines]),
        "peak_mb": stats(peaks), "peak_mb_max": max(peaks, default=None),
        "after_generation": any(line["after_generation"] for line in lines),
        "samples": sorted(line["index"] for line in lines),
    }


def _on_subset(methods: dict, subset: str, baseline: str = BASELINE) -> dict:
    """Every method on the samples that `subset` scores (AT2 on its held-out questions, a method limited by
    --method-range), with the paired difference method - baseline (MACS) per sample: what a comparison on
    exactly these samples says."""
    indices = sorted(line["index"] for line in methods[subset]["auc"])
    base = {line["index"]: line for line in methods.get(baseline, {"auc": []})["auc"]}
    table = {}
    for name, parts in methods.items():
        lines = [line for line in parts["auc"] if line["index"] in indices]
        table[name] = {"n": len(lines)}
        for field, key in SUBSET_FIELDS:
            table[name][field] = stats([line[key] for line in lines])
            table[name][f"{field}_minus_{baseline}"] = stats([line[key] - base[line["index"]][key]
                                                              for line in lines if line["index"] in base])
    return {"samples": len(indices), "indices": indices, "baseline": baseline, "methods": table}


def _whole_answer_against(methods: dict, other: str, baseline: str = BASELINE) -> dict:
    """The goal of the whole-answer study: each of MACS's named whole-answer scores paired with `other`'s
    aggregate, on the samples `other` scores (whichever they are)."""
    base = {line["index"]: line for line in methods.get(baseline, {"auc": []})["auc"] if "aggregates" in line}
    own = {line["index"]: line["aggregate"] for line in methods[other]["auc"] if line["index"] in base}
    # Lines written by older code may lack a later name: only the names every line has are compared.
    names = [name for name in next(iter(base.values()))["aggregates"] if all(name in line["aggregates"]
                                                                             for line in base.values())] if base else []
    return {"n": len(own), "aggregate": stats(list(own.values())),
            "minus": {name: stats([base[i]["aggregates"][name] - own[i] for i in own]) for name in names}}


def _aggregates(lines: list) -> dict:
    """Stats of every named whole-answer score's AUC-PR (MACS's lines carry them: core.AGGREGATIONS)."""
    names = [name for name in (lines[0].get("aggregates", {}) if lines else {})]
    return {name: stats([line["aggregates"][name] for line in lines if "aggregates" in line]) for name in names}


def _claims(table: dict) -> dict:
    """The paper's qualitative claims, checked on these numbers (None where a method is missing)."""
    mean = {name: row["auc_pr"]["mean"] for name, row in table.items()}

    def cmp(*names):
        values = [mean.get(n) for n in names]
        if any(v is None for v in values):
            return None
        return all(a > b for a, b in zip(values, values[1:]))

    macs = table.get("macs")
    redistribution = None
    if mean.get("macs") is not None and mean.get("macs:redistribute=off") is not None:
        redistribution = mean["macs"] - mean["macs:redistribute=off"]
    return {
        "macs_above_rollout": cmp("macs", "rollout"),
        "macs_above_random": cmp("macs", "random"),
        "max_above_mean_above_min_pooling": cmp("macs", "macs:pool=mean", "macs:pool=min"),
        "alpha_1_below_alpha_0.8": cmp("macs", "macs:alpha=1.0"),
        "redistribution_effect": redistribution,
        "macs_best_step_before_answer": None if macs is None else macs["best_step_before_answer"]["share"],
    }


def cell(stat, digits=3) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    text = f"{stat['mean']:.{digits}f}"
    if stat.get("ci"):
        text += f" [{stat['ci'][0]:.{digits}f}, {stat['ci'][1]:.{digits}f}]"
    return text


def _cost_text(cost: dict | None) -> str:
    if not cost or not cost["samples"]:
        return "- | -"
    peak = "-" if cost["peak_mb"]["mean"] is None else f"{cost['peak_mb']['mean']:.0f}; {cost['peak_mb_max']:.0f}"
    return (f"{cell(cost['seconds_per_token'])}{' +' if cost['after_generation'] else ''} "
            f"(n={len(cost['samples'])}) | {peak}")


def indices_text(indices) -> str:
    """[250, 251, 252, 260] -> '250-252, 260'."""
    runs, out = [], []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    for a, b in runs:
        out.append(str(a) if a == b else f"{a}-{b}")
    return ", ".join(out) or "none"


def skips_text(method_skips: dict) -> str:
    """{"at2": {reason: [0, 1, 2]}} -> 'at2 on 3 samples (0-2): reason' (methods.method_skips)."""
    return "; ".join(f"{name} on {len(indices)} samples ({indices_text(indices)}): {reason}"
                     for name, reasons in method_skips.items() for reason, indices in reasons.items())


def markdown(summary: dict) -> str:
    lines = [
        f"Model: {summary['model'] or 'default'} ({summary['dtype']}), data: {summary['data']}, "
        f"max_new_tokens {summary['max_new_tokens']}, {summary['n']} samples scored, date {summary['date']}, "
        f"commit {summary['commit']}. Mean [95% CI] over samples.",
        "",
        "| method | n | AUC-PR (best step) | paper (Llama-3.1-8B) | AUC-PR (mean over steps) | AUC-PR (aggregate) "
        "| SRG perplexity | SRG ROUGE-L | SRG logit | ties/step (paper form) | best step before answer "
        "| s/token | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["methods"].items():
        srg = row["srg"]
        paper = "-" if row["paper_auc_pr"] is None else f"{row['paper_auc_pr']:.3f}"
        ties = row["ties"]["tied_tokens_per_step"]
        before = row["best_step_before_answer"]
        share = "-" if before["n"] == 0 else f"{before['share']:.1%} of {before['n']}"
        lines.append(
            f"| {name} | {row['n']} | {cell(row['auc_pr'])} | {paper} | {cell(row['auc_pr_step_mean'])} "
            f"| {cell(row['auc_pr_aggregate'])} | {cell(srg['perplexity'])} (n={srg['perplexity']['n']}) "
            f"| {cell(srg['rouge_l'])} | {cell(srg['logit'])} | {'-' if ties is None else f'{ties:.2f}'} | {share} "
            f"| {_cost_text(row.get('cost'))} |"
        )
    named = {name: row["auc_pr_aggregates"] for name, row in summary["methods"].items() if row.get("auc_pr_aggregates")}
    if named:
        columns = list(next(iter(named.values())))
        lines += ["", "Whole-answer AUC-PR of each named MACS score (core.AGGREGATIONS; the aggregate column above is "
                  f"{DEFAULT_AGGREGATION}, Explanation.scores):", "", "| method | " + " | ".join(columns) + " |",
                  "|---|" + "---|" * len(columns)]
        lines += [f"| {name} | " + " | ".join(cell(row.get(c)) for c in columns) + " |" for name, row in named.items()]
    generation = summary.get("generation_cost")
    if generation and generation["samples"]:
        lines += ["", f"Cost: seconds per generated token, mean [95% CI] over the samples measured (n), and peak "
                  "memory above the process before the method (mean; largest), on this machine as run. In-generation "
                  "methods: a whole greedy generation with the method; after-generation methods (marked +): their own "
                  f"pass, to add to the generation's. Plain greedy generation: {_cost_text(generation)} "
                  f"(samples {indices_text(generation['samples'])})."]
    for reference, subset in summary.get("subsets", {}).items():
        base = subset.get("baseline", reference)
        lines += [
            "",
            f"On the {subset['samples']} samples that {reference} scores (indices "
            f"{indices_text(subset.get('indices', []))}), paired differences with {base} (mean [95% CI] of "
            f"method - {base} per sample):",
            "",
            f"| method | n | AUC-PR (best step) | minus {base} | AUC-PR (mean over steps) | minus {base} "
            f"| AUC-PR (aggregate) | minus {base} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in subset["methods"].items():
            lines.append(f"| {name} | {row['n']} | " + " | ".join(
                f"{cell(row.get(field))} | {cell(row.get(f'{field}_minus_{base}'))}" for field, _ in SUBSET_FIELDS)
                + " |")
    against = {name: row for name, row in summary.get("macs_whole_answer_against", {}).items() if row["n"]}
    names = next(iter(against.values()))["minus"] if against else {}
    if names:
        lines += ["", "MACS's named whole-answer scores (core.AGGREGATIONS) minus each other method's aggregate, "
                  "paired per sample on that method's samples (n):", "",
                  "| method | n | its aggregate | " + " | ".join(f"{name} minus it" for name in names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        lines += [f"| {method} | {row['n']} | {cell(row['aggregate'])} | "
                  + " | ".join(cell(row["minus"][name]) for name in names) + " |" for method, row in against.items()]
    unmatched = summary["unmatched_answers"]
    relocated = summary.get("relocated_answers", {"answers": 0, "samples": 0})
    method_skips = summary.get("method_skips")
    edited, unverified = summary.get("edited_lines"), summary.get("unverified_lines")
    lines += [
        "",
        f"Skipped: {summary['skipped'] or 'none'}"
        + (f"; methods not scored on some samples: {skips_text(method_skips)}" if method_skips else "") + ". "
        + (f"Left out, their content changed after they were written (it does not match their checksum): "
           f"{', '.join(edited)}. " if edited else "")
        + (f"{unverified} results lines have no checksum (written before results lines had one): reported "
           "unverified. " if unverified else "")
        + "Gold answers mapping to no context token (scored 0): "
        f"{unmatched['answers']} of {unmatched['of_answers']} in {unmatched['samples']} samples. "
        f"Gold answers not at their answer_start, moved to the nearest occurrence of their text: "
        f"{relocated['answers']} in {relocated['samples']} samples. "
        f"Samples whose generation never contains a gold answer: {summary['answer_not_generated']}.",
        "",
        "Paper's claims on this run: " + ", ".join(f"{k} = {v}" for k, v in summary["claims"].items())
        + f" (paper: best step before the answer in {PAPER_BEST_BEFORE_ANSWER:.2%} of samples).",
    ]
    return "\n".join(lines) + "\n"


def plot(path, out) -> None:
    """Box plots of the per-sample AUC-PR of each method: best step, and the whole-answer aggregate."""
    from macs_kernels.apps.bench.common import pyplot

    plt = pyplot()
    lines = reportable_lines(path)[0]
    data: dict[str, dict[str, list]] = {"best": {}, "aggregate": {}}
    for (kind, _, method), line in lines.items():
        if kind == "auc":
            for field in data:
                data[field].setdefault(method, []).append(line[field])
    if not data["best"]:
        return
    methods = list(data["best"])
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(methods)), 4), sharey=True)
    for ax, (field, title) in zip(axes, (("best", "best step"), ("aggregate", "whole answer (aggregate)"))):
        ax.boxplot([data[field][m] for m in methods], showmeans=True)
        ax.set_xticks(range(1, len(methods) + 1), [f"{m} (n={len(data[field][m])})" for m in methods],
                      rotation=40, ha="right", fontsize=8)
        ax.set_title(f"AUC-PR per sample, {title}")
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out, dpi=120, metadata={"Description": SUMMARY_FORMAT})  # marks the file as ours (store)
    plt.close(fig)


def write_report(path) -> dict:
    """Summarise the results stream `path` into its summary files (store.summary_paths); returns the summary.

    Raises ValueError, before writing anything, when a summary path holds a file this tool did not write.
    """
    path = Path(path)
    check_outputs(path, write_stream=False)
    summary = summarise(path)
    outputs = summary_paths(path)
    outputs["json"].write_text(json.dumps(summary, indent=1) + "\n")
    outputs["md"].write_text(markdown(summary))
    plot(path, outputs["png"])
    return summary
