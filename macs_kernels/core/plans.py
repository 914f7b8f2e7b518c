"""Row plans: where each scored row of a pass attends, for the three cache layouts engines hand over, behind one
protocol (`RowPlan`). A plan scores each layer once (`pool`, or `decode`, which also returns the attention output
from the same probabilities) with the layer's `Variant` (window, softcap, sinks); the layouts differ only in how
keys are gathered:

- `DenseRows`: a batch-major cache with per-row ranges (transformers' generate);
- `PackedRows`: a packed key tensor with per-row segments (continuous batching); `gather`: a window layer's
  segments;
- `PagedRows`: a paged cache read through a block table (vLLM's); `gather`: the plan of a layer's own table.

After the last layer `finish` (core.accumulate.PassRows) gives the pass's log c. Engines hold no formula of their
own; the kernels come from ops.registry (`Kernels`).
"""
from __future__ import annotations

import functools
from typing import Protocol

import torch

from macs_kernels.core.accumulate import PassRows
from macs_kernels.core.shards import HeadShards
from macs_kernels.ops.registry import Kernels
from macs_kernels.ops.torch.backend import _POOL
from macs_kernels.ops.torch.packed import Pages, Segments
from macs_kernels.ops.variant import PLAIN, Variant


class RowPlan(Protocol):
    """A pass's scored rows over one cache layout. `query`: the layer's query in the layout's shape (the plan
    picks its scored rows); `keys`: the layer's keys in the layout's shape; `variant`: the layer's attention;
    `gather`: how this layer's keys are found when that differs from the pass's plan (None: the pass's)."""

    pooled: torch.Tensor  # (L, *rows, N_max) float32: each layer's m'

    def pool(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float, variant: Variant = PLAIN,
             gather=None) -> None:
        """m' of the scored rows into layer `layer` of `pooled`."""

    def decode(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               variant: Variant = PLAIN, gather=None) -> torch.Tensor:
        """`pool`, and the attention output of every query row from the same probabilities."""

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log c, which rows hold a NaN) of the pass."""


class DenseRows(PassRows):
    """Rows of a batch-major pass (transformers' generate): the scored queries are the last R of each item's
    query block; row (b, r) attends keys [input_start[b], kv_len[b, r]) of the (B, H_kv, S, D) cache, the
    first N_b = input_end[b] - input_start[b] of them its inputs.

    n_dense: set when every item's inputs are keys [0, n_dense) and its rows attend every slot causally
    (an unpadded batch with a growing cache): the backend's dense kernels then run without masks or gathers.
    beams: with n_dense, each run of `beams` items shares its input keys (beam search); the torch kernels
    read them once per run.
    """

    def __init__(self, kernels: Kernels, num_layers: int, *, input_start, input_end, kv_len, n_max: int,
                 pooling: str, redistribute: bool, alpha: float, n_dense: int | None = None, beams: int = 1,
                 shards: HeadShards | None = None):
        batch, rows = kv_len.shape
        super().__init__(num_layers, (batch, rows), n_max, kv_len.device, shards)
        self.kernels, self.alpha, self.n_dense = kernels, alpha, n_dense
        self.options = dict(pooling=pooling, redistribute=redistribute)
        self.input_start, self.input_end, self.kv_len = input_start, input_end, kv_len
        self.pool_dense, self.decode_dense = kernels.pool_dense, kernels.decode_dense
        if n_dense is not None and beams > 1 and kernels.pool_dense_beams is not None:
            self.pool_dense = functools.partial(kernels.pool_dense_beams, beams=beams)
            self.decode_dense = functools.partial(kernels.decode_dense_beams, beams=beams)

    def pool(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float, variant: Variant = PLAIN,
             gather=None) -> None:
        """m' of the scored rows, the last R of query (B, H, T, D), over keys (B, H_kv, S, D) into this pass's layer
        `layer`; `variant`: the layer's own attention (window, softcap, sinks). A dense cache's keys are the
        layer's own: `gather` must be None."""
        _no_gather(gather)
        rows = self.kv_len.shape[1]
        q_rows = query[:, :, -rows:, :]
        if not variant.plain:
            ranges, extra = variant.key_slots(self.input_start[:, None].expand(-1, rows),
                                              self.input_end[:, None].expand(-1, rows), self.kv_len)
            self.kernels.pool(q_rows, keys, self.pooled[layer], *ranges, scale, self.options["pooling"],
                              self.options["redistribute"], None, **extra)
            return
        if self.n_dense is not None:
            self.pool_dense(q_rows, keys, self.pooled[layer], n_input=self.n_dense, scale=scale, **self.options)
            return
        self.kernels.pool(
            q_rows, keys, self.pooled[layer], scale=scale, lse=None, **self.options,
            input_start=self.input_start[:, None].expand(-1, rows), input_end=self.input_end[:, None].expand(-1, rows),
            kv_len=self.kv_len,
        )

    def decode(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               variant: Variant = PLAIN, gather=None) -> torch.Tensor:
        """The attention output (B, R, H, D) of the scored queries (B, H, R, D) (every query of a decode or
        verify pass), computed from the probabilities whose m' goes into layer `layer`: one read of K."""
        _no_gather(gather)
        if not variant.plain:
            (attend, end, length), extra = variant.key_slots(self.input_start, self.input_end, self.kv_len[:, -1])
            out, _ = self.kernels.decode(
                query[:, :, 0], keys, values, attend, length, scale, None, end, self.alpha, self.options["pooling"],
                self.options["redistribute"], self.pooled[layer, :, 0], **extra,
            )
            return out.unsqueeze(1)
        if self.n_dense is not None:
            return self.decode_dense(query, keys, values, self.pooled[layer], n_input=self.n_dense, scale=scale,
                                     **self.options).transpose(1, 2)
        out, _ = self.kernels.decode(
            query[:, :, 0], keys, values, kv_start=self.input_start, kv_len=self.kv_len[:, -1], scale=scale, log_c=None,
            pooled=self.pooled[layer, :, 0], input_end=self.input_end, alpha=self.alpha, **self.options,
        )
        return out.unsqueeze(1)

    def pool_rows(self, layer: int, rows: torch.Tensor) -> None:
        """m' from given attention rows (B, H, S) of the last query (efficient attention's projected rows):
        the backend's row update at alpha = 1 adds log m' to a zeroed row, whose exp is m'."""
        out = self.pooled[layer, :, 0]
        out.zero_()
        self.kernels.update_rows(rows, out, input_start=self.input_start, input_end=self.input_end,
                                 kv_len=self.kv_len[:, -1], alpha=1.0, **self.options)
        out.exp_()

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        return super().finish(self.alpha, self.options["pooling"], (self.input_end - self.input_start)[:, None])


class PackedRows(PassRows):
    """Rows of a packed pass (continuous batching, vLLM's layout): scored row r is query row `rows[r]` of the
    pass's (1, H, T, D) query and attends its own keys `segments` of the packed (1, H_kv, S, D) key tensor.

    configs: each row's MacsConfig (alpha, pooling, redistribute, attention differ per request).
    keep: scored rows whose per-head softmax rows on their inputs are kept per layer in `kept` (L, len(keep), H,
        N_max)
        (AT2's features), or None.
    """

    def __init__(self, kernels: Kernels, num_layers: int, rows: torch.Tensor, segments: Segments, configs: list,
                 shards: HeadShards | None = None, keep: torch.Tensor | None = None):
        super().__init__(num_layers, (len(configs),), segments.n_max, rows.device, shards)
        self.kernels, self.rows, self.segments, self.configs = kernels, rows, segments, configs
        self.keep, self.kept = keep, None
        device = rows.device
        self.alpha = torch.tensor([c.alpha for c in configs], dtype=torch.float32, device=device)
        self.poolings = [c.pooling for c in configs]
        self.n_input = torch.tensor(segments.n_input, device=device)
        # The torch form spreads per row; a kernel takes one redistribute flag, so its rows split by it too.
        grouped: dict[tuple, list[int]] = {}
        for r, config in enumerate(configs):
            flag = None if self._torch_form(kernels) else config.redistribute
            grouped.setdefault((config.pooling, flag), []).append(r)
        self.groups = [
            (pooling, flag, None if len(members) == len(configs) else torch.tensor(members, device=device))
            for (pooling, flag), members in grouped.items()
        ]

    @staticmethod
    def _torch_form(kernels: Kernels) -> bool:
        return kernels.reference

    def pool(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float, variant: Variant = PLAIN,
             gather: Segments | None = None) -> None:
        """m' of the scored rows of this layer's packed query (1, H, T, D) over keys (1, H_kv, S, D).

        variant: the layer's attention (its softcap and sinks; its window is the segments'); gather: where its
        rows' keys lie when that differs from the pass's segments (a sliding-window layer's cache)."""
        q_rows = query.index_select(2, self.rows)
        segments = self.segments if gather is None else gather
        if self.kernels.reference or self.keep is not None:
            probabilities = segments.probabilities(q_rows[0], keys[0], scale, variant.softcap, variant.sinks)
            self._keep(layer, probabilities, segments)
            if self.kernels.reference:
                self._pool_probabilities(layer, probabilities, segments)
                return
        out = self.pooled[layer]
        # A variant layer's rows go by token positions, each over its own keys of the packed tensor (key_offset).
        varied = not (variant.plain and segments.window is None and segments.input_keys is None)
        for pooling, redistribute, index in self.groups:
            ranges = segments.token_ranges if varied else (segments.input_start, segments.input_end, segments.kv_len)
            block = q_rows
            if index is not None:
                block = q_rows[:, :, index, :]
                ranges = tuple(bound[:, index] for bound in ranges)
            pooled = torch.empty(1, block.shape[2], segments.n_max, dtype=torch.float32, device=out.device)
            if varied:
                slots, extra = Variant(window=segments.window, key_offset=ranges[3], softcap=variant.softcap,
                                       sinks=variant.sinks).key_slots(*ranges[:3])
                self.kernels.pool(block, keys, pooled, *slots, scale, pooling, redistribute, None, **extra)
            else:
                self.kernels.pool(block, keys, pooled, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2],
                                  scale=scale, pooling=pooling, redistribute=redistribute, lse=None)
            self._write(out, index, pooled[0])

    def decode(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               variant: Variant = PLAIN, gather: Segments | None = None) -> torch.Tensor:
        """The attention output (1, T, H, D) of a pass whose every query row is scored (a decode pass of
        traced requests), from the probabilities whose m' goes into layer `layer`: one read of K (variant,
        gather: as in `pool`)."""
        segments = self.segments if gather is None else gather
        probabilities = segments.probabilities(query[0], keys[0], scale, variant.softcap, variant.sinks)
        out = segments.outputs(probabilities, values[0])
        self._keep(layer, probabilities, segments)
        self._pool_probabilities(layer, probabilities, segments)
        return out.unsqueeze(0).to(query.dtype)

    def pool_rows(self, layer: int, row: int, attention: torch.Tensor) -> None:
        """m' of scored row `row` from a given attention row (H, length) over its own keys (efficient
        attention's projected row)."""
        n, config = self.segments.n_input[row], self.configs[row]
        inputs = attention[:, :n]
        if config.redistribute and attention.shape[-1] > n:
            inputs = inputs + attention[:, n:].sum(dim=-1, keepdim=True) / n
        self.pooled[layer, row, :n] = _POOL[config.pooling](inputs[None])[0]

    def _keep(self, layer: int, probabilities: torch.Tensor, segments: Segments) -> None:
        if self.keep is None:
            return
        inputs = segments.input_rows(probabilities)
        if self.kept is None:
            self.kept = torch.empty(self.pooled.shape[0], len(self.keep), *inputs.shape[1:],
                                    dtype=torch.float32, device=inputs.device)
        torch.index_select(inputs, 0, self.keep, out=self.kept[layer])

    def _pool_probabilities(self, layer: int, probabilities: torch.Tensor, segments: Segments | None = None) -> None:
        inputs = (self.segments if segments is None else segments).spread_inputs(probabilities)
        out = self.pooled[layer]
        for pooling, _, index in self.groups:
            if index is None:
                _POOL[pooling](inputs, out=out)
            else:
                self._write(out, index, _POOL[pooling](inputs[index]))

    @staticmethod
    def _write(out: torch.Tensor, index: torch.Tensor | None, pooled: torch.Tensor) -> None:
        if index is None:
            out.copy_(pooled)
        else:
            out.index_copy_(0, index, pooled)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        return super().finish(self.alpha, self.poolings, self.n_input)


class PagedRows(PackedRows):
    """Rows of a pass over a paged KV cache (vLLM's layout): scored row r is query row `rows[r]` of the pass's
    (T, H, D) query and attends the first `lengths[r]` keys of its request, read through its block-table row
    `block_table[r]`; the first n_input[r] of them are its inputs.

    configs: each row's MacsConfig. On torch every layer gathers only the pages the rows attend and scores them
    in one batched product; the other backends' paged op (numba's on CPUs, Triton's and CUDA's on GPUs) reads
    the pages in place, one call per option group. No loop over requests either way.
    """

    def __init__(self, kernels: Kernels, num_layers: int, rows: torch.Tensor, block_table: torch.Tensor,
                 lengths: list, n_input: list, page_size: int, configs: list, shards: HeadShards | None = None):
        segments = Segments([0] * len(lengths), lengths, n_input, [c.redistribute for c in configs], rows.device)
        super().__init__(kernels, num_layers, rows, segments, configs, shards)
        self.lengths, self.page_size = lengths, page_size
        # The paged op's (B, 1) ranges per option group, built once per pass.
        ends = torch.tensor([n_input, lengths], dtype=torch.int64, device=rows.device).T.unsqueeze(-1)
        self.ranges = []
        for _, _, index in self.groups:
            bounds = ends if index is None else ends.index_select(0, index)
            self.ranges.append((torch.zeros_like(bounds[:, 0]), bounds[:, 0].contiguous(), bounds[:, 1].contiguous()))
        self.table = self.plan(block_table)

    def plan(self, block_table: torch.Tensor):
        """What `pool` needs of the rows' block-table rows (R, pages): the pages to gather (torch) or the int32
        table per option group (the other backends). The pass's own table is planned once; a layer whose keys
        follow another table (vLLM's hybrid cache gives each KV-cache group its own) passes its plan to `pool` as
        `gather`."""
        if self._torch_form(self.kernels):
            return Pages(block_table, self.lengths, self.page_size)
        table = block_table.to(torch.int32)
        return [table if index is None else table.index_select(0, index) for _, _, index in self.groups]

    def pool(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float, variant: Variant = PLAIN,
             gather=None) -> None:
        """m' of the scored rows of this layer's packed query (T, H, D) over the paged keys (P, page_size, H_kv,
        D): any strides on torch, a unit stride in D on the other backends. variant: the layer's attention (a
        sliding window: each row attends its last `window` keys, inputs before get 0; sinks: (H,) sink logits in
        the softmax's denominator, gpt-oss; softcap: Gemma 2's logit cap); a paged cache holds every token at
        its position, so its key_offset is 0. gather: `plan(table)` of this layer's block table when it is not
        the pass's."""
        if not (isinstance(variant.key_offset, int) and variant.key_offset == 0):
            raise ValueError(f"a paged cache holds every token at its position: key_offset must be 0, got "
                             f"{variant.key_offset!r}")
        plan = self.table if gather is None else gather
        q_rows = query.index_select(0, self.rows)
        window, sinks, softcap = variant.window, variant.sinks, variant.softcap
        if self._torch_form(self.kernels):
            probabilities = plan.probabilities(q_rows, keys, scale, window, sinks, softcap)
            self._pool_probabilities(layer, probabilities[..., : self.segments.length_max])
            return
        for (pooling, redistribute, index), table, ranges in zip(self.groups, plan, self.ranges):
            ranges, extra = paged_slots(variant, ranges)
            if index is None:  # one option group: straight into the pass's rows
                self.kernels.pool_paged(q_rows.unsqueeze(2), keys, table, self.pooled[layer].unsqueeze(1), *ranges,
                                        scale, pooling, redistribute, None, **extra)
                continue
            block = q_rows.index_select(0, index)
            pooled = torch.empty(block.shape[0], 1, self.segments.n_max, dtype=torch.float32, device=block.device)
            self.kernels.pool_paged(block.unsqueeze(2), keys, table, pooled, *ranges, scale, pooling, redistribute,
                                    None, **extra)
            self._write(self.pooled[layer], index, pooled[:, 0])

    @staticmethod
    def _torch_form(kernels: Kernels) -> bool:
        return kernels.paged_reference

    def decode(self, *args, **kwargs):
        raise NotImplementedError("PagedRows scores rows only: the engine's own attention computes the outputs")


def paged_slots(variant: Variant, ranges: tuple) -> tuple[tuple, dict]:
    """A paged plan's (B, R) ranges and the paged kernel's variant arguments for a layer's `variant` (key_offset 0:
    a paged cache's slots are the tokens): the ranges as they are for plain attention, else Variant.key_slots."""
    return (ranges, {}) if variant.plain else variant.key_slots(*ranges)


def _no_gather(gather) -> None:
    if gather is not None:
        raise ValueError("a dense cache's keys are the layer's own tensor: pass gather=None")
