"""What the Triton kernels and their launchers share: constants, the dot-precision helper, the launch counter
and the tile policy (block sizes and key splits decided here, not in each launcher, as Liger's
`calculate_settings`).

Conventions every kernel follows:
- masked scores are -inf; running maxima start at MIN_SCORE, a finite value, so that a tile in which a row
  attends no key rescales by exp(MIN_SCORE - MIN_SCORE) = 1 and adds exp(-inf) = 0, never NaN;
- base-2 exponentials scale their arguments by LOG2E;
- operands are cast to float32 right after loading unless both are half precision of one dtype (then the
  tensor cores multiply them); float32 products are exact ("ieee"), as the float64 references expect, not
  TF32. The interpreter always takes the float32 path: its bf16 dot and arithmetic are wrong.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel
from triton.language.extra import libdevice
from triton.runtime.driver import driver

from macs_kernels.ops.backends import triton_interpreted

try:
    from triton import knobs
except ImportError:  # Triton < 3.4
    knobs = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.4: no grid dependency control
    gdc_launch_dependents = gdc_wait = None

LOG2E = tl.constexpr(1.4426950408889634)
MIN_SCORE = tl.constexpr(-1.0e30)

# Whether the kernels below run in the interpreter: triton.jit decided it when this module was imported, and reading
# the environment on every launch cost microseconds of host time per op. backends.triton_interpreted() still reads
# the environment (it answers before triton is imported); both agree unless TRITON_INTERPRET changes afterwards.
INTERPRETED = triton_interpreted()
# Whether `launch` may call a compiled kernel's launcher itself: Triton >= 3.4 outside the interpreter, whose
# JITFunction and CompiledKernel internals it uses (the same since 3.4: the binder last in `device_caches`, the
# launcher's arguments, the knobs' launch hooks).
DIRECT_LAUNCHES = knobs is not None and not INTERPRETED

# Whether the split pass's combine and head pooling launch as programmatic dependents of the kernel before them
# (MACS_KERNELS_TRITON_PDL=1, read at import; `dependent_launches`, process-wide, for a block of code), on NVIDIA GPUs
# of sm_90 and later: a dependent's programs start while its predecessor's last ones run, read what does not come from
# it (ranges, log c), then wait for it (griddepcontrol.wait: its writes visible), instead of starting after it ends.
# FlashInfer's decode kernels launch the same way (their enable_pdl). Off by default: no GPU has timed it or checked
# it exact yet (the `kernels` preset of .ci/gpu does both; docs/backends.md, "Dependent launches").
PDL_LAUNCHES = os.environ.get("MACS_KERNELS_TRITON_PDL", "0") not in ("", "0")

# Kernel name -> launches since import: lets an integration test prove that Triton really ran.
LAUNCHES: collections.Counter = collections.Counter()

if INTERPRETED:  # the interpreter runs no libdevice call

    @triton.jit
    def fast_exp(x):
        """e^x."""
        return tl.exp(x)
else:

    @triton.jit
    def fast_exp(x):
        """e^x on the SFU alone: ex2.approx.ftz of x log2(e), as FlashAttention's softmax takes it. tl.exp lowers to
        ex2.approx.f32, around which ptxas adds a fix-up for results below 2^-126 (a compare and two predicated
        multiplies a call: 10 calls a key tile in the split kernel's loop); those flush to 0 here. For a term of a sum
        that holds a term 1 (x less the max it is summed with), where a term below 2^-126 of it is no part of a float32
        result; not for a probability that is an output (head pooling keeps tl.exp). The split kernel's generated
        keys' sum shares those weights: split_kv_pass says what that costs lse_gen."""
        return libdevice.exp2(x * LOG2E)


@triton.jit
def operand(x, DOT_F32: tl.constexpr):
    """A loaded dot operand in the precision the product runs in."""
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    """a @ b: exact float32 products for float32 operands, tensor cores for half precision."""
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def clamped(value, low, high):
    """value as int64, clamped into [low, high]."""
    return tl.minimum(tl.maximum(value.to(tl.int64), low), high)


@triton.jit
def key_range(start, input_end, kv_len, keys):
    """A row's keys [start, kv_len) and inputs [start, input_end) as int64, clamped into the cache's `keys` keys as
    the cuda kernels clamp them (csrc/common.cuh, KeyRange): checked ranges pass unchanged, and a range that no check
    read (validate=False, a GPU's default) gives wrong numbers, never an access outside the tensors."""
    kv_len = clamped(kv_len, 0, keys)
    start = clamped(start, 0, kv_len)
    return start, clamped(input_end, start, kv_len), kv_len


@triton.jit
def input_columns(start_ptr, input_end_ptr, kv_len_ptr, column_start_ptr, b, r, keys, stride_ib, stride_ir,
                  stride_eb, stride_er, stride_lb, stride_lr, stride_cb, stride_cr, WINDOWED: tl.constexpr):
    """Row (b, r)'s input columns, each range read with its own strides: (the key its column 0 holds, how many) for
    the attended keys [start, kv_len) and inputs [start, input_end), or with WINDOWED [column_start, input_end) (a
    window's inputs start at or before its attended start, maybe before slot 0). Clamped as key_range and as the
    cuda pool (csrc/pool/kernel.cuh): the columns the split pass wrote."""
    input_end = tl.load(input_end_ptr + b * stride_eb + r * stride_er)
    start, _, kv_len = key_range(tl.load(start_ptr + b * stride_ib + r * stride_ir), input_end,
                                 tl.load(kv_len_ptr + b * stride_lb + r * stride_lr), keys)
    column0 = start
    if WINDOWED:
        column0 = tl.minimum(tl.load(column_start_ptr + b * stride_cb + r * stride_cr).to(tl.int64), start)
    return column0, clamped(input_end, column0, kv_len) - column0


@triton.jit
def score_base(score_start):
    """The key in column 0 of a row of the split pass's scores: the row's score start rounded down to a multiple of 16
    (a window's may be negative), so that its key blocks' columns start 64-byte aligned; input i is in column
    i + score_start - score_base(score_start)."""
    return score_start >> 4 << 4


@contextlib.contextmanager
def uncounted():
    """Launches inside are not counted (the backend self-check's are not the caller's work)."""
    saved = LAUNCHES.copy()
    try:
        yield
    finally:
        LAUNCHES.clear()
        LAUNCHES.update(saved)


# (id of the kernel, device, the arguments' specialisation, launch options, Triton's compile knobs) -> (the kernel, the
# CompiledKernel Triton made for them). Keyed by id (a JITFunction's own hash costs a microsecond); the entry keeps
# the kernel alive, so that its id cannot be reused while the entry exists.
_COMPILED: dict[tuple, tuple] = {}


def launch(kernel, grid: tuple[int, ...], *args, **options) -> None:
    """kernel[grid](*args, **options), less most of Triton's per-launch Python.

    Past binding and specialising the arguments, `JITFunction.run` spends 5-10 us of host Python per launch on these
    kernels' up to 52 arguments (a cache key formatted from the options, global-variable checks, launch metadata),
    three launches per fused decode. The first launch of each specialisation (the JIT's own binder: dtypes, 16-byte
    alignment, integers' divisibility by 16 and 1s, constexprs; with the knobs that change a compile: debug,
    instrumentation, fpsan) takes Triton's path, which compiles, and leaves its CompiledKernel here; later ones call
    that kernel's launcher straight, as inductor launches the kernels it compiled. Skipped with it: the check that the
    globals a kernel read have not changed (these kernels read only constexpr globals). Triton's own path also runs
    under torch.compile's tracing (which must see kernel[grid]), in the interpreter, on Triton < 3.4 (other
    internals), and while a launch hook (a profiler), a pre-run hook or a stages-inspection hook is set."""
    LAUNCHES[kernel.fn.__name__] += 1
    if not DIRECT_LAUNCHES or torch.compiler.is_compiling() or _hooked(kernel):
        kernel[grid](*args, **options)
        return
    device = driver.active.get_current_device()
    bound, specialization, _ = kernel.device_caches[device][-1](*args, **options)
    key = (id(kernel), device, tuple(specialization), tuple(options.items()), knobs.runtime.debug,
           getattr(knobs.compilation, "instrumentation_mode", None),
           getattr(knobs.compilation, "fpsan_homomorphic_casts", None))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **options)
        if isinstance(compiled, CompiledKernel):
            _COMPILED[key] = kernel, compiled
        return
    compiled = entry[1]
    grid = grid + (1,) * (3 - len(grid))
    compiled.run(*grid, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata, None,
                 None, None, *bound.values())


@contextlib.contextmanager
def jit_launches():
    """Launches inside take Triton's own path (JITFunction.run): what the benchmarks and tests compare direct launches
    with."""
    global DIRECT_LAUNCHES
    saved, DIRECT_LAUNCHES = DIRECT_LAUNCHES, False
    try:
        yield
    finally:
        DIRECT_LAUNCHES = saved


def _hooked(kernel) -> bool:
    """Whether a launch hook or a stages-inspection hook (Triton >= 3.9: it changes the compile) is installed, or the
    kernel has a pre-run hook."""
    return _installed(knobs.runtime.launch_enter_hook) or _installed(knobs.runtime.launch_exit_hook) \
        or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None or bool(kernel.pre_run_hooks)


def _installed(hook) -> bool:
    """Triton >= 3.6 keeps a launch hook in a HookChain, empty by default; 3.4-3.5 in an Optional knob."""
    return hook is not None and bool(getattr(hook, "calls", True))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host arithmetic: triton.cdiv is a constexpr_function in recent Triton and
    costs about 7 us per host call, seven of them per fused decode."""
    return -(-a // b)


def next_pow2(value: int) -> int:
    """The least power of two >= value (1 for value <= 1); int() specialises a traced size."""
    value = int(value)
    return 1 << (value - 1).bit_length() if value > 1 else 1


def dependent_launch(device: torch.device) -> bool:
    """Whether this call's dependent kernels launch programmatically (PDL_LAUNCHES): on a GPU of compute capability 9
    or more, outside the interpreter and torch.compile's tracing (inductor launches the kernels it traces itself)."""
    return (PDL_LAUNCHES and device.type == "cuda" and torch.version.hip is None and gdc_wait is not None
            and not INTERPRETED and not torch.compiler.is_compiling() and capability_major(device) >= 9)


def dependent_options(dependent: bool) -> dict:
    """The launch option that makes a kernel a programmatic dependent of the one before it (none otherwise: Triton's
    own default, and versions without the option)."""
    return {"launch_pdl": True} if dependent else {}


@contextlib.contextmanager
def dependent_launches(enabled: bool = True):
    """PDL_LAUNCHES set to `enabled` inside: what the benchmarks and the GPU tests compare."""
    global PDL_LAUNCHES
    saved, PDL_LAUNCHES = PDL_LAUNCHES, enabled
    try:
        yield
    finally:
        PDL_LAUNCHES = saved


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """With PDL, wait until the kernel this one was launched after has finished and its writes are visible: before
    the first read of anything it wrote."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependent_grid(PDL: tl.constexpr):
    """With PDL, let the next kernel's programs start once every program of this one has passed here (they then wait
    in wait_for_prior_grid: this grants no early read)."""
    if PDL:
        gdc_launch_dependents()


@functools.cache
def capability_major(device: torch.device) -> int:
    """A CUDA device's compute capability's major number (cached per device: the query costs microseconds)."""
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter runs programs one by one, so a few suffice. Cached per device
    (a CUDA tensor's device has its index): the query costs microseconds of every launch plan."""
    if INTERPRETED or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_in_f32(*tensors: torch.Tensor) -> bool:
    """True unless every operand is float16, or every one bfloat16 (then tensor cores run the product)."""
    dtypes = {tensor.dtype for tensor in tensors}
    return INTERPRETED or len(dtypes) != 1 or not dtypes <= {torch.float16, torch.bfloat16}


def head_block(dim: int) -> int:
    """Head-dimension tile: tl.dot needs at least 16."""
    return max(16, next_pow2(dim))


@dataclasses.dataclass(frozen=True)
class SplitKV:
    """Tiles of the split-KV pass: BLOCK_M query rows (a GQA group's heads x query rows) per program of `num_warps`
    warps, BLOCK_N keys per step, the keys cut into `splits` slices of `split_size` keys."""
    block_m: int
    block_n: int
    num_warps: int
    splits: int
    split_size: int


def split_kv_block(group_rows: int, dim: int, exact_f32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split kernels: no tile spills registers, and the K and V stages fit the
    99 KiB of shared memory a block gets on sm_86/89/120 (sm_80: 163 KiB, sm_90: 227 KiB), as compiled for sm_80 and
    sm_90 (tests/ops/test_triton_compile.py). tl.dot needs 16 rows and keys. On tensor cores the keys of a step (16 to
    64) times the head dimension and the rows (at least 32) stay within 2^18, and 64 rows take 8 warps: with 64 keys
    and 4 warps throughout, 64-row tiles spilled up to 840 bytes a thread and D = 256 took up to 240 KiB. float32
    products run on CUDA cores, where a thread holds its rows' and keys' whole head dimension: 16 keys a step, and 16
    rows from a 128-wide head tile up (D > 64): 64 keys spilled up to 24 KiB a thread, and Triton 3.6.0 (the H200's)
    still spilled 408-488 bytes with 16 keys and 32-64 rows at D = 128."""
    block_d = head_block(dim)
    if exact_f32:
        block_m = min(64 if block_d < 128 else 16, max(16, next_pow2(group_rows)))
        block_n = 16
    else:
        block_m = min(64, max(16, next_pow2(group_rows)))
        block_n = max(16, min(64, 2 ** 18 // (max(block_m, 32) * block_d)))
    return block_m, block_n, 8 if block_m == 64 else 4


def split_kv_tiles(batch: int, kv_heads: int, group_rows: int, keys: int, dim: int, exact_f32: bool,
                   device: torch.device) -> SplitKV:
    """(row tile, key slice) programs up to twice the GPU's SMs, rounded down, whole key blocks per slice, with
    split_kv_block's tiles (the interpreter, which runs programs one by one, prefers 128 keys a step). Rounded up, 8 x
    32k keys (64 row tiles) took 5 splits, 320 programs on an H200's 132 SMs, 2 or 3 each: its SMs' mean busy time was
    0.70 of the busiest's, and the fused pass took 376 us; rounded down, 256 programs, 288 us (0.76x), the same time at
    every batch-1 shape of issue 48's table, whose grids it leaves as they were (benchmarks/results, 2026-11-30)."""
    block_m, block_n, num_warps = split_kv_block(group_rows, dim, exact_f32)
    block_n = 128 if INTERPRETED else block_n
    programs = batch * kv_heads * cdiv(group_rows, block_m)
    blocks = cdiv(keys, block_n)
    splits = min(blocks, max(1, 2 * multiprocessors(device) // programs))
    per_split = cdiv(blocks, splits)
    return SplitKV(block_m, block_n, num_warps, cdiv(blocks, per_split), per_split * block_n)


def splits_chunk(splits: int, dim: int) -> int:
    """Key slices whose (slices, head dimension) accumulators the combine reads at a time: at most 8192 values, 64 a
    thread of 4 warps; a power of two."""
    return min(next_pow2(splits), max(1, 8192 // head_block(dim)))


def pool_block(heads: int, n_max: int) -> int:
    """Inputs per program of the pooling kernel: one tile holds every head of BLOCK_I inputs; the
    interpreter prefers few, large tiles."""
    return max(16, min(next_pow2(n_max), (16384 if INTERPRETED else 4096) // next_pow2(heads)))


def row_block(length: int) -> int:
    """Elements per step of a kernel that sweeps one row (z-scores, generated mass)."""
    return min(next_pow2(length), 4096 if INTERPRETED else 1024)


def features_block(rows: int, exact_f32: bool) -> tuple[int, int]:
    """(BLOCK_R target rows, BLOCK_N source keys) of attention_features on a GPU: no spills, as compiled for sm_80 and
    sm_90 (tests/ops/test_triton_compile.py). float32 products run on CUDA cores, where a thread holds its rows' and
    keys' whole head dimension: (16, 16) tiles (64 x 64 ones spilled 9.7-11 KiB a thread at D = 128)."""
    if exact_f32:
        return 16, 16
    return (16 if rows <= 16 else 64), 64


def features_tiles(rows: int, exact_f32: bool) -> tuple[int, int]:
    """attention_features' tiles: features_block's, or the interpreter's (which runs programs one by one)."""
    if INTERPRETED:
        return (16 if rows <= 16 else 32), 64
    return features_block(rows, exact_f32)


def back_projection_block(dim: int) -> tuple[int, int, int]:
    """(BLOCK_M coefficient rows, BLOCK_S keys, num_warps) of the efficient-attention back-projection on a GPU: no
    spills and at most 99 KiB of shared memory, as compiled for sm_80 and sm_90 (tests/ops/test_efficient_compile.py).
    Its products are exact (float32 on CUDA cores, float64 MMA): (16, 16) tiles, 8 warps at D = 256. Tiles of up to
    64 rows and 64 keys spilled up to 37 KiB a thread and, in float64 at D >= 128, took 152-416 KiB."""
    return 16, 16, 8 if head_block(dim) > 128 else 4


def back_projection_tiles(rows_m: int, keys: int, dim: int) -> tuple[int, int, int]:
    """back_projection_block's tiles, or the interpreter's (which runs programs one by one: few, large tiles)."""
    if INTERPRETED:
        return max(16, min(next_pow2(rows_m), 64)), max(16, min(next_pow2(keys), 256)), 4
    return back_projection_block(dim)
