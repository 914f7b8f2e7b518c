"""`macs-kernels bench --vllm`: vLLM with MACS attribution against the same engine without it, and against
`macs-kernels serve`'s engine on the same requests (run it in vLLM's environment).

    macs-kernels bench --vllm                 # default model, 8 requests, prompts 256-1024, 32 new tokens, 3 repeats
    macs-kernels bench --vllm --repeats 1 --requests 4 --prompt-lens 64 256 --new-tokens 8      # quick
    VLLM_PLUGINS=none macs-kernels bench --vllm --vllm-modes off   # vLLM without the plugin loaded at all
    macs-kernels bench --vllm-report          # summary and plot again from the CSVs (any environment)

One engine (vLLM's default multiprocessing engine, eager, float32, prefix caching off so that every run
prefills its prompts) serves every run, after one warm-up run of the whole workload per mode. The prompts are those
of `macs-kernels bench --serving`'s throughput runs (random token ids, seed 0, lengths spread evenly over the
range): greedy, end of sequence ignored, all requests submitted at once. "off" runs them as plain requests,
"on" with SamplingParams.extra_args["attribution"] (and reads every request's rows back through
collective_rpc, timed apart). Modes alternate (off, on, on, off, ...). Throughput is generated tokens per
second of wall time and per second of CPU time of the engine core process (user + system, all threads: on a
machine shared with other work, wall time measures the neighbours too, so the summary's ratio pairs each
run with its neighbour of the other mode and takes the median). Memory is the engine's resident set after
each run. Appends one row per run to <--out>/vllm_cpu_throughput.csv; the summary
(vllm_cpu_throughput_summary.csv) and the plot (vllm_cpu_throughput.png, where matplotlib is installed) put
`macs-kernels bench --serving`'s throughput runs (serving_cpu.csv, same --out) beside them.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

from .serving import serving_prompts

FIELDS = ["plugin", "paged_backend", "mode", "repeat", "requests", "prompt_min", "prompt_max", "new_tokens", "wall_s",
          "engine_cpu_s", "tokens_per_s", "tokens_per_cpu_s", "read_s", "engine_rss_mib", "load_before", "load_after"]
STEM = "vllm_cpu_throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--vllm (vLLM with and without attribution; also --model, --requests, "
                                      "--prompt-lens, --new-tokens, --repeats, --out)")
    group.add_argument("--vllm", action="store_true", help="run the vLLM benchmark (in vLLM's environment)")
    group.add_argument("--vllm-modes", nargs="+", default=["off", "on"], choices=["off", "on"],
                       help="modes to alternate (default: off on)")
    group.add_argument("--vllm-report", action="store_true",
                       help="only write the vLLM benchmark's summary and plot from the CSVs under --out")


def run(args) -> int:
    if args.vllm_report:
        return report(args.out)
    import psutil
    from vllm import LLM, SamplingParams

    from .. import vllm as macs_vllm
    from ..models import default_model_path

    new_tokens, repeats = args.new_tokens or 32, args.repeats

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    plugin = "none" if os.environ.get("VLLM_PLUGINS") not in (None, "macs_kernels") else "macs_kernels"
    options = {"worker_extension_cls": macs_vllm.WORKER_EXTENSION} if plugin == "macs_kernels" else {}
    llm = LLM(str(args.model or default_model_path()), dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=args.requests, enable_prefix_caching=False, **options)
    paged_backend = macs_vllm.attach(llm) if "on" in args.vllm_modes else ""
    low, high = args.prompt_lens
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": ids} for ids in serving_prompts(vocab, args.requests, low, high)]
    engine = [child for child in psutil.Process().children(recursive=True)]

    def cpu_seconds():
        return sum(sum(p.cpu_times()[:2]) for p in engine)

    order = []
    for repeat in range(repeats):
        modes = args.vllm_modes if repeat % 2 == 0 else args.vllm_modes[::-1]
        order += [(repeat, mode) for mode in modes]
    for mode in args.vllm_modes:  # warm-up: the paged kernel's first call compiles its types (numba)
        extra = macs_vllm.attribution() if mode == "on" else None
        outputs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True, extra_args=extra),
                               use_tqdm=False)
        if mode == "on":
            macs_vllm.release(llm, [o.request_id for o in outputs])
    out = args.out / f"{STEM}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.exists()
    with out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        if new_file:
            writer.writeheader()
        for repeat, mode in order:
            extra = macs_vllm.attribution() if mode == "on" else None
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            load_before = os.getloadavg()[0]
            cpu, start = cpu_seconds(), time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            read = 0.0
            if mode == "on":
                start = time.perf_counter()
                rows = macs_vllm.rows(llm, [o.request_id for o in outputs], release=True)
                read = time.perf_counter() - start
                assert all(r.shape[0] == new_tokens for r in rows.values())
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            row = dict(plugin=plugin, paged_backend=paged_backend, mode=mode, repeat=repeat, requests=args.requests,
                       prompt_min=low, prompt_max=high, new_tokens=new_tokens, wall_s=round(wall, 3),
                       engine_cpu_s=round(cpu, 3), tokens_per_s=round(tokens / wall, 3),
                       tokens_per_cpu_s=round(tokens / cpu, 3), read_s=round(read, 4),
                       engine_rss_mib=round(sum(p.memory_info().rss for p in engine) / 2**20, 1),
                       load_before=load_before, load_after=os.getloadavg()[0])
            writer.writerow(row)
            handle.flush()
            print(row, flush=True)
    return report(args.out)


def _paired(runs: list[dict], field: str) -> float:
    """Median over repeats of (median 'on' / median 'off') of `field` within each repeat."""
    by_repeat: dict = {}
    for row in runs:
        by_repeat.setdefault(row["repeat"], {}).setdefault(row["mode"], []).append(float(row[field]))
    return statistics.median(statistics.median(pair["on"]) / statistics.median(pair["off"])
                             for pair in by_repeat.values() if "on" in pair and "off" in pair)


def summarise(rows: list[dict], serving: list[dict]) -> dict:
    """The ratios of the runs with the plugin loaded and the latest run's paged backend, and
    `bench --serving`'s throughput beside them."""
    backend = rows[-1]["paged_backend"]
    runs = [row for row in rows if row["plugin"] == "macs_kernels" and row["paged_backend"] == backend]
    summary = {"paged_backend": backend, "repeats": len({row["repeat"] for row in runs})}
    summary |= {field: rows[-1][field] for field in ("requests", "prompt_min", "prompt_max", "new_tokens")}
    for mode in ("off", "on"):
        chosen = [row for row in runs if row["mode"] == mode]
        for field in ("tokens_per_s", "tokens_per_cpu_s", "engine_rss_mib"):
            summary[f"{field}_{mode}"] = statistics.median(float(row[field]) for row in chosen)
    summary["on_vs_off_tokens_per_s_paired"] = _paired(runs, "tokens_per_s")
    summary["on_vs_off_tokens_per_cpu_s_paired"] = _paired(runs, "tokens_per_cpu_s")
    summary["on_vs_off_rss"] = _paired(runs, "engine_rss_mib")
    served = [row for row in serving if row["kind"] == "throughput" and row["attribution"] == "True"]
    if served:
        summary["serve_on_tokens_per_s"] = statistics.median(float(row["tok_s"]) for row in served)
        summary["serve_on_tokens_per_cpu_s"] = statistics.median(float(row["cpu_tok_s"]) for row in served)
        summary["vllm_on_vs_serve_on_tokens_per_s"] = summary["tokens_per_s_on"] / summary["serve_on_tokens_per_s"]
        summary["vllm_on_vs_serve_on_tokens_per_cpu_s"] = (summary["tokens_per_cpu_s_on"]
                                                          / summary["serve_on_tokens_per_cpu_s"])
    return summary


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as handle:
        return list(csv.DictReader(handle))


def report(out: Path) -> int:
    from .common import write_csv

    rows = _read(out / f"{STEM}.csv")
    if not rows:
        raise SystemExit(f"no {out / STEM}.csv: run macs-kernels bench --vllm first (in vLLM's environment)")
    summary = summarise(rows, _read(out / "serving_cpu.csv"))
    write_csv([summary], out / f"{STEM}_summary.csv")
    for key, value in summary.items():
        print(f"{key:44s} {value:.4g}" if isinstance(value, float) else f"{key:44s} {value}")
    try:
        plot(summary, out / f"{STEM}.png")
    except ImportError:
        print(f"matplotlib is not installed here: run `macs-kernels bench --vllm-report --out {out}` where it is")
    return 0


def plot(summary: dict, path: Path) -> None:
    from .common import pyplot, save_figure

    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names, colours = ["vLLM", "vLLM + MACS"], ["#999999", "#c0392b"]
    serve = "serve_on_tokens_per_s" in summary
    if serve:
        names, colours = names + ["macs-kernels serve\n(+ MACS)"], colours + ["#2c7fb8"]
    for axis, field, label in ((left, "tokens_per_s", "generated tokens per second (wall)"),
                               (right, "tokens_per_cpu_s", "generated tokens per engine CPU second")):
        values = [summary[f"{field}_off"], summary[f"{field}_on"]] + ([summary[f"serve_on_{field}"]] if serve else [])
        axis.bar(names, values, color=colours)
        axis.set_ylabel(label)
        axis.set_title(f"MACS on/off: {summary[f'on_vs_off_{field}_paired']:.3f}x (paired medians)")
    figure.suptitle(f"{summary['requests']} concurrent requests, prompts {summary['prompt_min']}-"
                    f"{summary['prompt_max']}, {summary['new_tokens']} new tokens; memory on/off "
                    f"{summary['on_vs_off_rss']:.3f}x; paged op: {summary['paged_backend']}", fontsize=10)
    save_figure(figure, path)
