"""macs_kernels._C registers a CUDA kernel for every operator macs_kernels/ops defines, and the launchers'
own behaviour that the per-op backend grids do not reach: query rows spread over several blocks and key
splits (macs_pool), the pooled mode of decode_attention, the attention-variant arguments against the torch
kernels, and argument errors naming the argument; the split-KV cases on shapes of each split kernel, and the
kernel each shape runs.

Needs a CUDA device and the built extension; skips with the reason otherwise.
"""

import pytest
import torch

import macs_kernels.ops  # noqa: F401 - defines the operators whose CUDA kernels _C registers
from macs_kernels.ops import reference
from tests.ops.cases import CUDA_BACKEND_DEVICE as DEVICE
from tests.ops.cases import (
    CUDA_SPLIT_KERNEL_CASES,
    CUDA_SPLIT_KERNEL_NAMES,
    assert_split_kernel,
    launched_kernels,
    synchronize,
    why_no_cuda_backend,
)
from tests.ops.test_cuda_build import OPS
from tests.ops.test_library_opcheck import CASES
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(why_no_cuda_backend() is not None, reason=str(why_no_cuda_backend()))]


@pytest.mark.parametrize("op", OPS)
def test_every_operator_has_a_cuda_kernel(op):
    key = "CUDA" if DEVICE == "cuda" else "CPU"  # the emulated build registers its launchers for the CPU
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"macs_kernels::{op}", key)


def _verify_block(batch, kv_heads, group, rows, keys, dim, dtype):
    """q (B, H, R, D) and per-row ranges as a verify pass of assisted decoding makes them: row r of item b
    attends [start_b, base_b + r + 1), its inputs [start_b, input_end_b)."""
    heads = kv_heads * group
    # Views, as a model hands them over: a transposed query and a cache with spare capacity.
    q = 2 * torch.randn(batch, rows, heads, dim, device=DEVICE).to(dtype).transpose(1, 2)
    k_cache = torch.randn(batch, kv_heads, keys + 7, dim, device=DEVICE).to(dtype)[:, :, :keys]
    start = torch.tensor([3 * b for b in range(batch)], device=DEVICE)
    base = torch.tensor([keys - rows - 2 * b for b in range(batch)], device=DEVICE)
    input_end = start + (base - start) // 2
    kv_len = base.unsqueeze(1) + torch.arange(1, rows + 1, device=DEVICE)
    return q, k_cache, start.unsqueeze(1).expand(batch, rows), input_end.unsqueeze(1).expand(batch, rows), kv_len


@pytest.mark.parametrize(
    "batch, kv_heads, group, rows, keys, dim, dtype",
    [
        (2, 2, 8, 11, 1023, 64, torch.float32),  # 8 rows per block: two row chunks, several key splits
        (3, 3, 3, 5, 113, 66, torch.float16),  # rows not 16-byte aligned: element-wise loads
        (1, 1, 64, 3, 300, 128, torch.bfloat16),  # 64 heads: one row per block, > 48 KB of shared memory
        (2, 2, 4, 11, 1023, 128, torch.bfloat16),  # the tensor-core kernel: 4 rows of GQA 4:1 per block
    ],
)
@pytest.mark.parametrize("pooling", ["max", "mean", "min"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_macs_pool_over_row_chunks_and_splits(batch, kv_heads, group, rows, keys, dim, dtype, pooling, with_lse):
    q, k_cache, start, input_end, kv_len = _verify_block(batch, kv_heads, group, rows, keys, dim, dtype)
    scale = dim ** -0.5
    expected = reference.macs_pool_reference(
        q, k_cache, input_start=start, input_end=input_end, kv_len=kv_len, scale=scale, pooling=pooling
    )
    lse = None
    if with_lse:
        scores = torch.einsum("bhrd,bhsd->bhrs", q.double(), k_cache.double().repeat_interleave(group, 1)) * scale
        attended = torch.arange(keys, device=DEVICE)
        outside = (attended < start.unsqueeze(-1)) | (attended >= kv_len.unsqueeze(-1))
        lse = torch.logsumexp(scores.masked_fill(outside.unsqueeze(1), float("-inf")), -1).float()
    out = torch.full(expected.shape, float("nan"), device=DEVICE)  # every entry is written, zeros past N
    torch.ops.macs_kernels.macs_pool(q, k_cache, out, start, input_end, kv_len, scale, pooling, True, lse)
    assert relative_error(out, expected) < RELATIVE_ERROR[dtype]


def _paged(k_cache, page_size):
    """k_cache (B, H_kv, S, D) in pages numbered in reverse (pages (P, page_size, H_kv, D) as strided views of a
    larger cache, as transformers' page views are), with the int32 table."""
    batch, kv_heads, keys, dim = k_cache.shape
    per_item = -(-keys // page_size)
    padded = torch.nn.functional.pad(k_cache, (0, 0, 0, per_item * page_size - keys))
    pages = padded.transpose(1, 2).reshape(batch * per_item, page_size, kv_heads, dim).flip(0)
    spare = torch.full((pages.shape[0] + 2, page_size, kv_heads, dim + 8), float("nan"), device=DEVICE,
                       dtype=k_cache.dtype)
    spare[1:-1, :, :, :dim] = pages
    table = (batch * per_item - 1 - torch.arange(batch * per_item, device=DEVICE)).view(batch, per_item) + 1
    return spare[:, :, :, :dim], table.int()


@pytest.mark.parametrize(
    "batch, kv_heads, group, rows, keys, dim, dtype, page_size",
    [
        (2, 2, 8, 11, 1023, 64, torch.float32, 16),  # row chunks and key splits across page borders
        (3, 3, 3, 5, 113, 66, torch.float16, 7),  # element-wise loads, pages not a power of two
        (1, 1, 64, 3, 300, 128, torch.bfloat16, 256),  # > 48 KB of shared memory, flash_attn's page size
        (2, 2, 4, 11, 1023, 64, torch.float16, 16),  # the tensor-core kernel
    ],
)
def test_macs_pool_paged_equals_macs_pool(batch, kv_heads, group, rows, keys, dim, dtype, page_size):
    q, k_cache, start, input_end, kv_len = _verify_block(batch, kv_heads, group, rows, keys, dim, dtype)
    k_pages, table = _paged(k_cache, page_size)
    scale = dim ** -0.5
    want = torch.zeros(batch, rows, int((input_end - start).max()), device=DEVICE)
    got = torch.full_like(want, float("nan"))
    torch.ops.macs_kernels.macs_pool(q, k_cache, want, start, input_end, kv_len, scale, "max", True, None)
    torch.ops.macs_kernels.macs_pool_paged(q, k_pages, table, got, start, input_end, kv_len, scale, "max", True, None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
@pytest.mark.parametrize("redistribute", [True, False])
def test_decode_attention_pooled_writes_macs_pool_and_the_same_output(redistribute, kernel, dtype, dim):
    batch, kv_heads, group, keys = 3, 2, 4, 700
    q, k_cache, start, input_end, kv_len = _verify_block(batch, kv_heads, group, 1, keys, dim, dtype)
    v_cache = torch.randn_like(k_cache)
    scale = dim ** -0.5
    expected = reference.macs_pool_reference(
        q, k_cache, input_start=start, input_end=input_end, kv_len=kv_len, scale=scale, redistribute=redistribute
    )[:, 0]
    expected_out, expected_lse = reference.decode_attention_reference(
        q[:, :, 0], k_cache, v_cache, kv_start=start[:, 0], kv_len=kv_len[:, 0], scale=scale
    )
    pooled = torch.full(expected.shape, float("nan"), device=DEVICE)
    with launched_kernels() as names:
        out, lse = torch.ops.macs_kernels.decode_attention(
            q[:, :, 0], k_cache, v_cache, start[:, 0].contiguous(), kv_len[:, 0].contiguous(), scale, None,
            input_end[:, 0].contiguous(), 0.8, "max", redistribute, pooled,
        )
        synchronize(DEVICE)
    assert_split_kernel(names, kernel)
    assert relative_error(pooled, expected) < RELATIVE_ERROR[torch.float32]
    assert relative_error(out, expected_out) < RELATIVE_ERROR[dtype]
    assert relative_error(lse, expected_lse) < RELATIVE_ERROR[torch.float32]


def test_launcher_errors_name_the_argument():
    q, k_cache, start, input_end, kv_len = _verify_block(2, 1, 2, 3, 50, 64, torch.float32)
    out = torch.zeros(2, 3, 30, device=DEVICE)
    macs_pool = torch.ops.macs_kernels.macs_pool
    with pytest.raises(RuntimeError, match=r"macs_pool: out must be float32"):
        macs_pool(q, k_cache, out.double(), start, input_end, kv_len, 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool: out must have shape \(2, 3, N_max\)"):
        macs_pool(q, k_cache, out[:, :2], start, input_end, kv_len, 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool: input_start must have shape \(2, 3\)"):
        macs_pool(q, k_cache, out, start[:, 0].contiguous(), input_end, kv_len, 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool: kv_len must be int32 or int64"):
        macs_pool(q, k_cache, out, start, input_end, kv_len.double(), 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool: lse must have 3 dimensions"):
        macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "max", True, torch.zeros(2, 2, device=DEVICE))
    with pytest.raises(RuntimeError, match=r"macs_pool: pooling must be 'max', 'mean' or 'min'"):
        macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "median", True, None)
    k_pages, table = _paged(k_cache, 16)
    paged = torch.ops.macs_kernels.macs_pool_paged
    with pytest.raises(RuntimeError, match=r"macs_pool_paged: block_table must be int32"):
        paged(q, k_pages, table.long(), out, start, input_end, kv_len, 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool_paged: block_table must be \(2, pages\)"):
        paged(q, k_pages, table[:1], out, start, input_end, kv_len, 0.1, "max", True, None)
    with pytest.raises(RuntimeError, match=r"macs_pool_paged: k_pages must be \(pages, page_size, H_kv, 64\)"):
        paged(q, k_pages[..., :32], table, out, start, input_end, kv_len, 0.1, "max", True, None)
    v_cache = torch.randn_like(k_cache)
    state = torch.zeros(2, 30, device=DEVICE)
    with pytest.raises(RuntimeError, match="decode_attention: give log_c or pooled, not both"):
        torch.ops.macs_kernels.decode_attention(
            q[:, :, 0], k_cache, v_cache, start[:, 0].contiguous(), kv_len[:, 0].contiguous(), 0.1, state,
            input_end[:, 0].contiguous(), 0.8, "max", True, state.clone(),
        )
    with pytest.raises(RuntimeError, match="decode_attention: input_end"):
        torch.ops.macs_kernels.decode_attention(
            q[:, :, 0], k_cache, v_cache, start[:, 0].contiguous(), kv_len[:, 0].contiguous(), 0.1, None, None,
            0.8, "max", True, state,
        )
    with pytest.raises(RuntimeError, match="decode_attention: score_start .* comes with pooled, not log_c"):
        torch.ops.macs_kernels.decode_attention(
            q[:, :, 0], k_cache, v_cache, start[:, 0].contiguous(), kv_len[:, 0].contiguous(), 0.1, state,
            input_end[:, 0].contiguous(), 0.8, "max", True, None, start[:, 0].contiguous(),
        )
    with pytest.raises(RuntimeError, match=r"macs_pool: sinks must have shape \(2,\), one logit per query head"):
        macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "max", True, None, None, None,
                  torch.zeros(3, device=DEVICE))
    with pytest.raises(RuntimeError, match="macs_pool: softcap must be a finite float > 0"):
        macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "max", True, None, None, 0.0)
    with pytest.raises(RuntimeError, match=r"macs_pool: score_start must have shape \(2, 3\)"):
        macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "max", True, None, start[:, 0].contiguous())


@pytest.mark.parametrize("case", ["macs_pool/variant", "decode_attention/log_c+variant",
                                  "decode_attention/pooled+variant", "attention_features/variant"])
def test_variant_arguments_equal_the_torch_kernel(case):
    """The operators' variant arguments in key slots (a window's attended start and score_start, which may
    precede slot 0, a softcap, sinks) on the CUDA kernels against the operators' torch kernels on CPU."""
    args = CASES[case]()
    op = getattr(torch.ops.macs_kernels, case.split("/")[0])
    on_gpu = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    want, got = (result if isinstance(result, tuple) else () if result is None else (result,)
                 for result in (op(*args), op(*on_gpu)))
    for expected, actual in zip([*want, *args], [*got, *on_gpu]):
        if isinstance(expected, torch.Tensor) and expected.is_floating_point():
            assert relative_error(actual, expected) < RELATIVE_ERROR[torch.float32]


@pytest.mark.parametrize(
    "dim, dtype, group, expected",
    [(128, torch.bfloat16, 4, "mma"), (64, torch.float16, 16, "mma"), (128, torch.float32, 4, "pipelined"),
     (256, torch.bfloat16, 4, "pipelined"), (64, torch.bfloat16, 32, "pipelined"), (72, torch.bfloat16, 4, "general"),
     (66, torch.float32, 4, "general")],
)
def test_the_split_kernel_is_chosen_by_shape(dim, dtype, group, expected):
    """The profiler names the split kernel each op launched: the tensor-core one for fp16/bf16 at D 64 or 128 and
    GQA up to 16:1, else the pipelined one for 16-byte rows of a power-of-two count of 16 bytes (float32 among them)
    up to 256 threads a block, else split_kernel (D 72 bf16: 9 vectors of 16 bytes; D 66 float32: rows not 16-byte
    aligned); so that the tests over each kernel's shapes (tests/ops/cases.py) run the kernel they name."""
    q, k_cache, start, input_end, kv_len = _verify_block(2, 2, group, 1, 300, dim, dtype)
    v_cache = torch.randn_like(k_cache)
    log_c = torch.zeros(2, int((input_end - start).max()), device=DEVICE)
    out = torch.zeros(2, 1, log_c.shape[1], device=DEVICE)
    k_pages, table = _paged(k_cache, 16)
    with launched_kernels() as names:
        torch.ops.macs_kernels.decode_attention(
            q[:, :, 0], k_cache, v_cache, start[:, 0].contiguous(), kv_len[:, 0].contiguous(), 0.1, log_c,
            input_end[:, 0].contiguous(), 0.8, "max", True, None,
        )
        torch.ops.macs_kernels.macs_update(q[:, :, 0], k_cache, log_c, start[:, 0].contiguous(),
                                           input_end[:, 0].contiguous(), kv_len[:, 0].contiguous(), 0.1, 0.8, "max",
                                           True, None)
        torch.ops.macs_kernels.macs_pool(q, k_cache, out, start, input_end, kv_len, 0.1, "max", True, None)
        torch.ops.macs_kernels.macs_pool_paged(q, k_pages, table, out, start, input_end, kv_len, 0.1, "max", True,
                                               None)
        synchronize(DEVICE)
    if not names.observed:
        pytest.skip("under compute-sanitizer no kernel names are recorded; the stages without it check them")
    launched = [name for name in names if "split_kernel<" in name]
    assert len(launched) == 4 and all(CUDA_SPLIT_KERNEL_NAMES[expected] in name for name in launched), launched
