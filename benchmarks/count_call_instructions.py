"""Instructions a public op's call executes on the host besides its kernel, counted by valgrind's callgrind:
counts that repeat within 0.2% from run to run, where this machine's timings of a 10 us call vary up to 2x (issue 48).

    python benchmarks/count_call_instructions.py                      # this checkout
    git clone -q . /tmp/old && git -C /tmp/old checkout -q b3af15c && \
        python benchmarks/count_call_instructions.py --source /tmp/old   # and another, side by side

Each source runs bench_checks.py's public calls (B = 8, GQA 4:1, D = 128, 4,096 keys, int32 ranges) with index values
as on a GPU (not on the host), on each of PATHS: the public op with its kernel a no-op, and the cuda backend's whole
host path on its CPU emulation. Per op, after a warm-up, `--calls` calls run inside one functools.reduce, the
function callgrind collects in (`--toggle-collect`) and dumps after; instructions per call are that dump's total over
the calls.
Writes benchmarks/results/call_instructions_cpu.{json,png} (or --out); needs valgrind (Debian's package).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTED = "functools_reduce"
# What a call runs, and the environment it needs: "wrapper", the public op with its kernel a no-op (bench_checks'
# wrapper path, the default backend); "cuda to the launch", the cuda backend's whole host path (the public op, the
# dispatcher, the launcher and its allocations) on the CPU emulation, kernels checked and logged but not run
# (bench_checks' "to the launch": a GPU's driver launches and its caching allocator are not in it).
PATHS = {"wrapper": {}, "cuda to the launch": {"MACS_KERNELS_CUDA_EMULATION": "1"}}


def _child(source: Path, calls: int, path: str, dumps: Path) -> None:
    """Runs under callgrind: the public calls of `source`'s macs_kernels, one collected reduce per op; prints the
    source's commit, then each op with the number of the dump its reduce wrote (callgrind writes it as the reduce
    returns, into `dumps`)."""
    sys.path.insert(0, str(source))
    from unittest import mock

    import torch

    import macs_kernels

    assert Path(macs_kernels.__file__).resolve().is_relative_to(source), (macs_kernels.__file__, source)
    spec = importlib.util.spec_from_file_location("bench_checks", ROOT / "benchmarks" / "bench_checks.py")
    bench_checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_checks)
    from macs_kernels.apps.bench.common import source_commit
    from macs_kernels.ops import _checks, registry

    print(source_commit(short=True) or "?", flush=True)

    if path == "wrapper":
        backend, kernels = None, bench_checks._stubbed_kernels()
    else:  # the self-check runs the emulated kernels, hundreds of times slower under valgrind: not what is counted
        backend, kernels = "cuda", contextlib.ExitStack()
        kernels.enter_context(mock.patch.object(registry, "self_check", lambda *arguments: None))
        kernels.enter_context(bench_checks._kernels_not_run())
    with mock.patch.object(_checks, "on_host", lambda *tensors: False), kernels:
        for op, call in bench_checks._public_calls(torch.int32, backend).items():
            for _ in range(50):
                call()
            functools.reduce(lambda _, __, call=call: call(), range(calls), None)
            print(op, len(list(dumps.glob("callgrind.out.*"))), flush=True)


def count(source: Path, calls: int, path: str) -> tuple[str, dict[str, float]]:
    """`source`'s commit, and op -> instructions per call of its public op on `path` (PATHS)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={COLLECTED}",
             f"--dump-after={COLLECTED}", f"--callgrind-out-file={out}", sys.executable, __file__, "--child",
             "--source", str(source), "--calls", str(calls), "--path", path, "--dumps", folder],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0", **PATHS[path]})
        commit, *lines = run.stdout.splitlines()
        counts = {}
        # Other reduces (the emulated extension's build, say) write dumps too: each op's is the one its own wrote.
        for line in lines:
            op, number = line.split()
            dump = (out.parent / f"{out.name}.{number}").read_text()
            counts[op] = int(re.search(r"^summary: (\d+)", dump, re.M).group(1)) / calls
        assert counts, run.stderr[-2000:]
    return commit, counts


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(dict.fromkeys(row["path"] for row in rows))
    figure, panels = plt.subplots(1, len(paths), figsize=(7 * len(paths), 4), squeeze=False)
    for axes, shown in zip(panels[0], paths):
        drawn = [row for row in rows if row["path"] == shown]
        ops = list(dict.fromkeys(row["op"] for row in drawn))
        sources = list(dict.fromkeys(row["commit"] for row in drawn))
        width = 0.8 / len(sources)
        for i, commit in enumerate(sources):
            per_op = {row["op"]: row["instructions_per_call"] / 1000 for row in drawn if row["commit"] == commit}
            axes.bar([x + i * width for x in range(len(ops))], [per_op[op] for op in ops], width, label=commit)
        axes.set_xticks([x + width * (len(sources) - 1) / 2 for x in range(len(ops))], ops, fontsize=8)
        axes.set_ylabel("thousand instructions per call (callgrind)")
        axes.set_title(f"{shown} (device index values)")
        axes.legend()
    figure.suptitle("A public op's host work (kernel a no-op, or not run)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, action="append", default=[],
                        help="another checkout to count beside this one (repeatable)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--path", choices=PATHS, action="append", help="default: every one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dumps", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "call_instructions_cpu")
    args = parser.parse_args()
    if args.child:
        _child(args.source[0].resolve(), args.calls, args.path[0], args.dumps)
        return
    rows = []
    for path in args.path or PATHS:
        for source in [ROOT, *(folder.resolve() for folder in args.source)]:
            commit, counts = count(source, args.calls, path)
            for op, instructions in counts.items():
                row = {"path": path, "commit": commit, "op": op, "instructions_per_call": round(instructions)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:
        base = next(r for r in rows if r["op"] == row["op"] and r["path"] == row["path"])
        row["vs_this_checkout"] = round(row["instructions_per_call"] / base["instructions_per_call"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from macs_kernels.apps.bench.common import environment

    args.out.with_suffix(".json").write_text(
        json.dumps({"environment": environment("cpu"), "calls": args.calls, "rows": rows}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
