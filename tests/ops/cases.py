"""What the per-op tests share: the device, backend parameters with the dispatcher's skip reasons, the
factor values of the grids, ranges with pads / generated keys / unused slots, and result checks."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import BACKENDS, reference, why_unavailable
from macs_kernels.ops.backends import cuda_emulated, triton_interpreted
from tests.tolerances import RELATIVE_ERROR, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The cuda backend's tensors: a GPU's, or CPU tensors where MACS_KERNELS_CUDA_EMULATION=1 runs its kernels compiled
# for the CPU (ops/cuda/emulation.py).
CUDA_BACKEND_DEVICE = "cpu" if cuda_emulated() else "cuda"


# For tests of what Triton's interpreter shows (program order, memory traffic): skipped where triton runs compiled.
NEEDS_TRITON_INTERPRETER = pytest.mark.skipif(
    not triton_interpreted() or why_unavailable("triton", "cpu") is not None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def why_no_cuda_backend() -> str | None:
    """Why the cuda backend cannot run here (None when it can): for the tests of the cuda backend alone."""
    if CUDA_BACKEND_DEVICE == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (MACS_KERNELS_CUDA_EMULATION=1 runs the cuda backend's kernels on the CPU)"
    return why_unavailable("cuda", CUDA_BACKEND_DEVICE)


# For tests of what the CUDA emulation shows (run orders, memory traffic, emulated devices).
NEEDS_CUDA_EMULATION = pytest.mark.skipif(
    CUDA_BACKEND_DEVICE != "cpu" or why_no_cuda_backend() is not None,
    reason="needs the cuda backend's CPU emulation (MACS_KERNELS_CUDA_EMULATION=1)")


# The tensor-core split kernel's blocks per multiprocessor by registers, by (D, with V): the tests' own statement of
# csrc/split_kv_mma's mma_blocks_by_registers (its __launch_bounds__), against which ptxas's register counts
# (tests/ops/test_cuda_build.py) and mma_policy's wave (tests/ops/test_cuda_emulation.py) are checked.
MMA_THREADS = 128
MMA_BLOCKS_BY_REGISTERS = {(64, True): 4, (128, True): 2, (64, False): 5, (128, False): 4}


def synchronize(device) -> None:
    """Wait for the device's kernels (errors surface here), where it runs them asynchronously."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()

SEQUENCES = (1, 113, 1023)
HEAD_DIMS = (64, 128)
HEADS = ((2, 2), (3, 1), (8, 2), (8, 1))  # H:H_kv = 1:1, 3:1, 4:1, 8:1
BATCHES = (1, 3)
POOLINGS = ("max", "mean", "min")
ALPHAS = (0.2, 0.8, 1.0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXTRA_COLUMNS = 3  # log_c columns past every row's N_b: they must come back untouched
SENTINEL = 7.25


def backends(op: str) -> list:
    """pytest params over every backend for `op`, skipped with the dispatcher's reason where it cannot run;
    the cuda backend carries the gpu marker."""
    params = []
    for name in BACKENDS:
        reason = why_unavailable(name, DEVICE, op)
        marks = [pytest.mark.gpu] if name == "cuda" else []
        if reason is not None:
            marks.append(pytest.mark.skip(reason=reason))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def row_ranges(keys: int, batch: int):
    """Per row (input_start, input_end, kv_len): pads + inputs + generated + unused slots; a full cache
    of inputs only; a single input followed by many generated keys. S = 1 leaves one input key."""
    if keys == 1:
        patterns = [(0, 1, 1)] * 3
    else:
        patterns = [
            (keys // 8, keys // 2 + 1, keys - keys // 16),
            (0, keys, keys),
            (keys // 3, keys // 3 + 1, keys // 3 + 1 + keys // 4),
        ]
    start, end, length = zip(*patterns[:batch])
    return tuple(torch.tensor(values, device=DEVICE) for values in (start, end, length))


def fresh_log_c(input_start, input_end):
    """Random log_c with SENTINEL in each row's columns >= N_b."""
    n_input = (input_end - input_start).cpu()
    log_c = torch.randn(len(n_input), int(n_input.max()) + EXTRA_COLUMNS)
    log_c[torch.arange(log_c.shape[1]) >= n_input[:, None]] = SENTINEL
    return log_c.to(DEVICE)


def assert_log_c(got, ref, input_start, input_end, dtype):
    n_input = (input_end - input_start).cpu()
    beyond = torch.arange(got.shape[1]) >= n_input[:, None]
    got = got.cpu()
    assert bool((got[beyond] == SENTINEL).all()), "entries i >= N_b were written"
    assert_close_log_c(got, ref, dtype)


def assert_close_log_c(got, ref, dtype):
    """alpha = 1 with a pooled value of exactly 0 (clamped negative rows) gives log 0 = -inf: those entries must
    match exactly, the finite rest within the dtype's tolerance."""
    got, ref = got.cpu(), ref.cpu()
    infinite = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), infinite) and bool((got[infinite] == ref[infinite]).all())
    error = relative_error(got[~infinite], ref[~infinite])
    assert error <= RELATIVE_ERROR[dtype], f"relative error {error:.3g} > {RELATIVE_ERROR[dtype]:.3g}"


def random_qk(batch, heads, kv_heads, keys, dim, dtype):
    q = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    k = torch.randn(batch, kv_heads, keys, dim, dtype=dtype, device=DEVICE)
    return q, k


def reference_lse(q, k, input_start, kv_len, scale):
    group = q.shape[1] // k.shape[1]
    return torch.tensor([
        [float(reference.softmax_row_reference(q[b, h], k[b, h // group, s:n], scale)[1]) for h in range(q.shape[1])]
        for b, (s, n) in enumerate(zip(input_start.tolist(), kv_len.tolist()))
    ], dtype=torch.float32, device=DEVICE)


def every_op_results(dtype: torch.dtype, backend: str, D: int = 64) -> list[torch.Tensor]:
    """What every op computes on `backend` from one set of CPU inputs (fresh outputs each call): the race tests'
    results (tests/ops/test_cuda_emulation.py, test_program_order.py)."""
    B, H, H_KV, S, R, PAGE = 3, 12, 4, 211, 3, 16  # GQA 3:1, keys over several tiles and splits
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, D, generator=generator).to(dtype)
    block = torch.randn(B, H, R, D, generator=generator).to(dtype)
    k, v = torch.randn(2, B, H_KV, S, D, generator=generator).to(dtype)
    pages_per_item = -(-S // PAGE)
    table = torch.randperm(B * pages_per_item, generator=generator).view(B, pages_per_item).int()
    pages = torch.empty(B * pages_per_item, PAGE, H_KV, D, dtype=dtype)
    for b in range(B):
        for i in range(pages_per_item):
            chunk = k[b, :, i * PAGE:(i + 1) * PAGE].transpose(0, 1)
            pages[table[b, i], :chunk.shape[0]] = chunk
    rows = torch.softmax(torch.randn(B, H, S, generator=generator), -1)
    start, end, length = torch.tensor([0, 7, 50]), torch.tensor([150, 120, 51]), torch.tensor([S, 190, 120])
    width = int((end - start).max())
    ranges = dict(input_start=start, input_end=end, kv_len=length, scale=D ** -0.5)
    results = []

    out = torch.zeros(B, width)
    ops.macs_pool(q, k, out=out, backend=backend, **ranges)
    block_out = torch.zeros(B, R, width)
    block_length = torch.stack([length - 2, length - 1, length], dim=1)
    ops.macs_pool(block, k, out=block_out, backend=backend, **(ranges | dict(kv_len=block_length)))
    paged_out = torch.zeros(B, width)
    ops.macs_pool_paged(q, pages, table, out=paged_out, backend=backend, **ranges)
    log_c = torch.zeros(B, width)
    attention = ops.decode_attention(q, k, v, kv_start=start, kv_len=length, input_end=end, scale=D ** -0.5,
                                     log_c=log_c, backend=backend)
    row_log_c = torch.zeros(B, width)
    ops.macs_update_rows(rows, row_log_c, input_start=start, input_end=end, kv_len=length, backend=backend)
    z = ops.macs_zscore(log_c, end - start, backend=backend)
    features = ops.attention_features(block, k, source_start=start, source_end=end, kv_len=length, kv_start=start,
                                      n_rows=torch.full((B,), R), scale=D ** -0.5, n_max=width, backend=backend)
    results += [out, block_out, paged_out, *attention, log_c, row_log_c, z, features]
    return results


@contextlib.contextmanager
def many_programs(multiprocessors: int = 64):
    """The triton backend's launch plans for a GPU of `multiprocessors` (the interpreter's default, 4, leaves each row
    tile's keys whole at the tests' sizes): keys cut into several slices, so that slices arrive in every order and
    meet at their edges."""
    from macs_kernels.apps.bench.traffic import triton_launch_plans_for

    with triton_launch_plans_for(multiprocessors):
        yield


@contextlib.contextmanager
def uninitialized_memory_poisoned():
    """torch's empty tensors filled with NaN (integers with their largest value), from Python and from the launchers'
    at::empty alike (torch.utils.deterministic.fill_uninitialized_memory, on under deterministic algorithms): a GPU's
    fresh memory holds whatever was there, while a CPU's allocator hands a kernel's scratch back with the last call's
    results in it, which hides a kernel that reads scratch before it is written."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@dataclasses.dataclass
class KeyReadingCall:
    """One public call of an op that reads the cache in the split-KV pass, with what it must read: `cache`, the
    tensors K (and V) are read from, and `attended`, the bytes of each that the call's ranges attend (each key row
    of each KV head, once). `score_columns`: B x H x R x N, the input keys' scores a fused MACS pass keeps;
    `updates_log_c`: whether they feed a log c update (where a pass may keep them as float16 relative scores), and
    then `score_groups`: B x H x R x the groups of 16 keys (from key 0) that hold an input key (relative scores are
    stored a whole group at a time)."""
    name: str
    call: Callable[[], object]
    cache: dict[str, torch.Tensor]
    attended: int
    score_columns: int
    updates_log_c: bool = False
    score_groups: int = 0


# The cuda backend chooses its split kernel by shape (ops/cuda/__init__.py): (dtype, D) of inputs that each kernel
# serves at GQA up to 8:1, so that a test runs a kernel by its inputs, and the kernel's name as launched. (At bf16
# D 256, pipelined's too, a block of 256 threads holds 2 rows at GQA 3:1: a verify block of 3 rows reads K twice.)
CUDA_SPLIT_KERNEL_SHAPES = {
    "mma": ((torch.bfloat16, 64), (torch.float16, 128)),
    "pipelined": ((torch.float32, 64), (torch.bfloat16, 32)),
    "general": ((torch.float32, 72), (torch.bfloat16, 72)),
}
CUDA_SPLIT_KERNEL_NAMES = {"mma": "macs::mma_split_kernel<", "pipelined": "macs::pipelined_split_kernel<",
                           "general": "macs::split_kernel<"}
CUDA_SPLIT_KERNEL_CASES = [pytest.param(kernel, dtype, dim, id=f"{kernel}-{str(dtype).removeprefix('torch.')}-d{dim}")
                           for kernel, shapes in CUDA_SPLIT_KERNEL_SHAPES.items() for dtype, dim in shapes]


class LaunchedKernels(list):
    """Kernel names; `observed` False where none could be recorded: under compute-sanitizer, which holds CUPTI
    (torch.profiler's source of kernel names; .ci/gpu sets MACS_KERNELS_TESTS_UNDER_SANITIZER there)."""
    observed = True


@contextlib.contextmanager
def launched_kernels():
    """The names of the cuda backend's kernels launched inside the block (filled when it ends): the profiler's on a
    GPU, the emulation's log on the CPU."""
    names = LaunchedKernels()
    if CUDA_BACKEND_DEVICE == "cuda":
        if os.environ.get("MACS_KERNELS_TESTS_UNDER_SANITIZER") == "1":
            names.observed = False
            yield names
            return
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            yield names
            torch.cuda.synchronize()  # every kernel launched inside has run and is recorded
        names.extend(event.name for event in profile.events())
        return
    from macs_kernels.ops.cuda import emulation

    emulation.take_launches()
    yield names
    names.extend(launch.name for launch in emulation.take_launches())


def split_kernels_launched(names) -> set[str]:
    """The split kernels among launched kernels' names, each as CUDA_SPLIT_KERNEL_NAMES names it."""
    return {kernel for kernel, prefix in CUDA_SPLIT_KERNEL_NAMES.items() for name in names if prefix in name}


def assert_split_kernel(names: LaunchedKernels, kernel: str) -> None:
    """`kernel` (a CUDA_SPLIT_KERNEL_NAMES key) is the only split kernel among `names`, where they were observed."""
    if names.observed:
        assert split_kernels_launched(names) == {kernel}, list(names)


# Per backend, the split passes whose log c update keeps 16-bit inputs' scores as float16 `s - m`, and the keys per
# float32 maximum m they keep (the cuda mma kernel, SplitParams::relative_scores); every other score is float32.
RELATIVE_SCORE_PASSES = {"triton": ((), None), "cuda": (("mma",), 16)}


def score_bytes(backend: str, split_pass: str, dtype: torch.dtype, case: KeyReadingCall) -> int:
    """Bytes per input key's score that `case` keeps under `split_pass` of `backend`."""
    relative = split_pass in RELATIVE_SCORE_PASSES[backend][0] and dtype != torch.float32 and case.updates_log_c
    return 2 if relative else 4


def key_reading_calls(dtype: torch.dtype, backend: str, device=DEVICE, D: int = 64) -> list[KeyReadingCall]:
    """decode_attention (attention alone, with log c, with m' out), macs_update, macs_pool (one row, a verify block of
    three) and macs_pool_paged, GQA 3:1, on ragged ranges (a left pad, generated keys, unused slots)."""
    B, H, H_KV, S, R, PAGE = 3, 12, 4, 211, 3, 16
    generator = torch.Generator().manual_seed(11)
    make = dict(dtype=dtype, device=device)
    q = torch.randn(B, H, D, generator=generator).to(**make)
    block = torch.randn(B, H, R, D, generator=generator).to(**make)
    k = torch.randn(B, H_KV, S, D, generator=generator).to(**make)
    v = torch.randn(B, H_KV, S, D, generator=generator).to(**make)
    pages_per_item = -(-S // PAGE)
    table = torch.randperm(B * pages_per_item, generator=generator).view(B, pages_per_item).int().to(device)
    pages = torch.randn(B * pages_per_item, PAGE, H_KV, D, generator=generator).to(**make)
    index = lambda values: torch.tensor(values, device=device)  # noqa: E731
    start, end, length = index([0, 7, 50]), index([150, 120, 51]), index([S, 190, 120])
    width = int((end - start).max())
    columns = int((end - start).sum())
    groups = int((-(-end // 16) - start // 16).sum())
    attended = int((length - start).sum()) * H_KV * D * k.element_size()
    ranges = dict(input_start=start, input_end=end, kv_len=length, scale=D ** -0.5, backend=backend)
    attention = dict(kv_start=start, kv_len=length, scale=D ** -0.5, backend=backend)
    state = lambda: torch.zeros(B, width, device=device)  # noqa: E731
    block_length = torch.stack([length - 2, length - 1, length], dim=1)
    return [
        KeyReadingCall("decode_attention", lambda: ops.decode_attention(q, k, v, **attention),
                       {"k": k, "v": v}, attended, 0),
        KeyReadingCall("decode_attention with log_c", lambda: ops.decode_attention(
            q, k, v, input_end=end, log_c=state(), **attention), {"k": k, "v": v}, attended, H * columns, True,
            H * groups),
        KeyReadingCall("decode_attention with pooled", lambda: ops.decode_attention(
            q, k, v, input_end=end, pooled=state(), **attention), {"k": k, "v": v}, attended, H * columns),
        KeyReadingCall("macs_update", lambda: ops.macs_update(q, k, state(), **ranges), {"k": k}, attended,
                       H * columns, True, H * groups),
        KeyReadingCall("macs_pool", lambda: ops.macs_pool(q, k, out=state(), **ranges), {"k": k}, attended,
                       H * columns),
        KeyReadingCall("macs_pool, a verify block", lambda: ops.macs_pool(
            block, k, out=torch.zeros(B, R, width, device=device), **(ranges | dict(kv_len=block_length))),
            {"k": k}, attended, H * R * columns),
        KeyReadingCall("macs_pool_paged", lambda: ops.macs_pool_paged(q, pages, table, out=state(), **ranges),
                       {"k": pages}, attended, H * columns),
    ]


def assert_relative_score_bound(dtype: torch.dtype, pooling: str, backend: str, device=DEVICE) -> None:
    """alpha = 1 without redistribution adds log m' itself, the pooled log p: a pass that keeps the log c update's
    scores as s - m in float16 (m a running max, at most lse) gives each entry's increment within 2^-11 of its size
    (plus float32 rounding), over scores spread across +-30 where float16 absolute scores would not be; the inputs
    start at key 5 (not a multiple of any group of keys)."""
    generator = torch.Generator().manual_seed(2)
    q = (torch.randn(1, 8, 64, generator=generator) * 12).to(dtype).to(device)
    k = torch.randn(1, 2, 300, 64, generator=generator).to(dtype).to(device)
    input_start, input_end, kv_len = (torch.tensor([value], device=device) for value in (5, 290, 300))
    log_c = torch.zeros(1, 285, device=device)
    options = dict(input_start=input_start, input_end=input_end, kv_len=kv_len, scale=0.125, alpha=1.0,
                   pooling=pooling, redistribute=False)
    want = reference.macs_update_reference(q, k, log_c, **options)
    ops.macs_update(q, k, log_c, backend=backend, **options)
    got = log_c.cpu().double()
    assert want.abs().max() > 20  # log p spans a range that float16 absolute scores would round coarsely
    bound = 2.0 ** -11 * want.abs() + 1e-5 * (1 + want.abs())
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
