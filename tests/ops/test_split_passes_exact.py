"""Every split-KV pass a GPU runs, against the float64 references: the cuda backend's split kernels, each on the
shapes it is chosen for (ops/cuda/__init__.py: bf16 at D 64 and 128 the tensor-core kernel, float32 up to D 128 and
bf16 at D 256 the pipelined one, D 72 and float32 at D 256 split_kernel), and the triton backend's fused pass (also with
its combine and pooling launched as programmatic dependents, triton-pdl and cuda-pdl, on sm_90 and later). The
fused decode's out, lse, m' (pooled) and log c update in fp32 and bf16, GQA 1, 4 and 8 (and 16 for cuda: 32 query
heads, which head pooling splits over 4 threads a key, 16 over 2), ragged per-row ranges with
generated keys, an odd key count; and m' of a verify block of 40 rows per KV head, triton's 64-row tiles in bf16, at
D 128 and 256; and the cuda combine pass at every layout of its threads (head dimensions 30 to 600). The `kernels`
preset of .ci/gpu runs it (the tensor-core kernel's cases under compute-sanitizer too).
Skips without a CUDA device and the backend."""
from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference, why_unavailable
from macs_kernels.ops.backends import cuda_emulated
from tests.ops.cases import (
    CUDA_BACKEND_DEVICE,
    assert_split_kernel,
    launched_kernels,
    synchronize,
    uninitialized_memory_poisoned,
    why_no_cuda_backend,
)
from tests.tolerances import RELATIVE_ERROR, relative_error


def _marks(backend):
    dependent, backend = backend.endswith("-pdl"), backend.removesuffix("-pdl")
    if backend == "cuda":
        reason = why_no_cuda_backend()
        if reason is None and dependent and cuda_emulated():
            reason = "the emulation runs grids one after another (test_cuda_emulation.py checks dependent launches)"
    else:
        reason = "no CUDA device" if not torch.cuda.is_available() else why_unavailable(backend, "cuda")
    if reason is None and dependent and torch.cuda.get_device_capability()[0] < 9:
        reason = "programmatic dependent launches need sm_90 or later"
    return [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])


def _cuda_split_kernel(dtype, dim, group):
    """The cuda split kernel these cases' shapes (GQA up to 16:1, aligned rows) are chosen for on sm_80 and later:
    pipelined's block holds a KV head's query heads at 16 bytes of a row a thread, 256 threads at most."""
    if dim in (64, 128) and dtype != torch.float32:
        return "mma"
    lanes = dim * dtype.itemsize // 16
    return "pipelined" if lanes in (8, 16, 32) and group * lanes <= 256 else "general"


# D 72 and 256 reach the cuda backend's other split kernels; the triton backend's tiles are the same at every D.
# -pdl: the backend with its combine and pooling launched as programmatic dependents (sm_90 and later).
CASES = [pytest.param(backend, dtype, group, dim, marks=_marks(backend),
                      id=f"{backend}-{str(dtype).removeprefix('torch.')}-gqa{group}-d{dim}")
         for backend, groups, dims in (("cuda", (1, 4, 8, 16), (64, 72, 128, 256)), ("triton", (1, 4, 8), (64, 128)),
                                       ("cuda-pdl", (4,), (64, 72, 128, 256)), ("triton-pdl", (4,), (64, 128)))
         for dtype, group, dim in itertools.product((torch.float32, torch.bfloat16), groups, dims)]


def _launches(backend: str):
    """The backend a case names, and the context its calls run in. A -pdl case's: dependent launches on (checked to
    have been made), and fresh memory filled with NaN (tests/ops/cases.py): a dependent kernel that read the split
    pass's workspace before its wait would find NaN there, not the previous call's results."""
    if not backend.endswith("-pdl"):
        return backend, contextlib.nullcontext()
    backend = backend.removesuffix("-pdl")

    @contextlib.contextmanager
    def dependent():
        if backend == "cuda":
            from macs_kernels.ops import cuda

            made = cuda.dependent_launches_made()
            with cuda.dependent_launches(), uninitialized_memory_poisoned():
                yield
            assert cuda.dependent_launches_made() > made, "no launch was made as a dependent"
            return
        from macs_kernels.ops.triton import common

        with common.dependent_launches(), uninitialized_memory_poisoned():
            assert common.dependent_launch(torch.device("cuda", torch.cuda.current_device()))
            yield

    return backend, dependent()


@pytest.mark.parametrize("backend, dtype, group, dim", CASES)
def test_the_fused_decode_matches_float64(backend, dtype, group, dim):
    backend, launching = _launches(backend)
    with launching:
        _fused_decode_matches_float64(backend, dtype, group, dim)


def _fused_decode_matches_float64(backend, dtype, group, dim):
    batch, kv_heads, keys = 3, 2, 1537
    generator = torch.Generator().manual_seed(group * 1000 + dim)
    q = torch.randn(batch, group * kv_heads, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, keys, dim, generator=generator).to(dtype)
    kv_start = torch.tensor([0, 17, 301])
    kv_len = torch.tensor([keys, 1100, 333])
    input_end = kv_len - torch.tensor([5, 64, 1])
    scale = 1.0 / math.sqrt(dim)
    width = int((input_end - kv_start).max())
    device = CUDA_BACKEND_DEVICE if backend == "cuda" else "cuda"
    on_device = [t.to(device) for t in (q, k, v)]
    ranges = dict(kv_start=kv_start.to(device), kv_len=kv_len.to(device), input_end=input_end.to(device),
                  scale=scale)
    pooled = torch.zeros(batch, width, device=device)
    out, lse = ops.decode_attention(*on_device, pooled=pooled, backend=backend, **ranges)
    start_log_c = -torch.rand(batch, width, generator=generator)
    log_c = start_log_c.to(device, copy=True)
    with launched_kernels() if backend == "cuda" else contextlib.nullcontext([]) as names:
        ops.decode_attention(*on_device, log_c=log_c, backend=backend, **ranges)
        synchronize(device)
    if backend == "cuda":
        assert_split_kernel(names, _cuda_split_kernel(dtype, dim, group))

    want_out, want_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=scale)
    want_pool = reference.macs_pool_reference(q[:, :, None], k, input_start=kv_start[:, None],
                                              input_end=input_end[:, None], kv_len=kv_len[:, None], scale=scale)
    want_log_c = reference.macs_update_reference(q, k, start_log_c.double(), input_start=kv_start,
                                                 input_end=input_end, kv_len=kv_len, scale=scale)
    assert relative_error(out, want_out) < RELATIVE_ERROR[dtype]
    # lse and m' come from fp32 scores of the inputs as given: float32's tolerance in every dtype; log c of bf16
    # inputs from the float16 relative scores of cuda's mma kernel: bf16's.
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    for b in range(batch):
        n = int(input_end[b] - kv_start[b])
        assert relative_error(pooled[b, :n], want_pool[b, 0, :n]) < RELATIVE_ERROR[torch.float32]
        assert relative_error(log_c[b, :n], want_log_c[b, :n]) < RELATIVE_ERROR[dtype]
        assert bool((log_c[b, n:].cpu() == start_log_c[b, n:]).all())


ROW_TILE_CASES = list(itertools.product((torch.float32, torch.bfloat16), (128, 256)))


@pytest.mark.parametrize("dtype, dim", ROW_TILE_CASES,
                         ids=[f"{str(dtype).removeprefix('torch.')}-d{dim}" for dtype, dim in ROW_TILE_CASES])
@pytest.mark.parametrize("backend", [pytest.param(backend, marks=_marks(backend))
                                     for backend in ("cuda", "triton", "cuda-pdl", "triton-pdl")])
def test_a_verify_block_of_many_rows_matches_float64(backend, dtype, dim):
    """m' of a 5-row verify block at GQA 8:1, 40 rows per KV head (macs_pool: no V, no relative scores): the triton
    backend's tiles for many rows (ops.triton.common.split_kv_block: 64 rows on 8 warps in bf16, fewer keys a step at
    D 256, 16 rows from D 128 up in float32), which no decode row reaches."""
    batch, kv_heads, group, rows, keys = 2, 2, 8, 5, 777
    generator = torch.Generator().manual_seed(rows * 1000 + dim)
    q = torch.randn(batch, group * kv_heads, rows, dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(dtype)
    # Row r of item b ends its keys at base + r + 1, its inputs 16 keys before base.
    base = torch.tensor([keys - rows, 500])[:, None]
    kv_len = base + torch.arange(rows) + 1
    input_start = torch.tensor([0, 13])[:, None].expand(batch, rows)
    input_end = (base - 16).expand(batch, rows)
    ranges = dict(input_start=input_start, input_end=input_end, kv_len=kv_len, scale=1.0 / math.sqrt(dim))
    backend, launching = _launches(backend)
    device = CUDA_BACKEND_DEVICE if backend == "cuda" else "cuda"
    with launching:
        got = ops.macs_pool(q.to(device), k.to(device), backend=backend,
                            **{name: value.to(device) if torch.is_tensor(value) else value
                               for name, value in ranges.items()})
        synchronize(device)
    want = reference.macs_pool_reference(q, k, **ranges)
    for b in range(batch):
        n = int(input_end[b, 0] - input_start[b, 0])
        assert relative_error(got[b, :, :n], want[b, :, :n]) < RELATIVE_ERROR[torch.float32]


# (dtype, D, KV heads, GQA, keys, the columns a thread of the cuda combine sums at once, the splits it merges as the
# emulated H200 splits them): split_kv/kernel.cuh's combine_kernel as groups of D / columns lanes, each group every
# groups-th split. "chunks": more than one chunk a thread; "few": fewer splits than groups, some groups summing none.
# D 30: 30 lanes, 4 groups, 8 threads idle; D 36: 9 lanes, 14 groups, 2 idle; D 90: one group of 90 lanes, 38 idle;
# D 130 and 600: more vectors than threads, one group stepping over them; bf16 D 128 (the tensor-core kernel) at one
# KV head: 4 groups of 32 lanes over 188 splits, 3 chunks a thread; D 8 at 200 keys: 64 groups of 2 lanes.
COMBINE_CASES = [(torch.float32, 30, 1, 2, 6000, 1, "chunks"), (torch.float32, 36, 1, 2, 9000, 4, "chunks"),
                 (torch.float32, 90, 1, 1, 3000, 1, "chunks"), (torch.float32, 130, 1, 1, 3000, 1, "chunks"),
                 (torch.float32, 600, 1, 1, 3000, 4, "chunks"), (torch.bfloat16, 128, 1, 4, 12000, 4, "chunks"),
                 (torch.float32, 8, 1, 1, 200, 4, "few")]


@pytest.mark.parametrize("dtype, dim, kv_heads, group, keys, columns, splits_merged", COMBINE_CASES,
                         ids=[f"combine{case[5]}-d{case[1]}-{str(case[0]).removeprefix('torch.')}"
                              for case in COMBINE_CASES])
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=_marks("cuda"))])
def test_the_cuda_combine_merges_every_split_at_any_head_dimension(backend, dtype, dim, kv_heads, group, keys,
                                                                   columns, splits_merged):
    """The cuda combine pass's out and lse against float64 at every layout of its threads, launched with its column
    width. On the emulation also: the splits it merged (its launch's shared memory holds a weight a split) are more
    than a chunk a thread covers where the groups are few, or fewer than its groups, and it gives the same bits
    whichever of its threads run first (the groups' sums meet in shared memory)."""
    generator = torch.Generator().manual_seed(dim)
    q = torch.randn(1, group * kv_heads, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, 1, kv_heads, keys, dim, generator=generator).to(dtype)
    options = dict(kv_start=torch.tensor([3]), kv_len=torch.tensor([keys - 2]), scale=dim ** -0.5)
    on_device = dict(q=q.to(CUDA_BACKEND_DEVICE), k_cache=k.to(CUDA_BACKEND_DEVICE), v_cache=v.to(CUDA_BACKEND_DEVICE),
                     **{name: value.to(CUDA_BACKEND_DEVICE) if torch.is_tensor(value) else value
                        for name, value in options.items()})

    def call():
        return ops.decode_attention(backend=backend, **on_device)

    call()  # an op's first call in the process runs its self-check, whose launches are not this call's
    with launched_kernels() as names:
        out, lse = call()
        synchronize(CUDA_BACKEND_DEVICE)
    if names.observed:
        combines = [name for name in names if "combine_kernel<" in name]
        assert combines and all(f", {columns}>(" in name for name in combines), combines
    want_out, want_lse = reference.decode_attention_reference(q, k, v, **options)
    assert relative_error(out, want_out) < RELATIVE_ERROR[dtype]
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    if not cuda_emulated():
        return
    from macs_kernels.ops.cuda import emulation

    emulation.take_launches()
    call()
    splits = next(launch.shared_bytes // 4 for launch in emulation.take_launches() if "combine_kernel<" in launch.name)
    groups = 128 // min(dim // columns, 128)
    if splits_merged == "chunks":
        assert splits > (16 * groups if groups > 1 else 16), f"{splits} splits: a chunk a thread covers them"
    else:
        assert 1 < splits < groups, f"{splits} splits for {groups} groups"
    try:
        for order, seed in (("reverse", 0), ("shuffled", 1)):
            emulation.set_run_order(order, seed)
            other_out, other_lse = call()
            assert torch.equal(other_out, out) and torch.equal(other_lse, lse), f"{order} changed a result: a race"
    finally:
        emulation.set_run_order("forward")
