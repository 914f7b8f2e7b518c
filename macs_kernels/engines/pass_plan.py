"""A generate pass's plan: which query rows it scores, where each attends, and the kernels that score them, read from
the pass's layout (engines.layout) and the generation's inputs (engines.sequences)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from macs_kernels.core.config import MacsConfig
from macs_kernels.core.plans import DenseRows
from macs_kernels.core.shards import HeadShards
from macs_kernels.engines.layout import PassLayout, row_ends
from macs_kernels.engines.sequences import Inputs
from macs_kernels.ops import registry
from macs_kernels.ops.registry import Kernels
from macs_kernels.ops.variant import PLAIN


@dataclasses.dataclass
class PassPlan:
    """One forward pass: the scored query rows (the last `rows` of the pass), their steps (B, R), each row's key end
    `kv_len` (B, R), the core's accumulator that scores them per layer (`fused`: decode computes the attention
    output too), whether the pass starts its sequences, and the attention of the layer in progress."""

    rows: int
    step: torch.Tensor
    kv_len: torch.Tensor
    scorer: DenseRows
    fused: bool
    prefill: bool
    variant: object = PLAIN


@dataclasses.dataclass(frozen=True)
class PassKeys:
    """What layer 0's mask says of a pass: its shape, the token of key slot 0 (`offset`, a window cache's), where
    each sequence's attended keys start and where its last query's end (B,), in token positions."""

    batch: int
    q_len: int
    slots: int
    offset: int
    start: torch.Tensor
    last_end: torch.Tensor

    @property
    def keys(self) -> int:
        return self.slots + self.offset


class PassPlanner:
    """Plans each pass of one traced model: its layout's reading, and the kernels of how the pass runs (an eager pass
    and a compiled one may run different ones: registry.default_backend)."""

    def __init__(self, config: MacsConfig, num_layers: int, device, variants: tuple[str, ...],
                 shards: HeadShards | None):
        self.config, self.num_layers = config, num_layers
        # Under tensor parallelism this rank pools its own heads; a pass's rows are reduced over the group.
        self.shards = shards
        self.layout = PassLayout("sliding_window" in variants)
        self._eager = functools.cache(functools.partial(registry.engine_kernels, config.backend, device, variants))
        self._compiled = functools.cache(functools.partial(registry.compiled_kernels, config.backend, device,
                                                           variants))
        self.kernels(compiled=False)  # a backend that cannot run here is refused at attach, before any work

    def kernels(self, compiled: bool) -> Kernels:
        return self._compiled() if compiled else self._eager(captured=False)

    def fuses(self) -> bool:
        """Whether decode steps compute the attention output with the backend's decode kernel (MacsConfig's
        fused_decode; None: where the eager backend is not torch). Softmax rows only."""
        fused = self.config.fused_decode
        if fused is None:
            fused = self._eager(captured=False).backend != "torch"
        return fused and self.config.attention == "softmax"

    def read(self, query: torch.Tensor, key: torch.Tensor, mask) -> PassKeys:
        """Layer 0's mask is over its own key slots; a window layer's slot j holds token j + offset."""
        batch, q_len, slots = query.shape[0], query.shape[2], key.shape[2]
        offset = self.layout.key_offset(0, slots)
        start = self.layout.attended(mask, batch, slots, key.device).int().argmax(-1).long() + offset
        last_end = row_ends(mask, batch, q_len, slots, 1, key.device)[:, 0] + offset
        return PassKeys(batch, q_len, slots, offset, start, last_end)

    def plan(self, keys: PassKeys, mask, rows: int, inputs: Inputs, *, prefill: bool, compiled: bool,
             beams: int) -> PassPlan:
        """The plan of a pass scoring its last `rows` queries for sequences with `inputs`."""
        device = keys.last_end.device
        if rows == 1:
            kv_len = keys.last_end[:, None]
        else:
            kv_len = row_ends(mask, keys.batch, keys.q_len, keys.slots, rows, device) + keys.offset
        # Every slot [0, S) attended by one row: an unpadded dynamic cache (the mask was dropped).
        dense = mask is None and rows == 1 and (keys.q_len == 1 or keys.q_len == keys.keys)
        # A verify pass of an unpadded batch whose rows attend every slot causally (one host sync per pass).
        causal_block = rows > 1 and inputs.unpadded and bool(
            (kv_len == torch.arange(keys.keys - rows + 1, keys.keys + 1, device=device)).all()
        )
        kernels = self.kernels(compiled)
        has_dense = kernels.pool_dense is not None
        config = self.config
        scorer = DenseRows(
            kernels, self.num_layers, input_start=inputs.start, input_end=inputs.end, kv_len=kv_len,
            n_max=max(inputs.counts), pooling=config.pooling, redistribute=config.redistribute, alpha=config.alpha,
            n_dense=inputs.counts[0] if has_dense and (dense or causal_block) else None, beams=beams,
            shards=self.shards,
        )
        verify_block = causal_block and has_dense and not self.layout.windowed
        fused = self.fuses() and not prefill and (keys.q_len == 1 or verify_block)
        return PassPlan(rows, kv_len - inputs.end[:, None], kv_len, scorer, fused, prefill)
