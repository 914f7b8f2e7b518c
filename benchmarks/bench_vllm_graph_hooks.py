"""What the vLLM adapter's own hooks cost, eager path against the CUDA-graph path (its persistent buffers forced on
as a GPU's default would run them), with no request attributed and with all of them: in vLLM's venv,

    python benchmarks/bench_vllm_graph_hooks.py --out benchmarks/results

Default model, float32, one in-process engine per path (the forced mode holds only in this process: vLLM's CPU
platform spawns its engine core), 4 requests of 64-256 random prompt tokens (`bench --serving`'s), 24 greedy
tokens, runs alternating off / on. Besides wall and process CPU time it sums the wall time spent inside the
adapter's hooks (the eager tracer's per-layer hook; the graph path's per-step plan and per-layer hook): on a
machine shared with other work, wall-time ratios between runs measure the neighbours, while the hooks' share of
each run is the adapter's own cost. Writes vllm_cpu_graph_hooks.csv (every run) and _summary.json (per path:
median hook share of off and on runs, paired on/off tokens per wall and per CPU second).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

FIELDS = ["path", "mode", "repeat", "wall_s", "cpu_s", "hook_s", "hook_share", "tokens"]


def run_path(path: str, args, spent: dict) -> list[dict]:
    from vllm import LLM, SamplingParams

    import macs_kernels.vllm as macs_vllm
    from macs_kernels.api.models import default_model_path
    from macs_kernels.apps.bench.serving import serving_prompts
    from macs_kernels.engines.vllm import graphs

    graph_mode = graphs.graph_mode
    if path == "graphs":
        graphs.graph_mode = lambda vllm_config: "FULL_AND_PIECEWISE"
    try:
        llm = LLM(str(default_model_path()), dtype="float32", max_model_len=2048, enforce_eager=True,
                  max_num_seqs=args.requests, enable_prefix_caching=False,
                  worker_extension_cls=macs_vllm.WORKER_EXTENSION,
                  additional_config=macs_vllm.graph_buffers(args.requests, 256))
    finally:
        graphs.graph_mode = graph_mode
    rows = []
    try:
        macs_vllm.attach(llm)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [{"prompt_token_ids": ids} for ids in serving_prompts(vocab, args.requests, 64, 256)]

        def generate(mode: str):
            extra = macs_vllm.attribution() if mode == "on" else None
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, extra_args=extra)
            spent["s"] = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            if mode == "on":
                found = macs_vllm.rows(llm, [o.request_id for o in outputs], release=True)
                assert all(r.shape[0] == 24 for r in found.values())
            return wall, cpu, spent["s"], sum(len(o.outputs[0].token_ids) for o in outputs)

        generate("off"), generate("on")  # warm-up: numba compiles its types
        for repeat in range(args.repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                wall, cpu, hook, tokens = generate(mode)
                rows.append(dict(path=path, mode=mode, repeat=repeat, wall_s=round(wall, 4), cpu_s=round(cpu, 4),
                                 hook_s=round(hook, 5), hook_share=round(hook / wall, 5), tokens=tokens))
                print(rows[-1], flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


def summarise(rows: list[dict]) -> dict:
    summary = {}
    for path in dict.fromkeys(row["path"] for row in rows):
        mine = [row for row in rows if row["path"] == path]
        by = {(row["mode"], row["repeat"]): row for row in mine}
        repeats = sorted({row["repeat"] for row in mine})
        summary[path] = {
            "hook_share_off_median": statistics.median(r["hook_share"] for r in mine if r["mode"] == "off"),
            "hook_share_on_median": statistics.median(r["hook_share"] for r in mine if r["mode"] == "on"),
            "hook_s_on_median": statistics.median(r["hook_s"] for r in mine if r["mode"] == "on"),
            # Same tokens in every run: tokens per second on / off is the off run's time over the on run's.
            "on_vs_off_tokens_per_s_paired": statistics.median(by["off", k]["wall_s"] / by["on", k]["wall_s"]
                                                               for k in repeats),
            "on_vs_off_tokens_per_cpu_s_paired": statistics.median(by["off", k]["cpu_s"] / by["on", k]["cpu_s"]
                                                                   for k in repeats),
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    from macs_kernels.engines.vllm import graphs
    from macs_kernels.engines.vllm import tracer as tracing

    spent = {"s": 0.0}

    def timed(function):
        def hook(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - start
        return hook

    tracing.VllmTracer.layer = timed(tracing.VllmTracer.layer)
    graphs.GraphSteps.plan = timed(graphs.GraphSteps.plan)
    graphs.GraphSteps.layer = timed(graphs.GraphSteps.layer)
    rows = run_path("eager", args, spent) + run_path("graphs", args, spent)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "vllm_cpu_graph_hooks.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    summary = summarise(rows) | {"load_average_after": os.getloadavg()[0], "argv": sys.argv[1:]}
    (args.out / "vllm_cpu_graph_hooks_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
