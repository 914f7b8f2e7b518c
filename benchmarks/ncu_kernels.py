"""Why each decode pass of issue 48 runs at the speed it does, by hardware counters: Nsight Compute (ncu) on one call
of each provider whose kernels bench_ops breaks down (each fused pass, its attention alone, sdpa), at 1 and 8 items
of 32k keys (bf16, 32 query / 8 KV heads, D 128; the mma kernel's bandwidth gap and the Triton fused pass's batch-8
overhead) and at 1 item at D 64 (where the mma kernel's attention read at 0.71x sdpa's rate, its widest gap). Per
kernel: its time, DRAM bytes and throughput, achieved occupancy, issue-slot use, how evenly its grid keeps the SMs
busy, and the warp stall reasons that cost the most.

    python benchmarks/ncu_kernels.py --out OUT      # profile, export, summarise (a GPU and ncu)
    python benchmarks/ncu_kernels.py --summarise OUT/ncu_issue48_raw.csv --out OUT   # again, from the export

Under ncu (`--profile-from-start off`; `--clock-control none`: the clocks as found; `--cache-control none`: the
combine and pooling kernels read what the split kernel left in L2, as they do in a pass), the script reruns itself
with `--run`: for each provider in turn it builds the call, warms it up outside the profiled range, then profiles
one call after a marker kernel (torch.cuda._sleep's spin_kernel), and lists the calls in order
(OUT/ncu_issue48.json). The report (OUT/ncu_issue48.ncu-rep, for ncu-ui) is exported as ncu's raw page
(OUT/ncu_issue48_raw.csv); the summary splits its
kernels at the markers, prints a table and JSON lines ({"ncu": ...}) and writes OUT/ncu_issue48.csv. `.ci/gpu`'s
kernels preset runs it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.bench import write_csv  # noqa: E402

NAME = "ncu_issue48"
MARKER = "spin_kernel"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats")
EXTRA_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "smsp__inst_executed.sum", "sm__cycles_active.avg",
                 "sm__cycles_active.max")
SHAPES = ((1, 32, 8, 128, 32768), (8, 32, 8, 128, 32768), (1, 32, 8, 64, 32768))  # B, H, H_kv, D, S
# ncu's raw metric names: what the table shows, by column.
METRICS = {
    "us": "gpu__time_duration.sum",
    "dram_read_MB": "dram__bytes_read.sum",
    "dram_write_MB": "dram__bytes_write.sum",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "instructions": "smsp__inst_executed.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
}
# How evenly the grid spreads over the SMs: their mean active cycles over the busiest one's (1: every SM works as long
# as the busiest). Issue 48's Triton grid at 8 x 32k keys was 320 programs on 132 SMs, 2 or 3 each: 0.70 (H200).
SM_CYCLES = ("sm__cycles_active.avg", "sm__cycles_active.max")
# Warps stalled for each reason per issue cycle, i.e. its share of the warp cycles per issued instruction ("selected"
# is the issuing itself).
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
# Units as ncu names them: spelled out, or (--print-units base on the H200's ncu) abbreviated.
SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def run(manifest: Path, device: str = "cuda", shapes=SHAPES) -> None:
    """One profiled call per (shape, provider), each after a marker kernel; the order goes to `manifest`."""
    import torch
    from bench_ops import BROKEN_DOWN, Problem, available_providers

    device = torch.device(device)
    providers = available_providers(device, BROKEN_DOWN)
    calls = []
    for batch, heads, kv_heads, dim, keys in shapes:
        problem = Problem(batch, heads, kv_heads, dim, keys, torch.bfloat16, device)
        for provider in providers:
            fn = provider.build("decode_attention", problem)
            fn()  # compiled and warmed up outside the profiled range
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda._sleep(1)
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            calls.append({"provider": provider.name, "B": batch, "H": heads, "H_kv": kv_heads, "D": dim, "S": keys})
        del problem
        torch.cuda.empty_cache()
    manifest.write_text(json.dumps(calls, indent=1))
    print(f"profiled {len(calls)} calls; wrote {manifest}")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_raw(path: Path) -> list[dict]:
    """ncu's raw page (--csv --page raw): one dict per kernel, metric name -> value, times in us and bytes in MB."""
    lines = path.read_text().splitlines()
    start = next((n for n, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        raise SystemExit(f"{path} holds no ncu raw page (no \"Kernel Name\" header): see ncu's messages above")
    reader = list(csv.reader(lines[start:]))
    header, rows = reader[0], reader[1:]
    units = {}
    if rows and rows[0][header.index("Kernel Name")] == "":  # the units row
        units, rows = dict(zip(header, rows[0])), rows[1:]
    kernels = []
    for row in rows:
        values = dict(zip(header, row))
        kernel = {"kernel": values["Kernel Name"]}
        for name, text in values.items():
            number = _number(text)
            kernel[name] = number * SCALE.get(units.get(name, ""), 1.0) if number is not None else text
        kernels.append(kernel)
    return kernels


def summarise(raw: Path, manifest: Path, out: Path) -> list[dict]:
    calls = json.loads(manifest.read_text())
    kernels = read_raw(raw)
    groups, current = [], None
    for kernel in kernels:
        if MARKER in kernel["kernel"]:
            current = []
            groups.append(current)
        elif current is not None:
            current.append(kernel)
    if len(groups) != len(calls):
        raise SystemExit(f"{raw}: {len(groups)} marked calls, but the manifest lists {len(calls)}")
    rows = []
    for call, group in zip(calls, groups):
        for kernel in group:
            stalls = sorted(((match.group(1), value) for name, value in kernel.items()
                             if (match := STALL.match(name)) and isinstance(value, float)
                             and match.group(1) != "selected"), key=lambda stall: -stall[1])
            row = {**call, "kernel": kernel["kernel"][:60]}
            row.update({column: round(kernel[metric], 2) if isinstance(kernel.get(metric), float) else None
                        for column, metric in METRICS.items()})
            mean, busiest = (kernel.get(metric) for metric in SM_CYCLES)
            row["sm_balance"] = round(mean / busiest, 3) if isinstance(mean, float) and busiest else None
            row["top_stalls"] = " ".join(f"{reason}={value:.1f}" for reason, value in stalls[:4])
            rows.append(row)
            print(json.dumps({"ncu": row}), flush=True)
    print(f"{'B':>2} {'provider':30s} {'kernel':42s} {'us':>8} {'DRAM%':>6} {'occ%':>5} {'issue%':>6} {'SMbal':>5}  "
          "top stalls (warp cycles per issued instruction)")
    for row in rows:
        print(f"{row['B']:>2} {row['provider']:30s} {row['kernel'][:42]:42s} {row['us'] or 0:8.1f} "
              f"{row['dram_pct'] or 0:6.1f} {row['occupancy_pct'] or 0:5.1f} {row['issue_pct'] or 0:6.1f} "
              f"{row['sm_balance'] or 0:5.2f}  {row['top_stalls']}")
    write_csv(rows, out / f"{NAME}.csv")
    print(f"wrote {out / NAME}.csv")
    return rows


def profile(out: Path, python: str = sys.executable) -> Path:
    """Run `--run` under ncu into OUT/ncu_issue48.ncu-rep and export its raw page; returns the CSV's path."""
    ncu = shutil.which("ncu") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ncu")
    if not Path(ncu).exists():
        raise SystemExit("ncu (Nsight Compute) is neither on PATH nor in $CUDA_HOME/bin")
    report, raw = out / f"{NAME}.ncu-rep", out / f"{NAME}_raw.csv"
    subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
                    *(option for section in SECTIONS for option in ("--section", section)),
                    "--metrics", ",".join(EXTRA_METRICS), "-o", str(report.with_suffix("")), "-f",
                    python, __file__, "--run", "--out", str(out)], check=True)
    with raw.open("w") as handle:
        subprocess.run([ncu, "--import", str(report), "--page", "raw", "--csv", "--print-units", "base"],
                       stdout=handle, check=True)
    return raw


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--run", action="store_true", help="make the profiled calls (what ncu runs)")
    parser.add_argument("--summarise", type=Path, default=None, help="summarise this raw export of a profile")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = args.out / f"{NAME}.json"
    if args.run:
        run(manifest)
        return
    summarise(args.summarise or profile(args.out), manifest, args.out)


if __name__ == "__main__":
    main()
