"""The rows of the sequences that pass through a traced model: one generate call's (or a plain forward's) input
ranges, the row map from each sequence's steps to the rows its passes computed, what generate's stopping
criteria and beam search said of them, and the stores the rows end in.

Nothing here assumes that batch row b is one sequence for the whole generation or that the newest key is the
newest token. Row k of a sequence is the query at key slot input_end - 1 + k, so a row computed again after
`past_key_values.crop()` replaces the rejected one; beam search's `reorder_cache(beam_idx)` permutes the row
map, and the returned beams' rows are rebuilt from generate's `beam_indices`; a sequence ends where generate's
stopping criteria finished it, so the pads generate appends to finished rows of a batch get no rows.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from macs_kernels.core.rows import NAN_MESSAGE, RowStore
from macs_kernels.engines.captured_steps import CapturedSteps


@dataclasses.dataclass
class Inputs:
    """Each sequence's input keys [start, end) (B,) on the device, their counts on the host."""

    start: torch.Tensor
    end: torch.Tensor
    counts: list[int]

    @property
    def unpadded(self) -> bool:
        """Every item's inputs are keys [0, N) with one N."""
        return len(set(self.counts)) == 1 and not bool(self.start.any())


class SequenceRows:
    """Rows of the sequences of one generate call (by returned sequence, generate's order) or of plain forward
    calls (by batch row). `passes` holds every pass's rows on the device as they are computed (what streaming reads
    while generate runs); `store` (a RowStore keyed by sequence) the rows once resolved: when generate returns, or
    after each pass of a plain forward. `pooled_store` holds keep_pooled's m' rows flattened to L*N."""

    def __init__(self, num_layers: int, keep_pooled: bool):
        self.num_layers = num_layers
        self.inputs: Inputs | None = None
        self.passes: list[dict] = []
        self._bases: list[int] = []
        self._stored = 0
        # A generate call keeps every sequence it returned until the next sequence starts (keep_more).
        self.store = RowStore(keep_finished=0)
        self.pooled_store = RowStore(keep_finished=0) if keep_pooled else None
        self._row_map = None
        # Per batch row of a greedy, sampling or assisted generate: how many tokens it had generated when the
        # stopping criteria finished it (-1 while it runs). generate then appends pads (or, without an
        # end-of-sequence criterion, whatever it samples) until every row is done.
        self._stops = None
        self._beam_indices = None
        self.returned: tuple[int, int] | None = None  # (sequences, generated length) once generate returned
        self.nan = None  # whether a pass of the generate call held a NaN: a bool tensor on the device

    def start(self, start: torch.Tensor, end: torch.Tensor) -> None:
        self.inputs = Inputs(start, end, (end - start).tolist())
        self._row_map = torch.full((start.shape[0], 0), -1, dtype=torch.int64, device=start.device)

    def grow_row_map(self, keys: int) -> None:
        # Row k is the query at slot input_end - 1 + k < keys: the map never needs more than `keys` columns.
        missing = keys - self._row_map.shape[1]
        if missing > 0:
            pad = torch.full((self._row_map.shape[0], missing), -1, dtype=torch.int64, device=self._row_map.device)
            self._row_map = torch.cat([self._row_map, pad], dim=1)

    def batch(self) -> int:
        return 0 if self._row_map is None else self._row_map.shape[0]

    # ---- writers ------------------------------------------------------------------------------------------
    def add_pass(self, log_c: torch.Tensor, step: torch.Tensor, pooled: torch.Tensor | None,
                 plain_forward: bool) -> None:
        """A pass's rows: log c (B, R, N_max) of the rows at steps `step` (B, R); pooled: their m' (L, B, R, N_max)
        with keep_pooled. A plain forward's sequence may go on in the next call: its rows are stored as they come."""
        batch, rows, n_max = log_c.shape
        flat = log_c.view(batch * rows, n_max)
        ids = self._stored + torch.arange(batch * rows, device=flat.device).view(batch, rows)
        self._row_map.scatter_(1, step, ids)
        record = {"log_c": flat, "rows": rows}
        if pooled is not None:
            record["pooled"] = pooled.permute(1, 2, 0, 3).reshape(batch * rows, self.num_layers, n_max)
        self._append(record, batch * rows)
        if plain_forward and self.returned is None:
            # (A forward that continues a generate call's cache adds no rows to the sequences generate returned.)
            steps = step.tolist()
            for item, n in enumerate(self.inputs.counts):
                own = None if pooled is None else record["pooled"][item * rows:(item + 1) * rows]
                self._store_rows(item, n, steps[item], log_c[item], own)

    def add_captured(self, steps: CapturedSteps) -> None:
        """The rows a compiled generation's decode steps wrote into `steps` (after generate: one host read)."""
        items, rows = steps.written.nonzero(as_tuple=True)
        if items.numel():
            self.grow_row_map(int(rows.max()) + 1)
            self._row_map[items, rows] = self._stored + torch.arange(items.numel(), device=items.device)
            n_max = max(self.inputs.counts)  # the eager passes' width: the steps' buffers span the whole cache
            self._append({"log_c": steps.rows[items, rows, :n_max], "rows": 1}, items.numel())
        self.flag_nan(steps.broken)

    def _append(self, record: dict, count: int) -> None:
        self._bases.append(self._stored)
        self._stored += count
        self.passes.append(record)

    def flag_nan(self, broken: torch.Tensor) -> None:
        """Inside generate the flag stays on the device, so that a step makes no host sync; the call fails when
        generate returns (or when a streaming reader reads a row first)."""
        self.nan = broken.any() if self.nan is None else self.nan | broken.any()

    def record_stops(self, is_done: torch.Tensor, generated: int) -> None:
        """generate's stopping criteria returned `is_done` (B,) after `generated` tokens: a row's sequence ends the
        first time it is done."""
        if self._stops is None:
            self._stops = torch.full(is_done.shape, -1, dtype=torch.int64, device=is_done.device)
        self._stops = torch.where(is_done & (self._stops < 0), generated, self._stops)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search moved the cache's rows: row j now continues the sequence of row beam_idx[j]."""
        if self._row_map is not None:
            self._row_map = self._row_map.index_select(0, beam_idx.to(self._row_map.device))

    def finish(self, count: int, generated: int, beam_indices: torch.Tensor | None) -> None:
        """generate returned `count` sequences of `generated` tokens (beam search: their `beam_indices`): resolve
        each to its rows and store them (host syncs once generate is done, never in a step). A NaN flagged in any
        pass fails every sequence's rows, as RowStore does."""
        self._beam_indices, self.returned = beam_indices, (count, generated)
        for store in (self.store, self.pooled_store):
            if store is not None:
                store.keep_more(count)
        if not self.passes:
            return
        log_c = torch.cat([p["log_c"] for p in self.passes])
        pooled = torch.cat([p["pooled"] for p in self.passes]) if self.pooled_store is not None else None
        broken = self.nan is not None and bool(self.nan)
        for item in range(count):
            ids, batch_row = self._row_ids(item)
            own = None if pooled is None else pooled[ids]
            self._store_rows(item, self.inputs.counts[batch_row], range(ids.numel()), log_c[ids], own)
            if broken:
                self.store.put([(item, 0, None)])
            for store in (self.store, self.pooled_store):
                if store is not None:
                    store.finish(item)

    def _store_rows(self, item: int, n: int, steps, log_c: torch.Tensor, pooled: torch.Tensor | None) -> None:
        """Write sequence `item`'s rows at `steps` into the stores: log c (R, >= n) and, with keep_pooled, m'
        (R, L, >= n)."""
        if item not in self.store:
            self.store.open(item, n)
            if self.pooled_store is not None:
                self.pooled_store.open(item, self.num_layers * n)
        self.store.put(zip([item] * len(steps), steps, log_c.cpu()))
        if pooled is not None:
            flat = pooled[:, :, :n].cpu().reshape(len(steps), -1)
            self.pooled_store.put(zip([item] * len(steps), steps, flat))

    def _row_ids(self, item: int) -> tuple[torch.Tensor, int]:
        """(global ids of returned sequence `item`'s rows, the batch row whose inputs it explains)."""
        if self._beam_indices is not None:
            # Beam search: the token of step t came from pass t at batch row beam_indices[item, t].
            beams = self._beam_indices[item].to(self._row_map.device).long()
            steps = int((beams >= 0).sum())
            bases = torch.tensor(self._bases[:steps], device=beams.device)
            return bases + beams[:steps], int(beams[0])
        row = self._row_map[item]
        written = int((row >= 0).long().cumprod(0).sum())
        steps = min(written, self.returned[1])
        stop = -1 if self._stops is None else int(self._stops[item])
        return row[:steps if stop < 0 else min(steps, stop)], item

    # ---- readers ------------------------------------------------------------------------------------------
    def count(self) -> int:
        """How many sequences there are rows for: generate's returned sequences, or the batch rows."""
        return self.returned[0] if self.returned is not None else self.batch()

    def check_item(self, item: int) -> None:
        if not self.passes:
            raise RuntimeError("nothing was traced: run a forward or generate call inside attach()")
        if not 0 <= item < self.count():
            raise IndexError(f"sequence {item} is outside [0, {self.count()})")

    def raise_on_nan(self, steps: CapturedSteps | None = None) -> None:
        """Fail for a NaN row that a pass flagged on the device (a host sync)."""
        if (self.nan is not None and bool(self.nan)) or (steps is not None and bool(steps.broken)):
            raise FloatingPointError(NAN_MESSAGE)

    def row_log_c(self, item: int, step: int, steps: CapturedSteps | None = None) -> torch.Tensor:
        """log c (N_item,) of row `step` of batch row `item` while generating: a streaming reader's O(1) read (a
        compiled generation's decode rows from `steps`, which its steps fill in place)."""
        self.raise_on_nan(steps)
        global_id = int(self._row_map[item, step]) if step < self._row_map.shape[1] else -1
        n = self.inputs.counts[item]
        if global_id < 0 and steps is not None and step < steps.written.shape[1] and bool(steps.written[item, step]):
            return steps.rows[item, step, :n].cpu()
        if global_id < 0:
            raise IndexError(f"row {step} of sequence {item} was not computed")
        index = bisect.bisect_right(self._bases, global_id) - 1
        record, offset = self.passes[index], global_id - self._bases[index]
        return record["log_c"][offset, :n].cpu()
