"""The bytes the triton backend's decode step moves at issue 48's shapes, counted on a CPU: CSV, JSON, PNG, no asserts.

    python benchmarks/bench_traffic.py              # B 1: 4k and 32k keys at D 128, 32k at D 64 (about 10 minutes)
    python benchmarks/bench_traffic.py --quick      # 4k keys at D 128 only (about 2 minutes)
    python benchmarks/bench_traffic.py --all        # also B 8 x 32k and 128k keys (an hour or more)

Every load and store of Triton's interpreter, by kernel and argument (macs_kernels/apps/bench/traffic.py), with the
launch plan of an H200 (132 multiprocessors: the same splits, so the same partial results): attention alone, then
decode_attention fused with the log c update and macs_update under each fused pass (ops/triton/settings.py). bf16,
32 query heads on 8 KV heads, the last 16 keys generated. What DRAM moves lies between the distinct bytes (every
repeat served by the cache) and the sector bytes (none served); a kernel's time is not counted: it is a CPU.

Issue 48's goal is the fused pass within 1.10x of attention's time; these are its bytes over attention's, the floor
of that ratio on a GPU that reads at its bandwidth. Writes benchmarks/results/traffic_triton_cpu.{csv,json,png}
(or under --out): one CSV row per (shape, call, kernel, argument), one JSON line per (shape, call).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_ops import Problem, backend_call  # noqa: E402

from macs_kernels.apps.bench import environment, write_csv  # noqa: E402
from macs_kernels.apps.bench.traffic import triton_launch_plans_for, triton_traffic  # noqa: E402
from macs_kernels.ops.triton.settings import (  # noqa: E402
    TRITON_SPLIT_KV_PASSES,
    set_triton_split_kv_pass,
    triton_split_kv_pass,
)

H200_MULTIPROCESSORS = 132
HEADS, KV_HEADS = 32, 8
# Arguments that hold the input keys' scores (and the two- and one-launch passes' block maxima), by any kernel's name
# for them.
SCORE_ARGUMENTS = ("scores", "values", "tile_max")


def shapes(quick: bool, every: bool) -> list[tuple[int, int, int]]:
    """(B, keys, D), issue 48's table without its largest rows unless `every`."""
    if quick:
        return [(1, 4096, 128)]
    chosen = [(1, 4096, 128), (1, 32768, 128), (1, 32768, 64)]
    return chosen + ([(8, 32768, 128), (1, 131072, 128)] if every else [])


def calls(batch: int, keys: int, dim: int):
    """(name, split pass, no-argument call, K/V bytes it must read) for one shape: bench_ops' problem and its triton
    calls (the kernels, called as the tracer calls them)."""
    torch.manual_seed(0)
    problem = Problem(batch, HEADS, KV_HEADS, dim, keys, torch.bfloat16, torch.device("cpu"))
    yield ("attention", "", backend_call("triton", fused=False)("decode_attention", problem),
           problem.bytes("decode_attention"))
    for op, name in (("decode_attention", "decode_attention with log_c"), ("macs_update", "macs_update")):
        for split_pass in TRITON_SPLIT_KV_PASSES:
            yield name, split_pass, backend_call("triton", split_kernel=split_pass)(op, problem), problem.bytes(op)


def measure(shape, env: dict) -> tuple[list[dict], list[dict]]:
    batch, keys, dim = shape
    detail, summary = [], []
    for name, split_pass, call, cache_bytes in calls(batch, keys, dim):
        tick = time.perf_counter()
        with triton_launch_plans_for(H200_MULTIPROCESSORS), triton_traffic() as traffic:
            call()
        total = traffic.total()
        scores = sum(c.read_distinct + c.written_distinct for (_, argument), c in traffic.counts.items()
                     if set(argument.split("=")) <= set(SCORE_ARGUMENTS))  # "scores=m": m, scores unused
        columns = dict(B=batch, H=HEADS, H_kv=KV_HEADS, D=dim, S=keys, dtype="bfloat16", call=name,
                       split_pass=split_pass or "(attention only)")
        detail += [columns | row | env for row in traffic.rows()]
        summary.append(columns | dict(
            cache_bytes=cache_bytes, distinct_bytes=total.read_distinct + total.written_distinct,
            sector_bytes=total.read_sectors + total.written_sectors, score_bytes=scores,
            kernels=len({kernel for kernel, _ in traffic.counts}), seconds=round(time.perf_counter() - tick, 1)))
        print(json.dumps(summary[-1]), flush=True)
    attention = next(row for row in summary if row["call"] == "attention")
    for row in summary:
        floor = attention if row["call"] != "macs_update" else None
        for kind in ("distinct", "sector"):
            base = floor[f"{kind}_bytes"] if floor else row["cache_bytes"]
            row[f"{kind}_over_{'attention' if floor else 'K'}"] = round(row[f"{kind}_bytes"] / base, 4)
    return detail, summary


def print_table(summary: list[dict]) -> None:
    print("\nbytes over attention's (decode_attention with log c) or over K's (macs_update): distinct / sectors")
    for row in summary:
        if row["call"] == "attention":
            continue
        key = "attention" if row["call"] != "macs_update" else "K"
        print(f"B {row['B']} S {row['S']:>6} D {row['D']:>3}  {row['call']:<28} {row['split_pass']:<11} "
              f"{row[f'distinct_over_{key}']:.4f} / {row[f'sector_over_{key}']:.4f}")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fused = [row for row in summary if row["call"] == "decode_attention with log_c"]
    shapes_seen = sorted({(row["B"], row["S"], row["D"]) for row in fused})
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(shapes_seen), 3.4))
    width = 0.8 / len(TRITON_SPLIT_KV_PASSES)
    for i, split_pass in enumerate(TRITON_SPLIT_KV_PASSES):
        rows = [next(r for r in fused if (r["B"], r["S"], r["D"]) == s and r["split_pass"] == split_pass)
                for s in shapes_seen]
        positions = [j + (i - 1) * width for j in range(len(shapes_seen))]
        ax.bar(positions, [r["distinct_over_attention"] for r in rows], width, label=f"{split_pass} (distinct)")
        ax.scatter(positions, [r["sector_over_attention"] for r in rows], color="black", marker="_", s=120,
                   zorder=3, label="sectors" if i == 0 else None)
    ax.axhline(1.10, color="red", linestyle="--", linewidth=1, label="issue 48's goal (time)")
    ax.set_xticks(range(len(shapes_seen)), [f"B {b}, {s // 1024}k keys, D {d}" for b, s, d in shapes_seen],
                  fontsize=8)
    ax.set_ylim(1.0, max(1.15, max(r["sector_over_attention"] for r in fused) + 0.02))
    ax.set_ylabel("bytes / attention's", fontsize=8)
    ax.set_title("Triton fused decode (log c), bytes over attention alone (bf16, 32/8 heads, H200 plan)",
                 fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--all", action="store_true", help="also B 8 x 32k and 128k keys")
    parser.add_argument("--shape", action="append", metavar="B,KEYS,D", help="these shapes instead (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    env = environment(torch.device("cpu"))
    detail, summary = [], []
    chosen = [tuple(map(int, shape.split(","))) for shape in args.shape] if args.shape else shapes(args.quick, args.all)
    previous = triton_split_kv_pass()
    try:
        for shape in chosen:
            rows, lines = measure(shape, env)
            detail += rows
            summary += lines
    finally:
        set_triton_split_kv_pass(previous)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "traffic_triton_cpu"
    write_csv(detail, stem.with_suffix(".csv"))
    stem.with_suffix(".json").write_text("".join(json.dumps(row | env) + "\n" for row in summary))
    plot(summary, stem.with_suffix(".png"))
    print_table(summary)
    print(f"wrote {stem}.csv, .json, .png")


if __name__ == "__main__":
    main()
