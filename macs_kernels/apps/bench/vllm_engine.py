"""`macs-kernels bench --vllm`: vLLM with MACS attribution against the same engine without it, in vLLM's eager
mode and in its default compiled mode side by side, and against `macs-kernels serve`'s engine on the same
requests (run it in vLLM's environment).

    macs-kernels bench --vllm                 # default model, 8 requests, prompts 256-1024, 32 new tokens, 3 repeats
    macs-kernels bench --vllm --repeats 1 --requests 4 --prompt-lens 64 256 --new-tokens 8      # quick
    macs-kernels bench --vllm --vllm-engines compiled   # vLLM's default (compiled) mode only
    VLLM_ENABLE_V1_MULTIPROCESSING=0 macs-kernels bench --vllm --vllm-engines eager graphs   # the CUDA-graph
                                              # path's buffers beside the eager path, both engines in this process
    VLLM_PLUGINS=none macs-kernels bench --vllm --vllm-modes off   # vLLM without the plugin loaded at all
    macs-kernels bench --vllm-report          # summary and plot again from the CSVs (any environment)

Each engine mode (--vllm-engines: "eager", enforce_eager=True; "compiled", vLLM's default: torch.compile of the
model, CUDA graphs on a GPU; "graphs", the eager engine with the CUDA-graph path's persistent buffers forced on as
vLLM's GPU default would run them, sized for --requests prompts of up to the longest --prompt-lens: vLLM's CPU build
captures no graphs, so every step runs the layers' Python over those buffers) gets an engine of its own, one after
the other: vLLM's default multiprocessing engine, float32, prefix caching off so that every run prefills its
prompts. Each engine serves every run of its mode after one warm-up run of the whole workload per attribution mode.
Where the engine refuses attribution (at attach or on the first attributed request), the refusal is recorded as that
engine's "on" row (status) and its plain runs go on. The prompts are those of `macs-kernels bench --serving`'s
throughput runs (random token ids, seed 0, lengths spread evenly over the range): greedy, end of sequence ignored,
all requests submitted at once. "off" runs them as plain requests, "on" with
SamplingParams.extra_args["attribution"] (and reads every request's rows back through collective_rpc, timed apart).
Modes alternate (off, on, on, off, ...). Throughput is generated tokens per second of wall time and per second of
CPU time of the engine core process (user + system, all threads: on a machine shared with other work, wall time
measures the neighbours too, so the summary's ratio pairs each run with its neighbour of the other mode and takes
the median). Memory is the engine's resident set after each run. Appends one row per run to <--out>/<--name, default
vllm_cpu_throughput>.csv; the summary (one row per engine mode, the latest run's: _summary.csv and .json) and the
plot (.png, where matplotlib is installed) put `macs-kernels bench --serving`'s throughput runs (serving_cpu.csv,
same --out) beside them.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path

from macs_kernels.apps.bench.serving import serving_prompts

FIELDS = ["run", "engine", "status", "plugin", "paged_backend", "mode", "repeat", "requests", "prompt_min",
          "prompt_max", "new_tokens", "wall_s", "engine_cpu_s", "tokens_per_s", "tokens_per_cpu_s", "read_s",
          "engine_rss_mib", "load_before", "load_after"]
STEM = "vllm_cpu_throughput"
ENGINES = {"eager": True, "compiled": False, "graphs": True}  # engine mode: enforce_eager
OK = "ok"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--vllm (vLLM with and without attribution; also --model, --requests, "
                                      "--prompt-lens, --new-tokens, --repeats, --out, --name)")
    group.add_argument("--vllm", action="store_true", help="run the vLLM benchmark (in vLLM's environment)")
    group.add_argument("--vllm-modes", nargs="+", default=["off", "on"], choices=["off", "on"],
                       help="modes to alternate (default: off on)")
    group.add_argument("--vllm-engines", nargs="+", default=["eager", "compiled"], choices=list(ENGINES),
                       help="vLLM engine modes, one engine each: eager (enforce_eager=True), compiled (vLLM's "
                            "default) and graphs (eager, with the CUDA-graph path's buffers forced on) (default: "
                            "eager compiled)")
    group.add_argument("--vllm-report", action="store_true",
                       help="only write the vLLM benchmark's summary and plot from the CSVs under --out")


def _refusal(error: BaseException) -> str:
    return f"refused: {type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error) else ''}"


def run(args) -> int:
    stem = args.name or STEM
    if args.vllm_report:
        return report(args.out, stem)
    out = args.out / f"{stem}.csv"
    if out.exists():
        with out.open() as handle:
            header = next(csv.reader(handle), [])
        if header != FIELDS:
            raise SystemExit(f"{out} has other columns (an older version of this benchmark wrote it): pass --name or "
                             "--out to record this run elsewhere")
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.exists()
    with out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        if new_file:
            writer.writeheader()

        def record(row: dict) -> None:
            writer.writerow(row)
            handle.flush()
            print(row, flush=True)

        for engine in args.vllm_engines:
            _run_engine(args, engine, {"run": run_id, "engine": engine}, record)
            gc.collect()  # the engine just shut down frees its KV cache before the next one allocates its own
    return report(args.out, stem)


def _run_engine(args, engine: str, common: dict, record) -> None:
    """Every run of one engine mode in an engine of its own, shut down at the end."""
    import psutil
    from vllm import LLM, SamplingParams

    from macs_kernels.api import vllm_llm as macs_vllm  # not the facade: its package holds the server app
    from macs_kernels.api.models import default_model_path

    new_tokens = args.new_tokens or 32
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    plugin = "none" if os.environ.get("VLLM_PLUGINS") not in (None, "macs_kernels") else "macs_kernels"
    options = {"worker_extension_cls": macs_vllm.WORKER_EXTENSION} if plugin == "macs_kernels" else {}
    low, high = args.prompt_lens
    forced = engine == "graphs"
    if forced:
        from macs_kernels.engines.vllm import graphs

        # vLLM's CPU platform spawns its engine core process, which would import the package afresh and run the
        # eager path: the forced mode holds only for an engine core in this process.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise SystemExit("--vllm-engines graphs forces the CUDA-graph path in this process: run the benchmark "
                             "with VLLM_ENABLE_V1_MULTIPROCESSING=0 (every engine of the run in this process)")
        options["additional_config"] = macs_vllm.graph_buffers(args.requests, high)
        graph_mode, graphs.graph_mode = graphs.graph_mode, _forced_graph_mode
    try:
        llm = LLM(str(args.model or default_model_path()), dtype="float32", max_model_len=2048,
                  enforce_eager=ENGINES[engine], max_num_seqs=args.requests, enable_prefix_caching=False, **options)
    finally:
        if forced:
            graphs.graph_mode = graph_mode
    try:
        common |= dict(plugin=plugin, requests=args.requests, prompt_min=low, prompt_max=high, new_tokens=new_tokens)
        modes = list(args.vllm_modes)
        paged_backend = ""
        if "on" in modes:
            try:
                paged_backend = macs_vllm.attach(llm)
            except Exception as error:  # noqa: BLE001 - any refusal is this engine's figure, not the run's end
                record(common | {"status": _refusal(error), "mode": "on"})
                modes.remove("on")
        common["paged_backend"] = paged_backend
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [{"prompt_token_ids": ids} for ids in serving_prompts(vocab, args.requests, low, high)]
        # The engine core's processes; this one where vLLM runs the core in it (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        engine_processes = psutil.Process().children(recursive=True) or [psutil.Process()]

        def cpu_seconds():
            return sum(sum(p.cpu_times()[:2]) for p in engine_processes)

        def generate(mode: str) -> tuple[float, float, float, int]:
            """(wall s, engine CPU s, rows read s, tokens) of one run of every prompt."""
            extra = macs_vllm.attribution() if mode == "on" else None
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            cpu, start = cpu_seconds(), time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            read = 0.0
            if mode == "on":
                start = time.perf_counter()
                rows = macs_vllm.rows(llm, [o.request_id for o in outputs], release=True)
                read = time.perf_counter() - start
                short = {key: r.shape[0] for key, r in rows.items() if r.shape[0] != new_tokens}
                if short:
                    raise RuntimeError(f"rows of {len(short)} requests do not have one row per new token: {short}")
            return wall, cpu, read, sum(len(o.outputs[0].token_ids) for o in outputs)

        for mode in list(modes):  # warm-up: the paged kernel's first call compiles its types (numba)
            try:
                generate(mode)
            except Exception as error:  # noqa: BLE001 - e.g. a request's rows refused in this engine mode
                if mode != "on":
                    raise
                record(common | {"status": _refusal(error), "mode": "on"})
                modes.remove("on")
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                load_before = os.getloadavg()[0]
                wall, cpu, read, tokens = generate(mode)
                record(common | dict(
                    status=OK, mode=mode, repeat=repeat, wall_s=round(wall, 3), engine_cpu_s=round(cpu, 3),
                    tokens_per_s=round(tokens / wall, 3), tokens_per_cpu_s=round(tokens / cpu, 3),
                    read_s=round(read, 4), engine_rss_mib=round(sum(p.memory_info().rss for p in engine_processes)
                                                                / 2**20, 1),
                    load_before=load_before, load_after=os.getloadavg()[0]))
    finally:
        llm.llm_engine.engine_core.shutdown()


def _forced_graph_mode(vllm_config) -> str:
    return "FULL_AND_PIECEWISE"


def _paired(runs: list[dict], field: str) -> float | str:
    """Median over repeats of (median 'on' / median 'off') of `field` within each repeat ("" without a pair)."""
    by_repeat: dict = {}
    for row in runs:
        by_repeat.setdefault(row["repeat"], {}).setdefault(row["mode"], []).append(float(row[field]))
    ratios = [statistics.median(pair["on"]) / statistics.median(pair["off"])
              for pair in by_repeat.values() if "on" in pair and "off" in pair]
    return statistics.median(ratios) if ratios else ""


def summarise(rows: list[dict], serving: list[dict]) -> list[dict]:
    """One row per engine mode (and plugin setting) of the latest run: throughput and memory off and on, the
    paired on/off ratios (or the refusal), the engine's plain throughput over the eager engine's, and `bench
    --serving`'s throughput beside them. CSVs written before engine modes existed hold eager runs without a run
    column; there the rows of one paged backend make a run, as their summary took them."""
    rows = [{"run": f"paged backend {row['paged_backend']}", "engine": "eager", "status": OK}
            | {k: v for k, v in row.items() if v is not None} for row in rows]
    latest = rows[-1]["run"]
    rows = [row for row in rows if row["run"] == latest]
    summaries = []
    for engine, plugin in dict.fromkeys((row["engine"], row["plugin"]) for row in rows):
        group = [row for row in rows if (row["engine"], row["plugin"]) == (engine, plugin)]
        runs = [row for row in group if row["status"] == OK]
        refused = [row["status"] for row in group if row["status"] != OK]
        first = group[0]
        summary = {"run": latest, "engine": engine, "plugin": plugin, "attribution": refused[0] if refused else OK,
                   "paged_backend": first["paged_backend"], "repeats": len({row["repeat"] for row in runs})}
        summary |= {field: first[field] for field in ("requests", "prompt_min", "prompt_max", "new_tokens")}
        for mode in ("off", "on"):
            for field in ("tokens_per_s", "tokens_per_cpu_s", "engine_rss_mib"):
                values = [float(row[field]) for row in runs if row["mode"] == mode]
                summary[f"{field}_{mode}"] = statistics.median(values) if values else ""
        summary["on_vs_off_tokens_per_s_paired"] = _paired(runs, "tokens_per_s")
        summary["on_vs_off_tokens_per_cpu_s_paired"] = _paired(runs, "tokens_per_cpu_s")
        summary["on_vs_off_rss"] = _paired(runs, "engine_rss_mib")
        # `bench --serving`'s runs of the same workload only (its CSV names requests and tokens, not prompt lengths).
        served = [row for row in serving if row["kind"] == "throughput" and row["attribution"] == "True"
                  and row["requests"] == str(first["requests"])
                  and row["generated"] == str(int(first["requests"]) * int(first["new_tokens"]))]
        if served and summary["tokens_per_s_on"] != "":
            serve_tok_s = statistics.median(float(row["tok_s"]) for row in served)
            serve_cpu_tok_s = statistics.median(float(row["cpu_tok_s"]) for row in served)
            summary |= {"serve_on_tokens_per_s": serve_tok_s, "serve_on_tokens_per_cpu_s": serve_cpu_tok_s,
                        "vllm_on_vs_serve_on_tokens_per_s": summary["tokens_per_s_on"] / serve_tok_s,
                        "vllm_on_vs_serve_on_tokens_per_cpu_s": summary["tokens_per_cpu_s_on"] / serve_cpu_tok_s}
        summaries.append(summary)
    for summary in summaries:
        eager = next((s for s in summaries if s["engine"] == "eager" and s["plugin"] == summary["plugin"]
                      and s["tokens_per_s_off"] != ""), None)
        for field in ("tokens_per_s", "tokens_per_cpu_s"):
            summary[f"off_vs_eager_off_{field}"] = (summary[f"{field}_off"] / eager[f"{field}_off"]
                                                    if eager and summary[f"{field}_off"] != "" else "")
    return summaries


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as handle:
        return list(csv.DictReader(handle))


def report(out: Path, stem: str = STEM) -> int:
    from macs_kernels.apps.bench.common import write_csv

    rows = _read(out / f"{stem}.csv")
    if not rows:
        raise SystemExit(f"no {out / stem}.csv: run macs-kernels bench --vllm first (in vLLM's environment)")
    summaries = summarise(rows, _read(out / "serving_cpu.csv"))
    columns = list(dict.fromkeys(key for summary in summaries for key in summary))
    write_csv(summaries, out / f"{stem}_summary.csv", columns)
    (out / f"{stem}_summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
    for summary in summaries:
        print(f"--- {summary['engine']}")
        for key, value in summary.items():
            print(f"{key:44s} {value:.4g}" if isinstance(value, float) else f"{key:44s} {value}")
    try:
        plot(summaries, out / f"{stem}.png")
    except ImportError:
        print(f"matplotlib is not installed here: run `macs-kernels bench --vllm-report --out {out}` where it is")
    return 0


def plot(summaries: list[dict], path: Path) -> None:
    from macs_kernels.apps.bench.common import pyplot, save_figure

    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names, values_of, colours = [], [], []
    for summary in summaries:
        engine = summary["engine"] + ("" if summary["plugin"] == "macs_kernels" else ", no plugin")
        names += [f"vLLM {engine}", f"vLLM {engine}\n+ MACS"]
        values_of += [(summary, "off"), (summary, "on")]
        colours += ["#999999", "#c0392b"]
    served = next((s for s in summaries if "serve_on_tokens_per_s" in s), None)
    if served:
        names.append("macs-kernels serve\n(+ MACS)")
        values_of.append((served, "serve"))
        colours.append("#2c7fb8")
    for axis, field, label in ((axes[0], "tokens_per_s", "generated tokens per second (wall)"),
                               (axes[1], "tokens_per_cpu_s", "generated tokens per engine CPU second")):
        values = [summary[f"serve_on_{field}"] if mode == "serve" else summary[f"{field}_{mode}"]
                  for summary, mode in values_of]
        bars = axis.bar(names, [value if value != "" else 0 for value in values], color=colours)
        for bar, (summary, mode), value in zip(bars, values_of, values):
            ratio = summary[f"on_vs_off_{field}_paired"]
            text = ("refused" if value == "" else f"{ratio:.3f}x" if mode == "on" and ratio != "" else "")
            axis.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                          fontsize=8)
        axis.set_ylabel(label)
        axis.set_title("MACS on/off per engine mode (paired medians)", fontsize=9)
        axis.tick_params(axis="x", labelsize=7)
    first = summaries[0]
    memory = ", ".join(f"{s['engine']} {s['on_vs_off_rss']:.3f}x" for s in summaries if s["on_vs_off_rss"] != "")
    figure.suptitle(f"{first['requests']} concurrent requests, prompts {first['prompt_min']}-{first['prompt_max']}, "
                    f"{first['new_tokens']} new tokens; memory on/off: {memory or 'n/a'}; paged op: "
                    f"{first['paged_backend'] or 'n/a'}", fontsize=10)
    save_figure(figure, path)
