"""The decode steps of a compiled static-cache generation, traced as one graph per step.

transformers compiles a static-cache `generate`'s decode step (on an accelerator, reduce-overhead: CUDA graph trees).
Plain generate compiles it into one frame with no graph break; so must an attributed step, for any number of layers:
a break inside the attention forward would make dynamo compile that forward once per layer (it guards on
`layer_idx`) and stop at its recompile limit. So the step's MACS state follows the static cache's discipline:

- it lives in buffers allocated eagerly at the prefill, beside the cache, and marked as static addresses
  (`torch._dynamo.mark_static_address`, as StaticCache marks its keys and values), so that CUDA graph trees
  neither skip the graph for its mutated inputs nor hand back an output a later replay overwrites;
- each step updates them in place: its keys' ends come from the attention mask (a device tensor, as
  `cache_position` is), each layer pools into its slot of `pooled`, the last layer floors, sums over layers and
  writes the step's log c into its row of `rows` and any NaN into `broken`;
- the host reads them after generate (or a streaming reader between steps), never inside a step.

A later generation whose shapes fit reuses the buffers (as generate reuses its static cache), so its steps replay
the graph compiled before instead of recompiling.
"""
from __future__ import annotations

import torch

from macs_kernels.core.plans import DenseRows
from macs_kernels.engines.layout import row_ends
from macs_kernels.ops.registry import Kernels


class CapturedSteps:
    """MACS state of the decode steps of one compiled static-cache generation of `batch` sequences: rows
    (B, max_rows, n_max) float32 log c (row k of sequence b at [b, k]; row 0, the prefill's, stays the eager pass's),
    `written` (B, max_rows) which rows a step wrote, `broken` whether a step's row held a NaN."""

    def __init__(self, kernels: Kernels, num_layers: int, *, batch: int, n_max: int, max_rows: int, device,
                 alpha: float, pooling: str, redistribute: bool, fused: bool):
        index = dict(dtype=torch.int64, device=device)
        self.input_start, self.input_end = torch.zeros(batch, **index), torch.zeros(batch, **index)
        self.kv_len = torch.zeros(batch, 1, **index)
        self.scorer = DenseRows(kernels, num_layers, input_start=self.input_start, input_end=self.input_end,
                                kv_len=self.kv_len, n_max=n_max, pooling=pooling, redistribute=redistribute,
                                alpha=alpha)
        self.rows = torch.zeros(batch, max_rows, n_max, dtype=torch.float32, device=device)
        self.written = torch.zeros(batch, max_rows, dtype=torch.bool, device=device)
        self.broken = torch.zeros((), dtype=torch.bool, device=device)
        self.fused, self.last_layer = fused, num_layers - 1
        self.made_for = dict(kernels=kernels, num_layers=num_layers, batch=batch, n_max=n_max, max_rows=max_rows,
                             device=torch.device(device), alpha=alpha, pooling=pooling, redistribute=redistribute,
                             fused=fused)
        for buffer in (self.input_start, self.input_end, self.kv_len, self.scorer.pooled, self.rows, self.written,
                       self.broken):
            torch._dynamo.mark_static_address(buffer)

    @classmethod
    def reuse_or_allocate(cls, previous: CapturedSteps | None, **made_for) -> CapturedSteps:
        """`previous` when it was made for these arguments (its graph replays), else new buffers."""
        made_for["device"] = torch.device(made_for["device"])
        if previous is not None and previous.made_for == made_for:
            return previous
        return cls(**made_for)

    def start(self, input_start: torch.Tensor, input_end: torch.Tensor) -> None:
        """A generation starts (eagerly, at its prefill): its sequences' input ranges, no rows yet."""
        self.input_start.copy_(input_start)
        self.input_end.copy_(input_end)
        self.written.zero_()
        self.broken.zero_()

    def attention(self, layer: int, query, key, value, mask, scale: float, variant, inner, fusable: bool):
        """The attention output of `layer` in a decode step (`inner()`: the wrapped implementation's; a fused step,
        where the call allows it (`fusable`), computes it from the probabilities it pools), after pooling its MACS
        row. Tensor operations only."""
        if layer == 0:
            if mask is None:
                raise NotImplementedError("a compiled static-cache step without an attention mask: the tracer reads "
                                          "each step's keys from the mask")
            self.kv_len.copy_(row_ends(mask, query.shape[0], 1, key.shape[2], 1, key.device))
        if self.fused and fusable:
            result = (self.scorer.decode(layer, query, key, value, scale, variant), None)
        else:
            result = inner()
            self.scorer.pool(layer, query, key, scale, variant)
        if layer == self.last_layer:
            self._store_step()
        return result

    def _store_step(self) -> None:
        log_c, broken = self.scorer.finish()
        batch, max_rows = self.written.shape
        # Row k of a sequence is its query at slot input_end - 1 + k; generate never steps past the cache.
        step = (self.kv_len[:, 0] - self.input_end).clamp(0, max_rows - 1)
        items = torch.arange(batch, device=step.device)
        self.rows.index_put_((items, step), log_c[:, 0])
        self.written.index_put_((items, step), torch.ones_like(step, dtype=torch.bool))
        self.broken.logical_or_(broken.any())
