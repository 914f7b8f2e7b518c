"""What a kernel compiles to, read on a machine without a GPU (issue 48: where the bytes do not explain the fused
pass's time over attention's, its key loop's instructions may; a GPU's timing decides).

- `compile_triton`: one of our Triton kernels compiled for sm_80 / sm_90 by `triton.compile` with a `GPUTarget`, with
  the argument types its launcher's JIT gives it on a GPU, or those inductor gives a user-defined kernel inside
  torch.compile. The kernels must be real JITFunctions: import them with TRITON_INTERPRET unset or 0.
- `compile_cuda`: one piece of csrc/ (its torch-free kernel.cu) compiled by nvcc to a cubin, with the flags torch's
  extension build passes (a source checkout: the wheel ships no csrc/).
- `cuobjdump`, `sass_by_function`, `resources`: any cubin's SASS and per-function registers, stack and shared memory, by
  the CUDA toolkit's cuobjdump or the copy Triton's wheel ships.
- `loops`, `key_loop`, `opcode`, `wide_compares`, `divisions`: the loops of a function's SASS and their instructions.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parents[3] / "csrc"
# What torch.utils.cpp_extension passes to nvcc: the kernels must not rely on implicit half conversions.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
]
# The kernels' element types as C++ names them, and as they appear mangled in template arguments.
MANGLED_DTYPES = {"float": "f", "half": "6__half", "bfloat16": "13__nv_bfloat16"}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
# A branch and its target: `BRA 0x2c50`, `@!P5 BRA 0x4820`, `@P0 BRA.U !UP0, 0x1230`.
_BRANCH_TARGET = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")
_RESOURCES = re.compile(r"Function (\w+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# The split kernels' index tensors: int64 ranges (int32 ones compile their own kernel), an int32 block table.
SPLIT_INDEX = {"start_ptr": "i64", "input_end_ptr": "i64", "kv_len_ptr": "i64", "block_table_ptr": "i32",
               "score_start_ptr": "i64"}
# Scalar arguments the launchers pass as Python floats: inductor types them fp64 on devices that have fp64.
_FLOAT_ARGUMENTS = frozenset({"scale", "alpha", "softcap"})
# Integers every launch passes as multiples of 16 besides the strides (a slice is whole key blocks; a row of the split
# pass's scores is score_columns wide), which Triton's specialisation marks so.
_MULTIPLES_OF_16 = frozenset({"split_size", "n_columns"})
# griddepcontrol (programmatic dependent launch) in sm_90's SASS: .wait is ACQBULK, .launch_dependents PREEXIT.
GRID_WAIT, GRID_RELEASE = "ACQBULK", "PREEXIT"


def compile_triton(module: str, kernel_name: str, pointers: dict, constexprs: dict, options: dict, arch: int,
                   floats: str = "fp32"):
    """`macs_kernels.ops.triton.<module>.<kernel_name>` compiled for sm_<arch>: pointer arguments typed by `pointers`
    (argument name -> element type, "fp32" when absent), pointers, strides and _MULTIPLES_OF_16 divisible by 16 (a
    contiguous cache with D = 64 or 128), other integers i32, float scalars `floats` ("fp64" is inductor's signature).
    Returns Triton's CompiledKernel (asm["ptx"], asm["cubin"], metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(f"macs_kernels.ops.triton.{module}"), kernel_name)
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in _FLOAT_ARGUMENTS:
            signature[name] = floats
        else:
            signature[name] = "i32"
            if name.startswith("stride_") or name in _MULTIPLES_OF_16:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def split_kv_variant(dtype, *, D, GROUP, rows, WITH_V=False, WITH_SCORES=True, DOT_F32=False, PAGE_SIZE=0,
                     SOFTCAP=False, WINDOWED=False, PDL=False, D_V=None):
    """`compile_triton`'s arguments for a `_split_kv_kernel` variant (ops/triton/split_kv.py): q, k and v in `dtype`
    (V's head dimension D_V, D unless given),
    `rows` query rows per KV head (the group's heads times the query rows), one tile over the head dimension, the
    launcher's tiles and options (split_kv_block)."""
    from macs_kernels.ops.triton.common import split_kv_block

    block_m, block_n, num_warps = split_kv_block(rows, D, DOT_F32)
    return (
        "split_kv", "_split_kv_kernel",
        {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, **SPLIT_INDEX},
        dict(D=D, BLOCK_D=D, D_V=D_V or D, BLOCK_DV=D_V or D, GROUP=GROUP, BLOCK_M=block_m, BLOCK_N=block_n,
             WITH_V=WITH_V, WITH_SCORES=WITH_SCORES, DOT_F32=DOT_F32, PAGE_SIZE=PAGE_SIZE, SOFTCAP=SOFTCAP,
             WINDOWED=WINDOWED, PDL=PDL),
        dict(num_warps=num_warps, num_stages=3),
    )


# attention_features' index tensors: int64 ranges.
FEATURES_INDEX = dict.fromkeys(("source_start_ptr", "source_end_ptr", "start_ptr", "kv_len_ptr", "n_rows_ptr"), "i64")


def features_variant(kernel_name, dtype, *, D, rows, SOFTCAP=False, HAS_SINKS=False):
    """An attention_features kernel (`_features_kernel`, or `_features_lse_kernel` with HAS_SINKS) for `rows` target
    rows in `dtype` ("fp32": products on CUDA cores), with the launcher's tiles (features_block) and options."""
    from macs_kernels.ops.triton.common import features_block

    exact_f32 = dtype == "fp32"
    block_r, block_n = features_block(rows, exact_f32)
    pointers = dict(FEATURES_INDEX, q_ptr=dtype, k_ptr=dtype, **({"sinks_ptr": dtype} if HAS_SINKS else {}))
    constexprs = dict(D=D, BLOCK_D=D, BLOCK_R=block_r, BLOCK_N=block_n, DOT_F32=exact_f32, SOFTCAP=SOFTCAP)
    if kernel_name == "_features_lse_kernel":
        constexprs["HAS_SINKS"] = HAS_SINKS
    return "attention_features", kernel_name, pointers, constexprs, dict(num_warps=4)


def nvcc() -> str | None:
    """nvcc on PATH or in $CUDA_HOME/bin; None when neither has it."""
    found = shutil.which("nvcc")
    if found is None and os.environ.get("CUDA_HOME"):
        candidate = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


def compile_cuda(piece: str, arch: int, cubin: Path) -> Path:
    """csrc/<piece>/kernel.cu compiled for sm_<arch> into `cubin` (every instantiation it holds)."""
    done = subprocess.run([nvcc(), "-std=c++17", "-O3", "-cubin", f"-arch=sm_{arch}", "-I", str(CSRC),
                           *TORCH_NVCC_FLAGS, "-o", str(cubin), str(CSRC / piece / "kernel.cu")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return cubin


def cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, or the copy Triton's wheel ships; None when neither is here."""
    found = shutil.which("cuobjdump")
    if found is None:
        spec = importlib.util.find_spec("triton")
        if spec is not None and spec.origin is not None:
            candidate = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            found = str(candidate) if candidate.exists() else None
    return found


def _dump(cubin: Path, *options: str) -> str:
    done = subprocess.run([cuobjdump(), *options, str(cubin)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def sass_by_function(cubin: Path) -> dict[str, str]:
    """Kernel name -> its SASS."""
    sections = re.split(r"\n\s*Function : (\w+)\n", _dump(cubin, "-sass"))
    return dict(zip(sections[1::2], sections[2::2]))


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one thread of a function holds (registers, stack and local memory in bytes) and its block's static shared
    memory in bytes (Triton's kernels take theirs dynamically: CompiledKernel.metadata.shared)."""
    registers: int
    stack: int
    shared: int
    local: int


def resources(cubin: Path) -> dict[str, Resources]:
    """Kernel name -> its Resources, as cuobjdump --dump-resource-usage reads them."""
    return {name: Resources(*(int(value) for value in values))
            for name, *values in _RESOURCES.findall(_dump(cubin, "--dump-resource-usage"))}


# Shared memory one block may take (bytes) by the architecture the code was compiled for: sm_90's 227 KiB; sm_80's code
# must also run on sm_86, sm_89 and sm_120 (99 KiB a block: consumer GPUs, L4, L40S), whose Triton code took exactly
# sm_80's shared memory at every tile tried.
SHARED_PER_BLOCK = {80: 99 * 1024, 90: 227 * 1024}
# Shared memory an SM holds (bytes) by architecture, of which each resident block also takes 1 KiB for the system.
_SHARED_PER_MULTIPROCESSOR = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}


def blocks_per_multiprocessor(arch: int, registers: int, threads: int, shared: int = 0) -> int:
    """Blocks of `threads` threads an SM of sm_<arch> holds at once: 64K registers allocated per warp in units of 256
    (8 a thread), at most 2048 threads, and (shared > 0) its shared memory at `shared` bytes a block."""
    blocks = min(65536 // (threads * -(-registers // 8) * 8), 2048 // threads)
    if shared:
        blocks = min(blocks, _SHARED_PER_MULTIPROCESSOR[arch] // (shared + 1024))
    return blocks


def instructions(sass: str) -> list[str]:
    """One function's SASS instructions in order (cuobjdump's text, guard predicates kept)."""
    return [text.strip() for _, text in _INSTRUCTION.findall(sass)]


def loops(sass: str) -> list[list[str]]:
    """The instructions of each loop of one function's SASS (cuobjdump's, with absolute branch targets): from the
    target of a backward branch to the branch. Loops nest; a backward branch whose range starts inside another loop
    and ends after it is code placed after that loop jumping back into it (a divergent path's return), not a loop."""
    instructions = [(int(address, 16), text.strip()) for address, text in _INSTRUCTION.findall(sass)]
    ranges = []
    for address, text in instructions:
        target = _BRANCH_TARGET.search(text)
        if target is not None and int(target.group(1), 16) < address:
            ranges.append((int(target.group(1), 16), address))
    nested = [(start, end) for start, end in ranges
              if not any(outer_start < start <= outer_end < end for outer_start, outer_end in ranges)]
    return [[body for at, body in instructions if start <= at <= end] for start, end in nested]


def key_loop(sass: str) -> list[str]:
    """A split kernel's loop over key tiles: the longest loop that issues asynchronous copies (LDGSTS), those of the
    next tile (a loop nested in it, the copies themselves, is shorter)."""
    return max((body for body in loops(sass) if any(opcode(instruction).startswith("LDGSTS") for instruction in body)),
               key=len)


def wide_compares(instructions: list[str]) -> int:
    """64-bit integer compares: each is a pair of ISETPs, the second extended (.EX); this counts the pairs."""
    return sum(opcode(instruction).startswith("ISETP") and opcode(instruction).endswith(".EX")
               for instruction in instructions)


def divisions(instructions: list[str]) -> int:
    """Signed 32-bit divisions by a runtime value: each takes the absolute values of its operands (IABS) first."""
    return sum(opcode(instruction) == "IABS" for instruction in instructions)


_REGISTER = re.compile(r"\bR(\d+)\b")


def loads_in_flight(instructions: list[str]) -> int:
    """How many global loads (LDG) a straight run of `instructions` issues before one instruction reads a register one
    of them loads: the loads a thread has in flight at once when a loop of these is bound by memory latency."""
    loaded: set[int] = set()
    issued = 0
    for instruction in instructions:
        operation = opcode(instruction)
        operands = [part.strip() for part in _unguarded(instruction).split(None, 1)[-1].split(",")]
        # The first operand is written, except by a store (ST*), whose operands are all read.
        read = operands if operation.startswith("ST") else operands[1:]
        if any(int(register) in loaded for operand in read for register in _REGISTER.findall(operand)):
            break
        if operation.startswith("LDG"):
            first = int(_REGISTER.search(operands[0]).group(1))
            width = 4 if operation.endswith(".128") else 2 if operation.endswith(".64") else 1
            loaded.update(range(first, first + width))
            issued += 1
    return issued


def _unguarded(instruction: str) -> str:
    """The instruction without its predicate guard (`@!P0 `, `@UP1 `)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction)


def opcode(instruction: str) -> str:
    """The opcode with its modifiers, without a predicate guard: `@!P0 ISETP.GE.AND.EX P1, ...` -> ISETP.GE.AND.EX."""
    return _unguarded(instruction).split()[0]
