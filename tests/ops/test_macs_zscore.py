"""ops.macs_zscore on every backend against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.grids import case_ids, pairwise
from tests.ops.cases import (
    BATCHES,
    DEVICE,
    backends,
)
from tests.tolerances import RELATIVE_ERROR, relative_error

# The Triton interpreter evaluates both sides of tl.where: log(0) and 1/0 there are expected and unused.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


ZSCORE_CASES = pairwise({
    "n_max": (1, 113, 1023, 5000), "batch": BATCHES, "kind": ("random", "constant", "all -inf", "some -inf"),
})


@pytest.mark.parametrize("backend", backends("macs_zscore"))
@pytest.mark.parametrize("case", ZSCORE_CASES, ids=case_ids(ZSCORE_CASES))
def test_macs_zscore(case, backend):
    batch, n_max = case["batch"], case["n_max"]
    n_input = torch.tensor([n_max, max(1, n_max // 3), max(1, n_max - 7)][:batch], device=DEVICE)
    log_c = 3 * torch.randn(batch, n_max, device=DEVICE) - 40  # far from 0: only exp(log_c - max) is safe
    if case["kind"] == "constant":
        log_c[0] = -12.5
    elif case["kind"] == "all -inf":
        log_c[0] = float("-inf")
    elif case["kind"] == "some -inf":
        log_c[:, ::5] = float("-inf")
    got = ops.macs_zscore(log_c, n_input, backend=backend).cpu()
    ref = reference.macs_zscore_reference(log_c.cpu(), n_input.cpu())
    zero_rows = (ref == 0).all(dim=1)  # std 0 or all -inf: exact zeros expected
    assert torch.equal(zero_rows, (got == 0).all(dim=1))
    if case["kind"] in ("constant", "all -inf") or n_max == 1:
        assert bool(zero_rows[0])
    if not zero_rows.all():
        assert relative_error(got[~zero_rows], ref[~zero_rows]) <= RELATIVE_ERROR[torch.float32]
