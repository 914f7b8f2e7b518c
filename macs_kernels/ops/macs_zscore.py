"""macs_zscore: the paper's z-scores of c = exp(log_c) over each row's inputs."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import IndexLike, as_index, check_log_c, check_tensor, invalid_entry, values_to_check
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import backend as torch_backend


def _fake(log_c: torch.Tensor, n_input: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(log_c, memory_format=torch.contiguous_format)


operator = define_operator(torch_backend.macs_zscore, fake=_fake)


def macs_zscore(log_c: torch.Tensor, n_input: IndexLike, *, backend: str | None = None,
                validate: bool | None = None) -> torch.Tensor:
    """z-scores of c = exp(log_c) per row over its first n_input[b] entries; zeros after.

    log_c: (B, N_max) float32; n_input: (B,). Returns (B, N_max) float32. Computed as exp(log_c - max)
    (z does not change when c is scaled), with the population standard deviation; a row whose standard
    deviation is 0, or whose entries are all -inf, gets zeros.
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    """
    check_tensor("log_c", log_c, 2)
    check_log_c(log_c, log_c.shape[0], log_c.device)
    n_input = as_index("n_input", n_input, log_c.shape[0], log_c.device)
    values = values_to_check(validate, n_input)
    rule = f"n_input must lie in [1, {log_c.shape[1]}]"
    if values is not None and invalid_entry((values[0] >= 1) & (values[0] <= log_c.shape[1]), rule) is not None:
        raise ValueError(f"{rule}, got {values[0].tolist()}")
    return kernel(backend, log_c.device, "macs_zscore")(log_c, n_input)
