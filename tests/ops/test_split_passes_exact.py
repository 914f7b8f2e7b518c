"""Every split-KV pass a GPU runs, against the float64 references: the cuda backend's split kernels, each on the
shapes it is chosen for (ops/cuda/__init__.py: bf16 at D 64 and 128 the tensor-core kernel, float32 up to D 128 and
bf16 at D 256 the pipelined one, D 72 and float32 at D 256 split_kernel), and the triton backend's fused pass. The
fused decode's out, lse, m' (pooled) and log c update in fp32 and bf16, GQA 1, 4 and 8 (and 16 for cuda: 32 query
heads, which head pooling splits over 4 threads a key, 16 over 2), ragged per-row ranges with
generated keys, an odd key count; and m' of a verify block of 40 rows per KV head, triton's 64-row tiles in bf16, at
D 128 and 256. The `kernels` preset of .ci/gpu runs it (the tensor-core kernel's cases under compute-sanitizer too).
Skips without a CUDA device and the backend."""
from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference, why_unavailable
from tests.ops.cases import (
    CUDA_BACKEND_DEVICE,
    assert_split_kernel,
    launched_kernels,
    synchronize,
    why_no_cuda_backend,
)
from tests.tolerances import RELATIVE_ERROR, relative_error


def _marks(backend):
    if backend == "cuda":
        reason = why_no_cuda_backend()
    else:
        reason = "no CUDA device" if not torch.cuda.is_available() else why_unavailable(backend, "cuda")
    return [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])


def _cuda_split_kernel(dtype, dim, group):
    """The cuda split kernel these cases' shapes (GQA up to 16:1, aligned rows) are chosen for on sm_80 and later:
    pipelined's block holds a KV head's query heads at 16 bytes of a row a thread, 256 threads at most."""
    if dim in (64, 128) and dtype != torch.float32:
        return "mma"
    lanes = dim * dtype.itemsize // 16
    return "pipelined" if lanes in (8, 16, 32) and group * lanes <= 256 else "general"


# D 72 and 256 reach the cuda backend's other split kernels; the triton backend's tiles are the same at every D.
CASES = [pytest.param(backend, dtype, group, dim, marks=_marks(backend),
                      id=f"{backend}-{str(dtype).removeprefix('torch.')}-gqa{group}-d{dim}")
         for backend, groups, dims in (("cuda", (1, 4, 8, 16), (64, 72, 128, 256)), ("triton", (1, 4, 8), (64, 128)))
         for dtype, group, dim in itertools.product((torch.float32, torch.bfloat16), groups, dims)]


@pytest.mark.parametrize("backend, dtype, group, dim", CASES)
def test_the_fused_decode_matches_float64(backend, dtype, group, dim):
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
@pytest.mark.parametrize("backend", [pytest.param(backend, marks=_marks(backend)) for backend in ("cuda", "triton")])
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
    device = CUDA_BACKEND_DEVICE if backend == "cuda" else "cuda"
    got = ops.macs_pool(q.to(device), k.to(device), backend=backend,
                        **{name: value.to(device) if torch.is_tensor(value) else value
                           for name, value in ranges.items()})
    synchronize(device)
    want = reference.macs_pool_reference(q, k, **ranges)
    for b in range(batch):
        n = int(input_end[b, 0] - input_start[b, 0])
        assert relative_error(got[b, :, :n], want[b, :, :n]) < RELATIVE_ERROR[torch.float32]
