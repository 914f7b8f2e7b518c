"""Per-sequence rows of log c, keyed by (sequence, step): what every engine appends and every reader reads.

A row is stored under its step k (the k-th generated token), not appended blindly: an engine that restarts a
sequence (transformers' continuous batching offloads it when the paged cache fills and re-queues its prompt
plus its tokens under the same id; vLLM preempts and recomputes likewise) writes the next step into the rows
it already had, and a row computed again replaces the earlier one. Readers take the rows since a cursor, so
streaming costs O(1) per token. Finished sequences that nobody released are kept up to a bound.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import torch

NAN_MESSAGE = (
    "NaN in an attention row during generation: the model produced non-finite attention; no scores were "
    "computed for this step"
)


@dataclasses.dataclass
class _Sequence:
    n_input: int
    config: object
    data: torch.Tensor  # (capacity, n_input) float32: rows [0, count) are written
    count: int = 0
    error: str | None = None
    finished: bool = False
    sums: dict = dataclasses.field(default_factory=dict)  # name -> (running sum over steps, steps added)


class RowStore:
    """Rows of log c per sequence key, thread-safe (an engine's loop writes while request handlers read).

    keep_finished: how many finished sequences keep their rows until `release` (the oldest go first).
    """

    def __init__(self, keep_finished: int = 256):
        if isinstance(keep_finished, bool) or not isinstance(keep_finished, int) or keep_finished < 0:
            raise ValueError(f"keep_finished must be an int >= 0, got {keep_finished!r}")
        self.keep_finished = keep_finished
        self.lock = threading.Lock()
        self._sequences: dict[object, _Sequence] = {}
        self._finished: collections.OrderedDict[object, None] = collections.OrderedDict()
        self._gone: collections.OrderedDict[object, str] = collections.OrderedDict()

    # ---- writers (the engine's side) --------------------------------------------------------------------
    def open(self, key, n_input: int, config=None, step: int = 0) -> None:
        """Make `key` ready for row `step`. At step 0 a new sequence starts (a key seen before starts over:
        engines reuse ids); at step > 0 a restarted sequence resumes with the rows, input count and config it
        had, which must reach that step."""
        with self.lock:
            record = self._sequences.get(key)
            if step == 0:
                self._drop(key, "")
                self._gone.pop(key, None)
                self._sequences[key] = _Sequence(n_input, config, torch.empty(8, n_input, dtype=torch.float32))
                return
            if record is None or record.n_input != n_input or record.count < step:
                held = "none" if record is None else f"{record.count} rows of {record.n_input} inputs"
                raise RuntimeError(
                    f"sequence {key!r} resumes at step {step} with {n_input} inputs, but the store holds {held}"
                )
            record.finished = False
            self._finished.pop(key, None)

    def config(self, key):
        with self.lock:
            return self._get(key).config

    def put(self, items) -> None:
        """Write rows: items are (key, step, row) with row (>= N,) float32 on the CPU (its first N are kept), or
        (key, step, None) for a row that holds a NaN (the sequence fails: reading it raises). Rows of a key
        released or dropped meanwhile are discarded: an engine finishes the pass it was in."""
        with self.lock:
            for key, step, row in items:
                if key in self._gone:  # released while the engine was computing this row (a cancelled request)
                    continue
                record = self._get(key, check=False)
                if row is None:
                    record.error = f"{NAN_MESSAGE} (step {step})"
                    continue
                if step > record.count:
                    raise RuntimeError(f"sequence {key!r}: row {step} arrived before row {record.count}")
                if step == record.data.shape[0]:
                    grown = torch.empty(2 * step, record.n_input, dtype=torch.float32)
                    grown[:step] = record.data
                    record.data = grown
                record.data[step] = row[: record.n_input]
                record.count = max(record.count, step + 1)

    def add(self, key, name: str, value: torch.Tensor) -> None:
        """Add one step's `value` to `key`'s running sum `name` (per-sequence features reduced over steps, such
        as AT2's, kept and freed with the rows)."""
        with self.lock:
            if key in self._gone:
                return
            record = self._get(key, check=False)
            total, steps = record.sums.get(name, (None, 0))
            record.sums[name] = (value.clone() if total is None else total.add_(value), steps + 1)

    def mean(self, key, name: str) -> torch.Tensor:
        """The mean over steps of `key`'s running sum `name` (a copy)."""
        with self.lock:
            record = self._get(key)
            if name not in record.sums:
                raise KeyError(f"sequence {key!r} has no {name}: it was not asked for, or no step produced any")
            total, steps = record.sums[name]
            return total / steps

    def finish(self, key) -> None:
        """`key` will get no more rows; it is kept (up to keep_finished) until released."""
        with self.lock:
            record = self._sequences.get(key)
            if record is None or record.finished:
                return
            record.finished = True
            self._finished[key] = None
            while len(self._finished) > self.keep_finished:
                oldest = next(iter(self._finished))
                self._drop(oldest, f"dropped: more than keep_finished={self.keep_finished} finished sequences "
                                   "were kept")

    def keep_more(self, count: int) -> None:
        """Keep `count` more finished sequences (negative: give them back)."""
        with self.lock:
            if self.keep_finished + count < 0:
                raise ValueError(f"keep_finished {self.keep_finished} cannot give back {-count}")
            self.keep_finished += count

    def release(self, key) -> None:
        """Free `key`'s rows (a no-op for a key released already or never seen)."""
        with self.lock:
            self._drop(key, "released")

    # ---- readers --------------------------------------------------------------------------------------
    def __contains__(self, key) -> bool:
        with self.lock:
            return key in self._sequences

    def n_input(self, key) -> int:
        with self.lock:
            return self._get(key).n_input

    def count(self, key) -> int:
        with self.lock:
            return self._get(key).count

    def rows(self, key, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of `key` (stop: every row so far), (steps, N) float32, a copy. Raises
        FloatingPointError for a sequence whose rows held a NaN."""
        with self.lock:
            record = self._get(key)
            stop = record.count if stop is None else min(stop, record.count)
            return record.data[start:max(start, stop)].clone()

    def read(self, key, cursor: int, stop: int | None = None) -> tuple[torch.Tensor, int]:
        """(rows [cursor, stop), the new cursor); stop defaults to every row written so far, and a row not
        written yet is an error. A streaming reader's O(1)-per-token read."""
        with self.lock:
            record = self._get(key)
            stop = record.count if stop is None else stop
            if stop > record.count:
                raise RuntimeError(f"sequence {key!r} has {record.count} rows; {stop} were asked for")
            return record.data[cursor:stop].clone(), max(cursor, stop)

    # ---- bookkeeping (callers hold the lock) ----------------------------------------------------------
    def _get(self, key, check: bool = True) -> _Sequence:
        record = self._sequences.get(key)
        if record is None:
            if key in self._gone:
                raise KeyError(f"sequence {key!r} was {self._gone[key]}; its rows are gone")
            raise KeyError(f"no MACS rows for sequence {key!r}: no pass has produced a token for it yet")
        if check and record.error is not None:
            raise FloatingPointError(record.error)
        return record

    def _drop(self, key, why: str) -> None:
        if self._sequences.pop(key, None) is not None and why:
            self._gone[key] = why
            while len(self._gone) > 4 * self.keep_finished + 64:
                self._gone.popitem(last=False)
        self._finished.pop(key, None)
