"""The Triton backend's host time per kernel call, measured without a GPU: its launchers run whole, with every launch
recorded by a null driver instead of run (macs_kernels.apps.bench.null_driver; the kernels compile for sm_90), on CPU
tensors. Direct launches (the default, ops/triton/common.py `launch`) against Triton's own JITFunction.run path,
in interleaved rounds; the ratio is the figure to read (this machine is noisy; a GPU's host adds the CUDA launch itself
and the allocator). Issue 48's goal is <= 60 us for an eager public call on triton; on an H200's host the kernel call
of a fused decode measured 199 us (bench_ops.py's host table).

    python benchmarks/bench_triton_host.py     # benchmarks/results/triton_host_cpu.{csv,json,png}, a profile beside
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
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

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_ops import Problem, backend_call  # noqa: E402

from macs_kernels.apps.bench import environment, write_csv  # noqa: E402
from macs_kernels.apps.bench.null_driver import activate  # noqa: E402

# (name, op, fused): what bench_ops.py's host table times on a GPU, and decode attention alone.
CALLS = (("decode_attention with log c", "decode_attention", True),
         ("decode_attention", "decode_attention", False),
         ("macs_update", "macs_update", True))
LAUNCHES = ("direct", "JITFunction.run")


def per_call_us(call, calls: int) -> float:
    tick = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - tick) / calls * 1e6


def measure(problem: Problem, rounds: int, calls: int) -> list[dict]:
    from macs_kernels.ops.triton import common

    rows = []
    for name, op, fused in CALLS:
        call = backend_call("triton", fused=fused)(op, problem)
        samples = {launch: [] for launch in LAUNCHES}
        for _ in range(rounds):
            for launch in LAUNCHES:
                with common.jit_launches() if launch == "JITFunction.run" else contextlib.nullcontext():
                    call()  # a first launch of each specialisation compiles
                    samples[launch].append(per_call_us(call, calls))
        for launch in LAUNCHES:
            rows.append(dict(call=name, launch=launch, best_us=round(min(samples[launch]), 2),
                             median_us=round(statistics.median(samples[launch]), 2), rounds=rounds, calls=calls))
        ratio = min(samples["direct"]) / min(samples["JITFunction.run"])
        print(json.dumps(dict(call=name, direct_over_jit_run=round(ratio, 3),
                              **{f"{launch} best_us": row["best_us"] for launch, row in zip(LAUNCHES, rows[-2:])})))
    return rows


def profile(problem: Problem, calls: int) -> str:
    """cProfile of the fused decode's direct launches, functions by their own time."""
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
    figure, axes = plt.subplots(figsize=(7, 3.5))
    for offset, launch in zip((-0.2, 0.2), LAUNCHES):
        best = [next(row["best_us"] for row in rows if row["call"] == name and row["launch"] == launch)
                for name in names]
        axes.bar([i + offset for i in range(len(names))], best, width=0.4, label=launch)
    axes.set_xticks(range(len(names)), names)
    axes.set_ylabel("host us per kernel call (best round)")
    axes.set_title("Triton backend, launches recorded by a null driver (CPU)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300, help="calls per round")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    # bench_ops.py's host table's problem: what a public call's host time is measured on.
    problem = Problem(1, 2, 1, 64, 64, torch.bfloat16, torch.device("cpu"))
    env = environment("cpu")
    with activate():
        rows = [env | row for row in measure(problem, args.rounds, args.calls)]
        report = profile(problem, args.calls)
    stem = args.out / "triton_host_cpu"
    write_csv(rows, stem.with_suffix(".csv"))
    stem.with_suffix(".json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Path(f"{stem}_profile.txt").write_text(report)
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv, .json, .png and {stem.name}_profile.txt")


if __name__ == "__main__":
    main()
