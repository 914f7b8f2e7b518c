"""ops.macs_update on every backend against the float64 reference (pairwise grid of shapes and options)."""
from __future__ import annotations

import pytest
import torch

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
    random_qk,
    reference_lse,
    row_ranges,
)

# The Triton interpreter evaluates both sides of tl.where: log(0) and 1/0 there are expected and unused.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


UPDATE_CASES = pairwise({
    "keys": SEQUENCES, "dim": HEAD_DIMS, "heads": HEADS, "batch": BATCHES, "with_lse": (False, True),
    "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False), "dtype": DTYPES,
})


@pytest.mark.parametrize("backend", backends("macs_update"))
@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_ids(UPDATE_CASES))
def test_macs_update(case, backend):
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
                    lse=lse, backend=backend, **options)
    assert_log_c(log_c, ref, input_start, input_end, case["dtype"])


@pytest.mark.parametrize("backend", backends("macs_update"))
def test_macs_update_uses_the_given_lse(backend):
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
                    lse=lse, backend=backend)
    assert_log_c(log_c, ref, input_start, input_end, torch.float32)
