"""The Triton backend's host time per kernel call, measured without a GPU: its launchers run whole, with every launch
recorded by a null driver instead of run (macs_kernels.apps.bench.null_driver; the kernels compile for sm_90), on CPU
tensors. Direct launches (the default, ops/triton/common.py `launch`) against Triton's own JITFunction.run path,
in interleaved rounds; the ratio is the figure to read (this machine is noisy; a GPU's host adds the CUDA launch itself
and the allocator). Issue 48's goal is <= 60 us for an eager public call on triton; on an H200's host the kernel call
of a fused decode measured 199 us (bench_ops.py's host table).

    python benchmarks/bench_triton_host.py     # benchmarks/results/triton_host_cpu.{csv,json,png}, a profile beside
    git worktree add /tmp/old 2763cf0 && python benchmarks/bench_triton_host.py --source /tmp/old
        # another checkout's launchers (its own launch path, "default"): triton_host_cpu_<commit>.*
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

# Real JITFunctions (the interpreter's launches are another path): before triton is imported.
os.environ["TRITON_INTERPRET"] = "0"

ROOT = Path(__file__).resolve().parents[1]
# (name, op, fused): what bench_ops.py's host table times on a GPU, and decode attention alone.
CALLS = (("decode_attention with log c", "decode_attention", True),
         ("decode_attention", "decode_attention", False),
         ("macs_update", "macs_update", True))


def per_call_us(call, calls: int) -> float:
    tick = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - tick) / calls * 1e6


def measure(problem, backend_call, rounds: int, calls: int) -> list[dict]:
    import bench_ops

    # The imported checkout's launch paths (bench_ops.launch_paths); one before direct launches has only its own.
    paths = dict(bench_ops.launch_paths("triton")) if hasattr(bench_ops, "launch_paths") else {
        "default": contextlib.nullcontext}
    rows = []
    for name, op, fused in CALLS:
        call = backend_call("triton", fused=fused)(op, problem)
        samples = {launch: [] for launch in paths}
        for _ in range(rounds):
            for launch, launching in paths.items():
                with launching():
                    call()  # a first launch of each specialisation compiles
                    samples[launch].append(per_call_us(call, calls))
        for launch, times in samples.items():
            rows.append(dict(call=name, launch=launch, best_us=round(min(times), 2),
                             median_us=round(statistics.median(times), 2), rounds=rounds, calls=calls))
        best = {launch: min(times) for launch, times in samples.items()}
        ratio = {"direct_over_jit_run": round(best["direct"] / best["JITFunction.run"], 3)} if len(best) == 2 else {}
        print(json.dumps(dict(call=name, **ratio, **{f"{launch} best_us": round(t, 2) for launch, t in best.items()})))
    return rows


def profile(problem, backend_call, calls: int) -> str:
    """cProfile of the fused decode's calls on the default launch path, functions by their own time."""
    call = backend_call("triton")("decode_attention", problem)
    call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, _, _ in CALLS]
    paths = list(dict.fromkeys(row["launch"] for row in rows))
    width = 0.8 / len(paths)
    figure, axes = plt.subplots(figsize=(7, 3.5))
    for index, launch in enumerate(paths):
        best = [next(row["best_us"] for row in rows if row["call"] == name and row["launch"] == launch)
                for name in names]
        axes.bar([i + (index - (len(paths) - 1) / 2) * width for i in range(len(names))], best, width=width,
                 label=launch)
    axes.set_xticks(range(len(names)), names)
    axes.set_ylabel("host us per kernel call (best round)")
    axes.set_title(f"Triton backend at {rows[0]['commit'][:7] or 'an unknown commit'}, launches recorded by a null "
                   "driver (CPU)", fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def _null_driver():
    """This checkout's null driver, whichever checkout's macs_kernels is imported (an older one has none)."""
    path = ROOT / "macs_kernels" / "apps" / "bench" / "null_driver.py"
    spec = importlib.util.spec_from_file_location("bench_null_driver", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300, help="calls per round")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="the checkout whose macs_kernels and benchmarks/bench_ops.py run (default this one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    sys.path[:0] = [str(source), str(source / "benchmarks")]
    import torch
    from bench_ops import Problem, backend_call

    import macs_kernels
    from macs_kernels.apps.bench import environment, write_csv

    assert Path(macs_kernels.__file__).resolve().is_relative_to(source), (macs_kernels.__file__, source)
    # bench_ops.py's host table's problem: what a public call's host time is measured on.
    problem = Problem(1, 2, 1, 64, 64, torch.bfloat16, torch.device("cpu"))
    env = environment("cpu")
    with _null_driver().activate(keep=0):  # nothing here reads the records
        rows = [env | row for row in measure(problem, backend_call, args.rounds, args.calls)]
        report = profile(problem, backend_call, args.calls)
    stem = args.out / ("triton_host_cpu" if source == ROOT else f"triton_host_cpu_{env['commit'][:7]}")
    write_csv(rows, stem.with_suffix(".csv"))
    stem.with_suffix(".json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Path(f"{stem}_profile.txt").write_text(report)
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv, .json, .png and {stem.name}_profile.txt")


if __name__ == "__main__":
    main()
