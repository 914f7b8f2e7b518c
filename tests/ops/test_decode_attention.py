"""ops.decode_attention on every backend against the float64 reference and torch's SDPA, alone, fused with
the MACS update, and writing the pooled rows."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.grids import case_ids, pairwise
from tests.ops.cases import (
    ALPHAS,
    BATCHES,
    DEVICE,
    DTYPES,
    HEAD_DIMS,
    HEADS,
    POOLINGS,
    SEQUENCES,
    assert_log_c,
    backends,
    fresh_log_c,
    row_ranges,
)
from tests.tolerances import RELATIVE_ERROR, relative_error

# The Triton interpreter evaluates both sides of tl.where: log(0) and 1/0 there are expected and unused.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


DECODE_CASES = pairwise({
    "keys": SEQUENCES, "dim": HEAD_DIMS, "heads": HEADS, "batch": BATCHES, "dtype": DTYPES,
    "fused": (True, False), "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False),
    "strided_q": (True, False),
})


@pytest.mark.parametrize("backend", backends("decode_attention"))
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_ids(DECODE_CASES))
def test_decode_attention(case, backend):
    batch, (heads, kv_heads), keys, dim, dtype = case["batch"], case["heads"], case["keys"], case["dim"], case["dtype"]
    if case["strided_q"]:
        # transformers hands over query[:, :, -1, :] of a (B, S_q, H, D) tensor transposed to (B, H, S_q, D).
        q = torch.randn(batch, 2, heads, dim, dtype=dtype, device=DEVICE).transpose(1, 2)[:, :, -1, :]
        assert q.stride(0) == 2 * heads * dim and q.storage_offset() == heads * dim
    else:
        q = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    k = torch.randn(batch, kv_heads, keys, dim, dtype=dtype, device=DEVICE)
    v = torch.randn(batch, kv_heads, keys, dim, dtype=dtype, device=DEVICE)
    kv_start, input_end, kv_len = row_ranges(keys, batch)
    scale = dim ** -0.5
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    log_c = fresh_log_c(kv_start, input_end) if case["fused"] else None
    ref_log_c = None
    if case["fused"]:
        ref_log_c = reference.macs_update_reference(
            q, k, log_c, input_start=kv_start, input_end=input_end, kv_len=kv_len, scale=scale, **options
        )
    out, lse = ops.decode_attention(
        q, k, v, kv_start=kv_start, kv_len=kv_len, scale=scale, log_c=log_c,
        input_end=input_end if case["fused"] else None, backend=backend, **options,
    )
    assert out.shape == (batch, heads, dim) and out.dtype == dtype
    assert lse.shape == (batch, heads) and lse.dtype == torch.float32
    tolerance = RELATIVE_ERROR[dtype]
    ref_out, ref_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=scale)
    assert relative_error(out, ref_out) <= tolerance
    assert relative_error(lse, ref_lse) <= tolerance

    # torch's own attention over the same keys: SDPA with a padding mask, and logsumexp of the scores.
    positions = torch.arange(keys, device=DEVICE)
    attended = (positions >= kv_start[:, None]) & (positions < kv_len[:, None])
    group = heads // kv_heads
    k32 = k.float().repeat_interleave(group, dim=1)
    sdpa = F.scaled_dot_product_attention(
        q.float()[:, :, None], k32, v.float().repeat_interleave(group, dim=1),
        attn_mask=attended[:, None, None, :], scale=scale,
    )[:, :, 0]
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k32) * scale
    torch_lse = torch.logsumexp(scores.masked_fill(~attended[:, None, :], -math.inf), dim=-1)
    assert relative_error(out, sdpa) <= max(tolerance, 1e-5)
    assert relative_error(lse, torch_lse) <= max(tolerance, 1e-5)
    if case["fused"]:
        assert_log_c(log_c, ref_log_c, kv_start, input_end, dtype)


@pytest.mark.parametrize("backend", backends("decode_attention"))
@pytest.mark.parametrize("dim_v, dtype", [(32, torch.float32), (96, torch.float32), (64, torch.bfloat16)])
def test_values_of_another_head_dimension_than_the_keys(backend, dim_v, dtype):
    """V's head dimension apart from q's and K's (as in DeepSeek-V2): out is (B, H, D_v). Triton's pass sized it and
    read V by K's dimension (D_v 32: half of each row from past it; D_v 96: a third of the output dropped)."""
    batch, heads, kv_heads, keys, dim = 2, 6, 2, 113, 128 if dtype == torch.bfloat16 else 64
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, dim_v, device=DEVICE, dtype=dtype)
    kv_start, input_end, kv_len = row_ranges(keys, batch)
    log_c = fresh_log_c(kv_start, input_end)
    ref_log_c = reference.macs_update_reference(q, k, log_c, input_start=kv_start, input_end=input_end,
                                                kv_len=kv_len, scale=dim ** -0.5)
    out, lse = ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=dim ** -0.5, log_c=log_c,
                                    input_end=input_end, backend=backend)
    ref_out, ref_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len,
                                                            scale=dim ** -0.5)
    assert out.shape == (batch, heads, dim_v) and out.dtype == dtype
    assert relative_error(out, ref_out) <= RELATIVE_ERROR[dtype]
    assert relative_error(lse, ref_lse) <= RELATIVE_ERROR[dtype]
    assert_log_c(log_c, ref_log_c, kv_start, input_end, dtype)
