"""What the Triton split kernel compiles to under each fused pass, read on a CPU: CSV, JSON, PNG, no asserts.

    python benchmarks/bench_triton_sass.py                   # sm_80 and sm_90, D 64 and 128 (about a minute)
    PYTHONPATH=/folder/with/another/triton python benchmarks/bench_triton_sass.py   # that Triton's code

Issue 48's decode step (bf16, 32 query heads on 8 KV heads: a GQA group of 4 in one 16-row tile, V read), compiled by
`triton.compile` for each architecture as attention alone and under each fused MACS pass (ops/triton/settings.py).
Per kernel: registers, shared memory, the blocks an SM holds by each, and its key loop's SASS (the loop of tensor-core
products): instructions, 64-bit integer compares, barriers, global stores. The bytes do not explain the fused pass's
time: on an H200 the verified pass took 1.17-1.31x attention's time where its bytes account for 1.06-1.13x. Its key loop
then issued 1.24-1.34x attention's instructions per key block (Triton 3.6), and a decode step's loop, two blocks per
SM at 4 warps each, has little else to overlap them with.

Writes benchmarks/results/triton_sass_<triton version>.{csv,json,png} (or --out, --name): one row per (architecture,
D, pass), its loop's instructions also over attention's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions: triton.compile takes no interpreted ones

import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.bench import environment, write_csv  # noqa: E402
from macs_kernels.apps.bench.sass import (  # noqa: E402
    blocks_per_multiprocessor,
    compile_triton,
    one_launch_variant,
    opcode,
    resources,
    sass_by_function,
    split_kv_variant,
    tensor_core_loop,
    wide_compares,
)

ARCHES = (80, 90)
DIMS = (64, 128)


def variants(dim: int) -> dict:
    """Pass name -> compile_triton's arguments for the decode step's split kernel."""
    shape = dict(D=dim, GROUP=4, BLOCK_M=16, WITH_V=True)
    return {
        "attention": split_kv_variant("bf16", WITH_SCORES=False, **shape),
        "verified": split_kv_variant("bf16", **shape),
        "two-launch": split_kv_variant("bf16", scores="fp16", **shape),
        "one-launch": one_launch_variant("bf16", scores="fp16", **shape),
    }


def measure(folder: Path) -> list[dict]:
    rows = []
    for arch in ARCHES:
        for dim in DIMS:
            for split_pass, variant in variants(dim).items():
                compiled = compile_triton(*variant, arch)
                cubin = folder / f"{split_pass}_d{dim}_sm{arch}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                (used,) = resources(cubin).values()
                (sass,) = sass_by_function(cubin).values()
                loop = tensor_core_loop(sass)
                threads = 32 * variant[4]["num_warps"]
                shared = compiled.metadata.shared
                rows.append({
                    "arch": f"sm_{arch}", "D": dim, "split_pass": split_pass, "kernel": variant[1],
                    "registers": used.registers, "local_bytes": used.local, "shared_bytes": shared,
                    "blocks_per_sm": blocks_per_multiprocessor(arch, used.registers, threads, shared),
                    "blocks_per_sm_by_registers": blocks_per_multiprocessor(arch, used.registers, threads, 0),
                    "loop_instructions": len(loop), "loop_wide_compares": wide_compares(loop),
                    "loop_barriers": sum(opcode(instruction).startswith("BAR") for instruction in loop),
                    "loop_global_stores": sum(opcode(instruction).startswith("STG") for instruction in loop),
                })
                attention = next(row for row in rows if row["arch"] == f"sm_{arch}" and row["D"] == dim
                                 and row["split_pass"] == "attention")
                rows[-1]["loop_over_attention"] = round(len(loop) / attention["loop_instructions"], 3)
                print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\nTriton {triton.__version__}: the key loop's instructions (over attention's), 64-bit compares, registers, "
          "blocks per SM")
    for row in rows:
        print(f"{row['arch']} D {row['D']:>3}  {row['split_pass']:<10} {row['loop_instructions']:>4} "
              f"({row['loop_over_attention']:.3f})  {row['loop_wide_compares']:>2}  {row['registers']:>3}  "
              f"{row['blocks_per_sm']}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((row["arch"], row["D"]) for row in rows))
    fused = [name for name in dict.fromkeys(row["split_pass"] for row in rows) if name != "attention"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.6 * len(groups), 3.4))
    width = 0.8 / len(fused)
    for i, split_pass in enumerate(fused):
        heights = [next(row["loop_over_attention"] for row in rows if (row["arch"], row["D"]) == group
                        and row["split_pass"] == split_pass) for group in groups]
        ax.bar([j + (i - (len(fused) - 1) / 2) * width for j in range(len(groups))], heights, width, label=split_pass)
    ax.axhline(1.10, color="red", linestyle="--", linewidth=1, label="issue 48's goal (time)")
    ax.set_xticks(range(len(groups)), [f"{arch}, D {dim}" for arch, dim in groups], fontsize=8)
    ax.set_ylim(1.0, max(1.5, max(row["loop_over_attention"] for row in rows) + 0.05))
    ax.set_ylabel("key-loop instructions / attention's", fontsize=8)
    ax.set_title(f"Triton {triton.__version__} split kernel, fused decode (bf16, GQA 4:1), SASS", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default=f"triton_sass_{triton.__version__}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(Path(folder))
    env = environment("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name  # a version's dots are no suffix: the file names are built whole
    write_csv([row | env for row in rows], Path(f"{stem}.csv"))
    Path(f"{stem}.json").write_text("".join(json.dumps(row | env) + "\n" for row in rows))
    plot(rows, Path(f"{stem}.png"))
    print_table(rows)
    print(f"wrote {stem}.csv, .json, .png")


if __name__ == "__main__":
    main()
