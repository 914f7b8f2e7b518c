"""ops.macs_update_rows on every backend against the float64 reference."""
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
    POOLINGS,
    SEQUENCES,
    assert_log_c,
    backends,
    fresh_log_c,
    row_ranges,
)

# The Triton interpreter evaluates both sides of tl.where: log(0) and 1/0 there are expected and unused.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


ROWS_CASES = pairwise({
    "keys": SEQUENCES, "heads": (2, 3, 8, 9), "batch": BATCHES, "signed": (False, True),
    "pooling": POOLINGS, "alpha": ALPHAS, "redistribute": (True, False), "dtype": DTYPES,
})


@pytest.mark.parametrize("backend", backends("macs_update_rows"))
@pytest.mark.parametrize("case", ROWS_CASES, ids=case_ids(ROWS_CASES))
def test_macs_update_rows(case, backend):
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
                         backend=backend, **options)
    assert_log_c(log_c, ref, input_start, input_end, case["dtype"])
