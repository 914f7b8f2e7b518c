"""ops.macs_pool (head-pooled rows before the floor, R query rows per sequence) and decode_attention's pooled
mode on every backend, against the float64 reference.

Ranges per row cover: left pads, a causal verify block (row r attends one key more than row r - 1), packed
requests (rows of one item with disjoint input ranges), unused cache slots past kv_len.
"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.grids import case_ids, pairwise
from tests.ops.cases import DEVICE, POOLINGS, backends
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def _verify_block_ranges(batch, rows, keys, generator):
    """(B, R) ranges of a verify pass: per item, pads, inputs, a causal block of R rows, free slots."""
    start = torch.randint(0, 5, (batch,), generator=generator)
    n_input = torch.randint(3, keys // 2, (batch,), generator=generator)
    generated = torch.randint(rows, rows + 6, (batch,), generator=generator)
    end = start + n_input
    last = (end + generated).clamp_max(keys)
    kv_len = last[:, None] - rows + 1 + torch.arange(rows)
    ranges = (start[:, None].expand(batch, rows), end[:, None].expand(batch, rows), kv_len)
    return (index.to(DEVICE) for index in ranges)


VERIFY_CASES = pairwise({
    "dtype": (torch.float32, torch.float16, torch.bfloat16), "heads": ((3, 1), (4, 2), (2, 2), (9, 3)),
    "pooling": POOLINGS, "redistribute": (True, False), "rows": (1, 4, 7), "shape": ((41, 16), (300, 64)),
})


@pytest.mark.parametrize("backend", backends("macs_pool"))
@pytest.mark.parametrize("case", VERIFY_CASES, ids=case_ids(VERIFY_CASES))
def test_macs_pool_verify_block_matches_reference(case, backend):
    (heads, kv_heads), rows, (keys, dim) = case["heads"], case["rows"], case["shape"]
    generator = torch.Generator().manual_seed(heads * 7 + kv_heads + rows)
    batch = 3
    q = torch.randn(batch, heads, rows, dim, generator=generator).to(case["dtype"]).to(DEVICE)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(case["dtype"]).to(DEVICE)
    k[:, :, -3:] = float("nan")  # slots past every kv_len: never read into a result
    start, end, kv_len = _verify_block_ranges(batch, rows, keys - 3, generator)
    options = dict(scale=dim ** -0.5, pooling=case["pooling"], redistribute=case["redistribute"])
    got = ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, backend=backend, **options)
    want = reference.macs_pool_reference(q, k, input_start=start, input_end=end, kv_len=kv_len, **options)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]
    n_input = (end - start).cpu()
    assert bool((got.cpu()[torch.arange(got.shape[-1]) >= n_input[..., None]] == 0).all())


@pytest.mark.parametrize("backend", backends("macs_pool"))
def test_macs_pool_packed_rows_of_one_item(backend):
    """Two requests packed in one key sequence: each row scores only its own request's keys."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 8, generator=generator).to(DEVICE)
    k = torch.randn(1, 1, 30, 8, generator=generator).to(DEVICE)
    start, end, kv_len = (torch.tensor(value, device=DEVICE) for value in ([[0, 12]], [[9, 25]], [[12, 30]]))
    got = ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, backend=backend)
    want = reference.macs_pool_reference(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3)
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]
    alone = ops.macs_pool(q[:, :, 1:], k[:, :, 12:], input_start=0, input_end=13, kv_len=18, scale=0.3,
                          backend=backend)
    torch.testing.assert_close(got[:, 1, :13], alone[:, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", backends("macs_pool"))
def test_macs_pool_single_row_equals_macs_update_at_alpha_one(backend):
    """With one row per item, log(m') is exactly the term macs_update adds at alpha = 1."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 16, generator=generator).to(DEVICE)
    k = torch.randn(2, 2, 37, 16, generator=generator).to(DEVICE)
    ranges = {name: torch.tensor(value, device=DEVICE) for name, value in
              (("input_start", [0, 4]), ("input_end", [20, 30]), ("kv_len", [33, 37]))}
    pooled = ops.macs_pool(q, k, scale=0.25, backend=backend, **ranges)
    log_c = torch.zeros(2, 26, device=DEVICE)
    ops.macs_update(q, k, log_c, scale=0.25, alpha=1.0, backend=backend, **ranges)
    assert pooled.shape == (2, 26)
    torch.testing.assert_close(pooled.log()[0, :20], log_c[0, :20], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled.log()[1], log_c[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", backends("macs_pool"))
def test_macs_pool_given_lse_and_out_buffer(backend):
    """The result lands in the given buffer, and a given lse is used as is, not recomputed."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 8, generator=generator).to(DEVICE)
    k = torch.randn(1, 1, 10, 8, generator=generator).to(DEVICE)
    ranges = dict(input_start=0, input_end=6, kv_len=torch.tensor([[8, 9, 10]], device=DEVICE), scale=0.5)
    scores = torch.einsum("bhrd,bsd->bhrs", q, k[:, 0]) * 0.5
    lse = torch.stack([scores[0, :, r, : 8 + r].logsumexp(-1) for r in range(3)], dim=-1)[None]
    out = torch.full((1, 3, 6), 5.0, device=DEVICE)
    assert ops.macs_pool(q, k, lse=lse, out=out, backend=backend, **ranges) is out
    assert relative_error(out, reference.macs_pool_reference(q, k, **ranges)) <= RELATIVE_ERROR[torch.float32]
    # Head 1's lse raised by 0.3: its probabilities (and generated mass) shrink by exp(-0.3).
    shifted = ops.macs_pool(q, k, lse=lse + torch.tensor([0.0, 0.3], device=DEVICE)[None, :, None], pooling="mean",
                            backend=backend, **ranges)
    per_head = [reference.macs_pool_reference(q[:, h:h + 1], k, **ranges) for h in range(2)]
    want = (per_head[0] + torch.exp(torch.tensor(-0.3, dtype=torch.float64)) * per_head[1]) / 2
    assert relative_error(shifted, want) <= RELATIVE_ERROR[torch.float32]


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


DECODE_POOLED_CASES = pairwise({
    "pooling": POOLINGS, "redistribute": (True, False), "dtype": (torch.float32, torch.bfloat16),
    "heads": ((6, 2), (8, 1)), "keys": (29, 300),
})


@pytest.mark.parametrize("backend", backends("decode_attention"))
@pytest.mark.parametrize("case", DECODE_POOLED_CASES, ids=case_ids(DECODE_POOLED_CASES))
def test_decode_attention_pooled_mode_equals_macs_pool(case, backend):
    """The fused decode op's pooled output is macs_pool's, and its attention output is unchanged by it."""
    generator = torch.Generator().manual_seed(4)
    (heads, kv_heads), keys, dtype = case["heads"], case["keys"], case["dtype"]
    q = torch.randn(2, heads, 16, generator=generator).to(dtype).to(DEVICE)
    k, v = (torch.randn(2, kv_heads, keys, 16, generator=generator).to(dtype).to(DEVICE) for _ in range(2))
    kv_start, input_end, kv_len = (torch.tensor(value, device=DEVICE) for value in
                                   ([0, 3], [20, keys // 2], [keys, keys - 2]))
    n_max = max(20, keys // 2 - 3)
    pooled = torch.full((2, n_max), 3.0, device=DEVICE)
    options = dict(kv_start=kv_start, kv_len=kv_len, scale=0.25, backend=backend)
    out, lse = ops.decode_attention(q, k, v, pooled=pooled, input_end=input_end, pooling=case["pooling"],
                                    redistribute=case["redistribute"], **options)
    plain, plain_lse = ops.decode_attention(q, k, v, **options)
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(lse, plain_lse)
    want = reference.macs_pool_reference(
        q[:, :, None], k, input_start=kv_start[:, None], input_end=input_end[:, None], kv_len=kv_len[:, None],
        scale=0.25, pooling=case["pooling"], redistribute=case["redistribute"],
    )[:, 0]
    assert relative_error(pooled, torch.nn.functional.pad(want, (0, n_max - want.shape[1]))) <= \
        RELATIVE_ERROR[torch.float32]
    with pytest.raises(ValueError, match="log_c or pooled"):
        ops.decode_attention(q, k, v, pooled=pooled, log_c=torch.zeros(2, n_max, device=DEVICE), input_end=input_end,
                             **options)


DENSE_CASES = pairwise({
    "heads": ((3, 1), (9, 3), (4, 4)), "pooling": POOLINGS, "redistribute": (True, False), "rows": (1, 2, 4),
    "shape": ((41, 16), (113, 64)), "batch": (1, 3),
})


@pytest.mark.parametrize("case", DENSE_CASES, ids=case_ids(DENSE_CASES))
def test_torch_dense_rows_equal_the_reference_over_every_causal_slot(case):
    """The torch tracer's launch-light paths for unpadded batches (inputs [0, N), row r of R attends
    [0, S - R + 1 + r); R = 1 as (B, H, D)), pooled rows and the fused attention output, against the float64
    references with those ranges."""
    from macs_kernels.ops.torch import backend as torch_backend

    (heads, kv_heads), rows, (keys, dim), batch = case["heads"], case["rows"], case["shape"], case["batch"]
    generator = torch.Generator().manual_seed(keys + rows + heads)
    q = torch.randn(batch, heads, rows, dim, generator=generator)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    v = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    n_input = keys - rows - 5
    kv_len = (keys - rows + 1 + torch.arange(rows)).expand(batch, rows)
    options = dict(scale=dim ** -0.5, pooling=case["pooling"], redistribute=case["redistribute"])
    want = reference.macs_pool_reference(q, k, input_start=torch.zeros_like(kv_len),
                                         input_end=torch.full_like(kv_len, n_input), kv_len=kv_len, **options)
    want_out = torch.stack([
        reference.decode_attention_reference(q[:, :, r], k, v, kv_start=0, kv_len=int(kv_len[0, r]),
                                             scale=options["scale"])[0] for r in range(rows)
    ], dim=2)
    block = (lambda x: x[:, :, 0]) if rows == 1 else (lambda x: x)
    for fused in (False, True):
        got = torch.full((batch, rows, n_input + 2), float("nan"))  # columns past N are zeroed
        pooled = got[:, 0] if rows == 1 else got
        if fused:
            out = torch_backend.decode_attention_dense(block(q), k, v, pooled, n_input=n_input, **options)
            assert relative_error(out, block(want_out)) <= RELATIVE_ERROR[torch.float32]
        else:
            torch_backend.macs_pool_dense(block(q), k, pooled, n_input=n_input, **options)
        assert relative_error(got[..., :n_input], want) <= RELATIVE_ERROR[torch.float32]
        assert bool((got[..., n_input:] == 0).all())
