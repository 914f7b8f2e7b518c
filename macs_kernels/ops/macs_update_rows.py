"""macs_update_rows: macs_update from given attention rows (efficient attention, other tools) instead of q, K."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    DEFAULT_ALPHA,
    IndexLike,
    as_index,
    check_log_c,
    check_options,
    check_ranges,
    check_tensor,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import backend as torch_backend

operator = define_operator(torch_backend.macs_update_rows, mutates_args=("log_c",))


def macs_update_rows(
    rows: torch.Tensor, log_c: torch.Tensor, *, input_start: IndexLike, input_end: IndexLike, kv_len: IndexLike,
    alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True, backend: str | None = None,
    validate: bool | None = None,
) -> None:
    """`macs_update` from given attention rows (B, H, S) instead of q and K.

    rows: (B, H, S), any float dtype; entries outside [input_start, kv_len) are ignored. Rows may be signed
        (efficient attention): a negative pooled value is clamped to 0 before the floor.
    log_c: (B, N_max) float32, updated in place as in macs_update.
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    """
    check_options(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_tensor("rows", rows, 3)
    batch = rows.shape[0]
    check_log_c(log_c, batch, rows.device)
    input_start, input_end, kv_len = (
        as_index(name, value, batch, rows.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    )
    check_ranges(input_start, input_end, kv_len, rows.shape[2], log_c.shape[1], validate=validate)
    kernel(backend, rows.device, "macs_update_rows")(
        rows, log_c, input_start, input_end, kv_len, float(alpha), pooling, bool(redistribute)
    )
