"""ops.macs_pool (head-pooled rows before the floor, R query rows per sequence) against the float64 reference.

Ranges per row cover: left pads, a causal verify block (row r attends one key more than row r - 1), packed
requests (rows of one item with disjoint input ranges), unused cache slots past kv_len.
"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops, reference
from tests.tolerances import RELATIVE_ERROR, relative_error


def _verify_block_ranges(batch, rows, keys, generator):
    """(B, R) ranges of a verify pass: per item, pads, inputs, a causal block of R rows, free slots."""
    start = torch.randint(0, 5, (batch,), generator=generator)
    n_input = torch.randint(3, 20, (batch,), generator=generator)
    generated = torch.randint(rows, rows + 6, (batch,), generator=generator)
    end = start + n_input
    last = (end + generated).clamp_max(keys)
    kv_len = last[:, None] - rows + 1 + torch.arange(rows)
    return start[:, None].expand(batch, rows), end[:, None].expand(batch, rows), kv_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("pooling", ["max", "mean", "min"])
@pytest.mark.parametrize("redistribute", [True, False])
def test_macs_pool_verify_block_matches_reference(dtype, heads, kv_heads, pooling, redistribute):
    generator = torch.Generator().manual_seed(heads * 7 + kv_heads)
    batch, rows, keys, dim = 3, 4, 41, 16
    q = torch.randn(batch, heads, rows, dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(dtype)
    start, end, kv_len = _verify_block_ranges(batch, rows, keys, generator)
    got = ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=dim ** -0.5, pooling=pooling,
                        redistribute=redistribute, backend="torch")
    want = reference.macs_pool_reference(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=dim ** -0.5,
                                         pooling=pooling, redistribute=redistribute)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]
    n_input = end - start
    assert bool((got[torch.arange(got.shape[-1]) >= n_input[..., None]] == 0).all())


def test_macs_pool_packed_rows_of_one_item():
    """Two requests packed in one key sequence: each row scores only its own request's keys."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 8, generator=generator)
    k = torch.randn(1, 1, 30, 8, generator=generator)
    start, end, kv_len = torch.tensor([[0, 12]]), torch.tensor([[9, 25]]), torch.tensor([[12, 30]])
    got = ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, backend="torch")
    want = reference.macs_pool_reference(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3)
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]
    alone = ops.macs_pool(q[:, :, 1:], k[:, :, 12:], input_start=0, input_end=13, kv_len=18, scale=0.3, backend="torch")
    torch.testing.assert_close(got[:, 1, :13], alone[:, 0], rtol=1e-6, atol=1e-7)


def test_macs_pool_single_row_equals_macs_update_at_alpha_one():
    """With one row per item, log(m') is exactly the term macs_update adds at alpha = 1."""
    generator = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 6, 16, generator=generator), torch.randn(2, 2, 37, 16, generator=generator)
    ranges = dict(input_start=torch.tensor([0, 4]), input_end=torch.tensor([20, 30]), kv_len=torch.tensor([33, 37]))
    pooled = ops.macs_pool(q, k, scale=0.25, backend="torch", **ranges)
    log_c = torch.zeros(2, 26)
    ops.macs_update(q, k, log_c, scale=0.25, alpha=1.0, backend="torch", **ranges)
    assert pooled.shape == (2, 26)
    torch.testing.assert_close(pooled.log()[0, :20], log_c[0, :20], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled.log()[1], log_c[1], rtol=1e-5, atol=1e-6)


def test_macs_pool_given_lse_and_out_buffer():
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 3, 8, generator=generator), torch.randn(1, 1, 10, 8, generator=generator)
    kv_len = torch.tensor([[8, 9, 10]])
    scores = torch.einsum("bhrd,bsd->bhrs", q, k[:, 0]) * 0.5
    lse = torch.stack([scores[0, :, r, : 8 + r].logsumexp(-1) for r in range(3)], dim=-1)[None]
    out = torch.full((1, 3, 6), 5.0)
    result = ops.macs_pool(q, k, input_start=0, input_end=6, kv_len=kv_len, scale=0.5, lse=lse, out=out, backend="torch")
    assert result is out
    want = reference.macs_pool_reference(q, k, input_start=0, input_end=6, kv_len=kv_len, scale=0.5)
    assert relative_error(out, want) <= RELATIVE_ERROR[torch.float32]


@pytest.mark.parametrize("bad,message", [
    (dict(kv_len=torch.tensor([[5, 40]])), "kv_len"),
    (dict(input_end=torch.tensor([0])), "input_start < input_end"),
    (dict(input_start=torch.tensor([[0, 0, 0]])), r"shape \(1,\) or \(1, 2\)"),
    (dict(out=torch.zeros(1, 2, 3)), "fit out's 3 columns"),
    (dict(out=torch.zeros(2, 5)), "out must be"),
    (dict(lse=torch.zeros(1, 2)), "lse must be"),
])
def test_macs_pool_rejects_bad_arguments(bad, message):
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 10, 8)
    arguments = dict(input_start=0, input_end=5, kv_len=torch.tensor([[9, 10]]), scale=1.0, backend="torch") | bad
    with pytest.raises((ValueError, TypeError), match=message):
        ops.macs_pool(q, k, **arguments)


@pytest.mark.parametrize("pooling", ["max", "mean"])
def test_decode_attention_pooled_mode_equals_macs_pool(pooling):
    """The fused decode op's pooled output is macs_pool's, and its attention output is unchanged by it."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 16, generator=generator)
    k, v = torch.randn(2, 2, 29, 16, generator=generator), torch.randn(2, 2, 29, 16, generator=generator)
    kv_start, input_end, kv_len = torch.tensor([0, 3]), torch.tensor([20, 15]), torch.tensor([29, 27])
    pooled = torch.full((2, 20), 3.0)
    out, lse = ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.25, pooled=pooled,
                                    input_end=input_end, pooling=pooling, backend="torch")
    plain, plain_lse = ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.25, backend="torch")
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(lse, plain_lse)
    want = reference.macs_pool_reference(q[:, :, None], k, input_start=kv_start[:, None], input_end=input_end[:, None],
                                         kv_len=kv_len[:, None], scale=0.25, pooling=pooling)[:, 0]
    assert relative_error(pooled, want) <= RELATIVE_ERROR[torch.float32]
    with pytest.raises(ValueError, match="log_c or pooled"):
        ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.25, pooled=pooled,
                             log_c=torch.zeros(2, 20), input_end=input_end, backend="torch")
