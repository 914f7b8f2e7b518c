"""One forward pass's MACS rows after the per-layer scoring: the head-pooling reduction over a tensor-parallel group,
the floor and log, the combine over layers, the NaN check. The row plans (core.plans) write each layer's pooled
rows into it; which kernels they run comes from ops.registry.
"""
from __future__ import annotations

import torch

from macs_kernels.core.shards import HeadShards, reduce_pooled
from macs_kernels.ops.torch.backend import log_floor


class PassRows:
    """The pooled rows m' (before the floor) of one pass, (L, *shape, N_max) float32, and their combine.

    shards: the tensor-parallel split of the heads (each rank pools its own heads; `finish` reduces them
    in one collective per pass), or None.
    """

    def __init__(self, num_layers: int, shape: tuple[int, ...], n_max: int, device, shards: HeadShards | None):
        self.pooled = torch.empty(num_layers, *shape, n_max, dtype=torch.float32, device=device)
        self.shards = shards

    def finish(self, alpha, pooling, n_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log c (*shape, N_max) float32, 0 past each row's N; which rows hold a NaN, (*shape) bool).

        alpha: a float, or one per row (*shape); pooling: a name, or one per row (a flat list) when rows
        of one pass pool differently; n_input: (*shape) or broadcastable, each row's N.
        """
        pooled = self.pooled
        if self.shards is not None:
            if isinstance(pooling, str):
                reduce_pooled(pooled, self.shards, pooling)
            else:
                flat = pooled.view(pooled.shape[0], -1, pooled.shape[-1])
                for name in sorted(set(pooling)):
                    index = torch.tensor([r for r, p in enumerate(pooling) if p == name], device=pooled.device)
                    flat.index_copy_(1, index, reduce_pooled(flat.index_select(1, index), self.shards, name))
        if isinstance(alpha, torch.Tensor):
            alpha = alpha.unsqueeze(-1)
        # Entries past a row's N may hold anything (even NaN from unwritten memory): they are masked after.
        log_c = log_floor(pooled, alpha).sum(dim=0)
        valid = torch.arange(log_c.shape[-1], device=log_c.device) < n_input.unsqueeze(-1)
        log_c.masked_fill_(~valid, 0.0)
        return log_c, torch.isnan(log_c).any(dim=-1)
