"""The bytes a decode step moves at issue 48's shapes, counted on a CPU: CSV, JSON, PNG, no asserts.

    python benchmarks/bench_traffic.py              # triton: B 1, 4k and 32k keys at D 128, 32k at D 64 (10 minutes)
    python benchmarks/bench_traffic.py --quick      # 4k keys at D 128 only (about 2 minutes)
    python benchmarks/bench_traffic.py --all        # also B 8 x 32k and 128k keys (an hour or more)
    MACS_KERNELS_CUDA_EMULATION=1 python benchmarks/bench_traffic.py --backend cuda   # emulated (6 GB)

Every access of the backend's kernels, by kernel and argument (macs_kernels/apps/bench/traffic.py: each load and store
of Triton's interpreter; the CUDA emulation's loads, stores and asynchronous copies), with the launch plan of an H200
(132 multiprocessors: the same splits, so the same partial results): attention alone, then decode_attention fused with
the log c update and macs_update (triton: its fused pass; cuda: the split kernel the shape chooses, named in the
split_pass column). bf16, 32 query heads on 8 KV heads, the last 16 keys generated. What DRAM moves lies between the
distinct bytes (every repeat served by the cache) and the sector bytes (none served); a kernel's time is not counted:
it is a CPU.

Issue 48's goal is the fused pass within 1.10x of attention's time; these are its bytes over attention's, the floor
of that ratio on a GPU that reads at its bandwidth. Writes benchmarks/results/traffic_<backend>_cpu.{csv,json,png}
(or under --out): one CSV row per (shape, call, kernel, argument), one JSON line per (shape, call).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_ops import Problem, backend_call  # noqa: E402

from macs_kernels.apps.bench import environment, write_csv  # noqa: E402
from macs_kernels.apps.bench.traffic import cuda_traffic, triton_launch_plans_for, triton_traffic  # noqa: E402

H200_MULTIPROCESSORS = 132
HEADS, KV_HEADS = 32, 8
BACKENDS = ("triton", "cuda")
# Arguments that hold the input keys' scores (and the maxima they are kept relative to), by any kernel's name for them.
SCORE_ARGUMENTS = ("scores", "values", "relative_scores", "score_maxima")


def shapes(quick: bool, every: bool) -> list[tuple[int, int, int]]:
    """(B, keys, D), issue 48's table without its largest rows unless `every`."""
    if quick:
        return [(1, 4096, 128)]
    chosen = [(1, 4096, 128), (1, 32768, 128), (1, 32768, 64)]
    return chosen + ([(8, 32768, 128), (1, 131072, 128)] if every else [])


def calls(backend: str, problem: Problem):
    """(name, no-argument call, K/V bytes it must read) for one problem: bench_ops' calls of the backend's kernels,
    called as the tracer calls them: attention alone, then the fused passes."""
    attention = backend_call(backend, fused=False)("decode_attention", problem)
    yield "attention", attention, problem.bytes("decode_attention")
    for op, name in (("decode_attention", "decode_attention with log_c"), ("macs_update", "macs_update")):
        yield name, backend_call(backend)(op, problem), problem.bytes(op)


def split_pass_of(backend: str, traffic) -> str:
    """The fused pass a call ran: triton's, or the cuda split kernel its shape chose (its name without
    "_split_kernel": mma, pipelined, or "general" for split_kernel)."""
    if backend == "triton":
        return "fused"
    [name] = {match.group(1) or "general" for kernel, _ in traffic.counts
              if (match := re.search(r"macs::(\w*?)_?split_kernel<", kernel))}
    return name


@contextlib.contextmanager
def counted(backend: str, problem: Problem):
    """The traffic of the kernels run inside, with an H200's launch plan (the emulation's default device for cuda,
    whose accesses are credited to the problem's tensors by name and to the buffers its launchers name)."""
    if backend == "triton":
        with triton_launch_plans_for(H200_MULTIPROCESSORS), triton_traffic() as traffic:
            yield traffic
    else:
        with cuda_traffic(dict(q=problem.q, k=problem.k, v=problem.v, log_c=problem.log_c, kv_start=problem.start,
                               kv_len=problem.kv_len, input_end=problem.input_end)) as traffic:
            yield traffic


def measure(backend: str, shape, env: dict) -> tuple[list[dict], list[dict]]:
    batch, keys, dim = shape
    torch.manual_seed(0)
    problem = Problem(batch, HEADS, KV_HEADS, dim, keys, torch.bfloat16, torch.device("cpu"))
    detail, summary = [], []
    for name, call, cache_bytes in calls(backend, problem):
        if backend == "cuda":
            call()  # the first call of the process runs the backend's self-check, on buffers it names too
        tick = time.perf_counter()
        with counted(backend, problem) as traffic:
            call()
        total = traffic.total()
        # A score argument may be a view inside a workspace argument ("scores=partials").
        scores = sum(c.read_distinct + c.written_distinct for (_, argument), c in traffic.counts.items()
                     if set(argument.split("=")) & set(SCORE_ARGUMENTS))
        split_pass = "(attention only)" if name == "attention" else split_pass_of(backend, traffic)
        columns = dict(B=batch, H=HEADS, H_kv=KV_HEADS, D=dim, S=keys, dtype="bfloat16", backend=backend, call=name,
                       split_pass=split_pass)
        detail += [columns | row | env for row in traffic.rows()]
        summary.append(columns | dict(
            cache_bytes=cache_bytes, distinct_bytes=total.read_distinct + total.written_distinct,
            sector_bytes=total.read_sectors + total.written_sectors, score_bytes=scores,
            kernels=len({kernel for kernel, _ in traffic.counts}), seconds=round(time.perf_counter() - tick, 1)))
        print(json.dumps(summary[-1]), flush=True)
    [attention] = [row for row in summary if row["call"] == "attention"]
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
    split_passes = list(dict.fromkeys(row["split_pass"] for row in fused))
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(shapes_seen), 3.4))
    width = 0.8 / len(split_passes)
    for i, split_pass in enumerate(split_passes):
        # A shape's cuda split kernel is the one its D chooses: each pass has bars at its own shapes.
        placed = [(j, r) for j, s in enumerate(shapes_seen) for r in fused
                  if (r["B"], r["S"], r["D"]) == s and r["split_pass"] == split_pass]
        positions = [j + (i - (len(split_passes) - 1) / 2) * width for j, _ in placed]
        rows = [r for _, r in placed]
        ax.bar(positions, [r["distinct_over_attention"] for r in rows], width, label=f"{split_pass} (distinct)")
        ax.scatter(positions, [r["sector_over_attention"] for r in rows], color="black", marker="_", s=120,
                   zorder=3, label="sectors" if i == 0 else None)
    ax.axhline(1.10, color="red", linestyle="--", linewidth=1, label="issue 48's goal (time)")
    ax.set_xticks(range(len(shapes_seen)), [f"B {b}, {s // 1024}k keys, D {d}" for b, s, d in shapes_seen],
                  fontsize=8)
    ax.set_ylim(1.0, max(1.15, max(r["sector_over_attention"] for r in fused) + 0.02))
    ax.set_ylabel("bytes / attention's", fontsize=8)
    ax.set_title(f"{fused[0]['backend']} fused decode (log c), bytes over attention alone (bf16, 32/8 heads, H200 "
                 "plan)", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS, default="triton",
                        help="cuda: the CUDA emulation's kernels (MACS_KERNELS_CUDA_EMULATION=1)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--all", action="store_true", help="also B 8 x 32k and 128k keys")
    parser.add_argument("--shape", action="append", metavar="B,KEYS,D", help="these shapes instead (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.backend == "cuda" and os.environ.get("MACS_KERNELS_CUDA_EMULATION") != "1":
        parser.error("--backend cuda counts the CUDA emulation's accesses: set MACS_KERNELS_CUDA_EMULATION=1")
    env = environment(torch.device("cpu"))
    detail, summary = [], []
    chosen = [tuple(map(int, shape.split(","))) for shape in args.shape] if args.shape else shapes(args.quick, args.all)
    for shape in chosen:
        rows, lines = measure(args.backend, shape, env)
        detail += rows
        summary += lines
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"traffic_{args.backend}_cpu"
    write_csv(detail, stem.with_suffix(".csv"))
    stem.with_suffix(".json").write_text("".join(json.dumps(row | env) + "\n" for row in summary))
    plot(summary, stem.with_suffix(".png"))
    print_table(summary)
    print(f"wrote {stem}.csv, .json, .png")


if __name__ == "__main__":
    main()
