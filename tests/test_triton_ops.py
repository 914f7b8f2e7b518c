"""Triton backend of the ops against the float64 references (and decode_attention against torch's SDPA).

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py), so the grids
are pairwise coverings, not full products: every pair of values of any two factors appears in a case.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from macs_kernels import ops, reference
from tests.tolerances import RELATIVE_ERROR, relative_error

triton_backend = pytest.importorskip("macs_kernels.ops.triton")
# The interpreter evaluates both sides of tl.where: log(0) and 1/0 there are expected and unused.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SEQUENCES = (1, 113, 1023)
HEAD_DIMS = (64, 128)
HEADS = ((2, 2), (3, 1), (8, 2), (8, 1))  # H:H_kv = 1:1, 3:1, 4:1, 8:1
BATCHES = (1, 3)
POOLINGS = ("max", "mean", "min")
ALPHAS = (0.2, 0.8, 1.0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXTRA_COLUMNS = 3  # log_c columns past every row's N_b: they must come back untouched
SENTINEL = 7.25


def pairwise(factors: dict) -> list[dict]:
    """Greedy all-pairs covering, deterministic: each case starts from the first uncovered pair and
    takes, factor by factor, the value that covers most still-uncovered pairs (first value on ties)."""
    names = list(factors)
    sizes = [len(factors[name]) for name in names]
    uncovered = [
        (i, vi, j, vj)
        for i, j in itertools.combinations(range(len(names)), 2)
        for vi in range(sizes[i]) for vj in range(sizes[j])
    ]
    cases = []
    while uncovered:
        i, vi, j, vj = uncovered[0]
        chosen = {i: vi, j: vj}
        for k in range(len(names)):
            if k not in chosen:
                gain = [
                    sum((min(k, m), v if k < m else chosen[m], max(k, m), chosen[m] if k < m else v) in uncovered
                        for m in chosen)
                    for v in range(sizes[k])
                ]
                chosen[k] = gain.index(max(gain))
        uncovered = [
            pair for pair in uncovered if not (chosen[pair[0]] == pair[1] and chosen[pair[2]] == pair[3])
        ]
        cases.append({names[k]: factors[names[k]][chosen[k]] for k in range(len(names))})
    return cases


def _ids(cases):
    def short(value):
        return str(value).replace("torch.", "").replace(" ", "")
    return ["-".join(f"{name}={short(value)}" for name, value in case.items()) for case in cases]


def test_pairwise_covers_every_pair_with_few_cases():
    factors = {"a": (1, 2, 3), "b": "xy", "c": (True, False), "d": (0.1, 0.2, 0.3, 0.4)}
    cases = pairwise(factors)
    for first, second in itertools.combinations(factors, 2):
        seen = {(case[first], case[second]) for case in cases}
        assert seen == set(itertools.product(factors[first], factors[second]))
    assert len(cases) < len(list(itertools.product(*factors.values())))
    assert cases == pairwise(factors)


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
    as_index = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    return as_index(start), as_index(end), as_index(length)


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
    # alpha = 1 with a pooled value of exactly 0 (clamped negative rows) gives log 0 = -inf on both sides.
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


UPDATE_CASES = pairwise({
    "keys": SEQUENCES, "dim": HEAD_DIMS, "heads": HEADS, "batch": BATCHES, "with_lse": (False, True),
    "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False), "dtype": DTYPES,
})


@pytest.mark.parametrize("case", UPDATE_CASES, ids=_ids(UPDATE_CASES))
def test_macs_update(case):
    heads, kv_heads = case["heads"]
    q, k = random_qk(case["batch"], heads, kv_heads, case["keys"], case["dim"], case["dtype"])
    input_start, input_end, kv_len = row_ranges(case["keys"], case["batch"])
    log_c = fresh_log_c(input_start, input_end)
    scale = case["dim"] ** -0.5
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    ref = reference.macs_update_reference(
        q, k, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale, **options
    )
    lse = reference_lse(q, k, input_start, kv_len, scale) if case["with_lse"] else None
    ops.macs_update(q, k, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale,
                    lse=lse, backend="triton", **options)
    assert_log_c(log_c, ref, input_start, input_end, case["dtype"])


ROWS_CASES = pairwise({
    "keys": SEQUENCES, "heads": (2, 3, 8, 9), "batch": BATCHES, "signed": (False, True),
    "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False), "dtype": DTYPES,
})


@pytest.mark.parametrize("case", ROWS_CASES, ids=_ids(ROWS_CASES))
def test_macs_update_rows(case):
    """Softmax rows, or signed rows like efficient attention's (whose pooled value can fall below 0)."""
    batch, heads, keys = case["batch"], case["heads"], case["keys"]
    rows = torch.rand(batch, heads, keys, device=DEVICE) / keys
    if case["signed"]:
        rows = rows - 1.5 / keys
    rows = rows.to(case["dtype"])
    input_start, input_end, kv_len = row_ranges(keys, batch)
    log_c = fresh_log_c(input_start, input_end)
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    ref = reference.macs_update_rows_reference(
        rows, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, **options
    )
    ops.macs_update_rows(rows, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len,
                         backend="triton", **options)
    assert_log_c(log_c, ref, input_start, input_end, case["dtype"])


ZSCORE_CASES = pairwise({
    "n_max": (1, 113, 1023, 5000), "batch": BATCHES, "kind": ("random", "constant", "all -inf", "some -inf"),
})


@pytest.mark.parametrize("case", ZSCORE_CASES, ids=_ids(ZSCORE_CASES))
def test_macs_zscore(case):
    batch, n_max = case["batch"], case["n_max"]
    n_input = torch.tensor([n_max, max(1, n_max // 3), max(1, n_max - 7)][:batch], device=DEVICE)
    log_c = 3 * torch.randn(batch, n_max, device=DEVICE) - 40  # far from 0: only exp(log_c - max) is safe
    if case["kind"] == "constant":
        log_c[0] = -12.5
    elif case["kind"] == "all -inf":
        log_c[0] = float("-inf")
    elif case["kind"] == "some -inf":
        log_c[:, ::5] = float("-inf")
    got = ops.macs_zscore(log_c, n_input, backend="triton").cpu()
    ref = reference.macs_zscore_reference(log_c.cpu(), n_input.cpu())
    zero_rows = (ref == 0).all(dim=1)  # std 0 or all -inf: exact zeros expected
    assert torch.equal(zero_rows, (got == 0).all(dim=1))
    if case["kind"] in ("constant", "all -inf") or n_max == 1:
        assert bool(zero_rows[0])
    if not zero_rows.all():
        assert relative_error(got[~zero_rows], ref[~zero_rows]) <= RELATIVE_ERROR[torch.float32]


DECODE_CASES = pairwise({
    "keys": SEQUENCES, "dim": HEAD_DIMS, "heads": HEADS, "batch": BATCHES, "dtype": DTYPES,
    "fused": (True, False), "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False),
    "strided_q": (True, False),
})


@pytest.mark.parametrize("case", DECODE_CASES, ids=_ids(DECODE_CASES))
def test_decode_attention(case):
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
        input_end=input_end if case["fused"] else None, backend="triton", **options,
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


def test_macs_update_uses_the_given_lse():
    """A given lse is used as is (p = exp(s - lse)), not recomputed: here it is off by a per-head shift."""
    q, k = random_qk(3, 8, 2, 113, 64, torch.float32)
    input_start, input_end, kv_len = row_ranges(113, 3)
    scale = 0.125
    lse = reference_lse(q, k, input_start, kv_len, scale) + torch.linspace(-0.5, 0.5, 8, device=DEVICE)
    group = 4
    rows = torch.zeros(3, 8, 113, dtype=torch.float64)
    for b, (s, n) in enumerate(zip(input_start.tolist(), kv_len.tolist())):
        for h in range(8):
            scores = (k[b, h // group, s:n].double() @ q[b, h].double()) * scale
            rows[b, h, s:n] = torch.exp(scores - lse[b, h].double())
    log_c = fresh_log_c(input_start, input_end)
    ref = reference.macs_update_rows_reference(rows, log_c, input_start=input_start, input_end=input_end,
                                               kv_len=kv_len)
    ops.macs_update(q, k, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale,
                    lse=lse, backend="triton")
    assert_log_c(log_c, ref, input_start, input_end, torch.float32)


def test_launch_counter_counts_each_kernel():
    counts = triton_backend.LAUNCHES
    before = counts.copy()
    q, k = random_qk(1, 3, 1, 113, 64, torch.float32)
    log_c = torch.zeros(1, 50, device=DEVICE)
    ops.decode_attention(q, k, k, kv_len=113, scale=0.125, log_c=log_c, input_end=50, backend="triton")
    ops.macs_update(q, k, log_c, input_start=0, input_end=50, kv_len=113, scale=0.125, backend="triton")
    ops.macs_update_rows(torch.rand(1, 3, 113, device=DEVICE), log_c, input_start=0, input_end=50, kv_len=113,
                         backend="triton")
    ops.macs_zscore(log_c, [50], backend="triton")
    assert counts - before == {
        "_decode_split_kernel": 2, "_decode_combine_kernel": 2, "_macs_pool_kernel": 3,
        "_generated_mass_kernel": 1, "_macs_zscore_kernel": 1,
    }
