"""What the split kernels compile to, read on a CPU: CSV, JSON, PNG, no asserts.

    python benchmarks/bench_sass.py                   # Triton: sm_80 and sm_90, D 64 and 128 (about a minute)
    PYTHONPATH=/folder/with/another/triton python benchmarks/bench_sass.py   # that Triton's code
    python benchmarks/bench_sass.py --backend cuda    # csrc's split kernels by nvcc (about a minute)

Issue 48's decode step (bf16, 32 query heads on 8 KV heads: a GQA group of 4 in one 16-row tile, V read). Triton: its
split kernel compiled by `triton.compile` for each architecture as attention alone and with the fused MACS pass's
scores. cuda: the `mma` and `pipelined` split kernels (csrc/split_kv_mma, csrc/split_kv_pipelined)
by nvcc, every instantiation; attention alone and the fused pass run one instantiation there (the scores are a
pointer). Per kernel: registers, the blocks an SM holds, and its key loop's SASS (the loop over key tiles, which
issues the next tile's asynchronous copies): instructions, 64-bit integer compares, signed 32-bit divisions (IABS),
barriers, global stores, asynchronous copies, exponentials and their subnormal fix-ups (a compare with -126 each).
These are static counts: a branch's both sides count (the cuda kernels' copies of a contiguous and of a paged cache).

Why: the bytes do not explain the fused pass's time. On an H200 the Triton fused pass took 1.17-1.31x attention's
time where its bytes account for 1.06-1.13x; its key loop then issued 1.24-1.34x attention's instructions per key
block (Triton 3.6), and a decode step's loop, two blocks of four warps per SM, has little to overlap them with.

Writes benchmarks/results/<backend>_sass_<compiler version>.{csv,json,png} (or --out, --name): one row per
(architecture, kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions: triton.compile takes no interpreted ones

import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.bench import environment, write_csv  # noqa: E402
from macs_kernels.apps.bench.sass import (  # noqa: E402
    MANGLED_DTYPES,
    blocks_per_multiprocessor,
    compile_cuda,
    compile_triton,
    divisions,
    key_loop,
    nvcc,
    opcode,
    resources,
    sass_by_function,
    split_kv_variant,
    wide_compares,
)

ARCHES = (80, 90)
DIMS = (64, 128)
CUDA_PIECES = ("split_kv_mma", "split_kv_pipelined")
SHORT_DTYPES = {"float": "fp32", "half": "fp16", "bfloat16": "bf16"}


def variants(dim: int) -> dict:
    """Pass name -> compile_triton's arguments for the decode step's split kernel."""
    shape = dict(D=dim, GROUP=4, rows=16, WITH_V=True)
    return {
        "attention": split_kv_variant("bf16", WITH_SCORES=False, **shape),
        "fused": split_kv_variant("bf16", **shape),
    }


def loop_figures(loop: list[str]) -> dict:
    return {
        "loop_instructions": len(loop), "loop_wide_compares": wide_compares(loop),
        "loop_divisions": divisions(loop),
        "loop_barriers": sum(opcode(instruction).startswith("BAR") for instruction in loop),
        "loop_global_stores": sum(opcode(instruction).startswith("STG") for instruction in loop),
        "loop_copies": sum(opcode(instruction).startswith("LDGSTS") and not instruction.startswith("@!PT")
                           for instruction in loop),
        "loop_exponentials": sum(opcode(instruction) == "MUFU.EX2" for instruction in loop),
        "loop_subnormal_fixups": sum("-126" in instruction for instruction in loop),
    }


def measure_triton(folder: Path) -> list[dict]:
    rows = []
    for arch in ARCHES:
        for dim in DIMS:
            for split_pass, variant in variants(dim).items():
                compiled = compile_triton(*variant, arch)
                cubin = folder / f"{split_pass}_d{dim}_sm{arch}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                (used,) = resources(cubin).values()
                (sass,) = sass_by_function(cubin).values()
                loop = key_loop(sass)
                threads = 32 * variant[4]["num_warps"]
                shared = compiled.metadata.shared
                rows.append({
                    "arch": f"sm_{arch}", "kernel": variant[1], "D": dim, "split_pass": split_pass,
                    "registers": used.registers, "local_bytes": used.local, "shared_bytes": shared,
                    "blocks_per_sm": blocks_per_multiprocessor(arch, used.registers, threads, shared),
                    **loop_figures(loop),
                })
                attention = next(row for row in rows if row["arch"] == f"sm_{arch}" and row["D"] == dim
                                 and row["split_pass"] == "attention")
                rows[-1]["loop_over_attention"] = round(len(loop) / attention["loop_instructions"], 3)
                print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_cuda(folder: Path) -> list[dict]:
    rows = []
    for arch in ARCHES:
        for piece in CUDA_PIECES:
            cubin = compile_cuda(piece, arch, folder / f"{piece}_sm{arch}.cubin")
            used = resources(cubin)
            for name, sass in sass_by_function(cubin).items():
                kernel = re.match(r"_ZN4macs\d+(\w+?_split_kernel)I", name).group(1)
                dtype = next(SHORT_DTYPES[dtype] for dtype, mangled in MANGLED_DTYPES.items() if f"I{mangled}" in name)
                dim = re.search(r"Li(\d+)E", name)
                loop = key_loop(sass)
                rows.append({
                    "arch": f"sm_{arch}", "kernel": kernel, "dtype": dtype, "D": int(dim.group(1)) if dim else "",
                    "with_v": "Lb1E" in name, "registers": used[name].registers, "local_bytes": used[name].local,
                    **loop_figures(loop),
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict], compiler: str) -> None:
    print(f"\n{compiler}: key-loop instructions (over attention's), 64-bit compares, divisions, registers")
    for row in rows:
        name = row.get("split_pass") or f"{row['kernel']} {row['dtype']}{' V' if row['with_v'] else ''}"
        ratio = f" ({row['loop_over_attention']:.3f})" if "loop_over_attention" in row else ""
        print(f"{row['arch']} D {row['D']:>3}  {name:<32} {row['loop_instructions']:>4}{ratio}  "
              f"{row['loop_wide_compares']:>2}  {row['loop_divisions']:>2}  {row['registers']:>3}")


def plot(rows: list[dict], compiler: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.4))
    if "split_pass" in rows[0]:  # Triton: each fused pass's loop over attention's
        groups = list(dict.fromkeys((row["arch"], row["D"]) for row in rows))
        bars = [name for name in dict.fromkeys(row["split_pass"] for row in rows) if name != "attention"]
        value = {(row["arch"], row["D"], row["split_pass"]): row["loop_over_attention"] for row in rows}
        ax.axhline(1.10, color="red", linestyle="--", linewidth=1, label="issue 48's goal (time)")
        ax.set_ylim(1.0, max(1.5, max(value.values()) + 0.05))
        ax.set_ylabel("key-loop instructions / attention's", fontsize=8)
    else:  # cuda: each kernel's loop, by instantiation
        groups = list(dict.fromkeys((row["arch"], row["D"]) for row in rows if row["with_v"]))
        bars = list(dict.fromkeys(f"{row['kernel']} {row['dtype']}" for row in rows if row["with_v"]))
        value = {(row["arch"], row["D"], f"{row['kernel']} {row['dtype']}"): row["loop_instructions"]
                 for row in rows if row["with_v"]}
        ax.set_ylabel("key-loop instructions (with V)", fontsize=8)
    width = 0.8 / len(bars)
    for i, bar in enumerate(bars):
        at = [j for j, group in enumerate(groups) if (*group, bar) in value]
        ax.bar([j + (i - (len(bars) - 1) / 2) * width for j in at], [value[(*groups[j], bar)] for j in at], width,
               label=bar)
    ax.set_xticks(range(len(groups)), [f"{arch}, D {dim}" if dim != "" else arch for arch, dim in groups], fontsize=8)
    ax.set_title(f"{compiler}: split kernels' key loops, decode (bf16, GQA 4:1), SASS", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("triton", "cuda"), default="triton")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", help="file stem (default <backend>_sass_<compiler version>)")
    args = parser.parse_args(argv)
    if args.backend == "cuda":
        if nvcc() is None:
            parser.error("--backend cuda needs nvcc (PATH or $CUDA_HOME/bin)")
        version = re.search(r"release ([\d.]+)", subprocess.run([nvcc(), "--version"], capture_output=True,
                                                                 text=True).stdout).group(1)
        compiler, measure = f"nvcc {version}", measure_cuda
    else:
        version, compiler, measure = triton.__version__, f"Triton {triton.__version__}", measure_triton
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(Path(folder))
    env = environment("cpu") | {"compiler": compiler}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"{args.backend}_sass_{version}")  # a version's dots are no suffix
    write_csv([row | env for row in rows], Path(f"{stem}.csv"))
    Path(f"{stem}.json").write_text("".join(json.dumps(row | env) + "\n" for row in rows))
    plot(rows, compiler, Path(f"{stem}.png"))
    print_table(rows, compiler)
    print(f"wrote {stem}.csv, .json, .png")


if __name__ == "__main__":
    main()
