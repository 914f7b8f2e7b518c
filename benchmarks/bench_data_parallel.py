"""Wall time of `macs-kernels eval` on the first N stqa_350 samples: 1 rank (1 thread) against K torchrun ranks (1
thread each), in one run, each from an empty results file and record cache (every sample generated and scored).

    python benchmarks/bench_data_parallel.py --data ../shared/data/stqa_350.json [--n 20] [--ranks 2] [--repeats 1]

Writes benchmarks/results/data_parallel_cpu.csv (every run) and .png; prints the speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from macs_kernels.apps.bench.common import environment, pyplot, save_figure, write_csv

RESULTS = Path(__file__).resolve().parent / "results"


def eval_once(data: Path, n: int, ranks: int, folder: Path) -> float:
    # --range, not --n: torchrun's own parser would take --n as an abbreviation of its options.
    arguments = ["eval", "--data", str(data), "--range", f"0:{n}", "--faithfulness-n", "0", "--threads", "1",
                 "--out", str(folder / "results.jsonl"), "--records", str(folder / "records"), "--no-progress"]
    launcher = [sys.executable, "-m", "macs_kernels"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
        "macs_kernels"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(launcher + arguments, check=True, env=env, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    env = environment("cpu")
    for repeat in range(args.repeats):
        for ranks in (1, args.ranks):  # side by side in one run: the ratio is what means something here
            with tempfile.TemporaryDirectory() as folder:
                seconds = eval_once(args.data, args.n, ranks, Path(folder))
            rows.append({"repeat": repeat, "ranks": ranks, "threads_per_rank": 1, "samples": args.n,
                         "wall_s": round(seconds, 2), "load_average": os.getloadavg()[0], **env})
            print(f"repeat {repeat}: {ranks} rank(s): {seconds:.1f} s", flush=True)
    write_csv(rows, args.out / "data_parallel_cpu.csv")
    single = statistics.median(r["wall_s"] for r in rows if r["ranks"] == 1)
    parallel = statistics.median(r["wall_s"] for r in rows if r["ranks"] == args.ranks)
    print(f"median wall time: 1 rank {single:.1f} s, {args.ranks} ranks {parallel:.1f} s: {single / parallel:.2f}x")
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(4.5, 3))
    axis.bar(["1 rank", f"{args.ranks} ranks"], [single, parallel], color=["#888", "#c33"])
    axis.set_ylabel("wall time (s)")
    axis.set_title(f"eval, {args.n} stqa_350 samples, 1 thread per rank")
    save_figure(figure, args.out / "data_parallel_cpu.png")


if __name__ == "__main__":
    main()
