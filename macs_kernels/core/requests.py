"""A request's life in a serving engine, written once for every engine that keys rows by request id.

configure (options given before the request runs) -> admit (the engine runs it: its rows open at step 0, or resume
at the step a restarted request replays to) -> rows stored per pass -> finish (the engine is done with it; the
rows wait for a reader) -> release (the rows are freed). A request released while the engine still runs it gets no
more work and is forgotten when the engine finishes it; one released while the engine restarted it is not opened
again. Continuous batching and vLLM differ only in how they see a request (its state object, the runner's ids),
which they pass in as `handle`.
"""
from __future__ import annotations

import threading

import torch

from macs_kernels.core.rows import RowStore


class Requests:
    """The requests one engine runs, their rows in `store`. Thread-safe: the engine's loop admits, stores and
    finishes while request handlers configure and release.

    default: the config a request that was not configured opens with. finished(handle): whether the engine is done
    with the request state `handle` although it has not said so yet (continuous batching marks a state finished
    before its tracer sees the next pass); an engine whose handles never finish on their own leaves it out.
    """

    def __init__(self, store: RowStore, default=None, finished=lambda handle: False):
        self.store = store
        self.default = default
        self._finished = finished
        self._lock = threading.Lock()
        self._pending: dict = {}  # request id -> config given before it runs
        self._running: dict = {}  # request id -> the engine's handle of the run it is in
        self._released: set = set()  # no more work for these: released while running, or skipped

    # ---- the caller's side --------------------------------------------------------------------------
    def configure(self, key, config) -> None:
        """`key` opens with `config` when the engine admits it; refused once it runs."""
        with self._lock:
            if self._runs(key):
                raise RuntimeError(f"request {key!r} is already running; configure it before adding it")
            self._pending[key] = config

    def skip(self, key) -> None:
        """No work for `key` (a request that did not ask for attribution) until it is released."""
        with self._lock:
            self._released.add(key)

    def release(self, key) -> None:
        """Free `key`'s rows and options (a no-op for a request released already or never seen); a request the
        engine still runs gets no more work."""
        with self._lock:
            self._pending.pop(key, None)
            if self._runs(key):
                self._released.add(key)
            else:
                self._running.pop(key, None)
                self._released.discard(key)
        self.store.release(key)

    def released(self, key) -> bool:
        with self._lock:
            return key in self._released

    def running(self, key) -> bool:
        with self._lock:
            return self._runs(key)

    # ---- the engine's side --------------------------------------------------------------------------
    def admit(self, key, n_input: int, step: int, handle=None, config=None) -> bool:
        """Whether the engine's row `step` of `key` is to be scored. The first time the engine runs `key` under
        `handle` (a new handle: the engine restarted it), its rows open: at step 0 with `config` (default: the
        one configured, else `default`), at step > 0 resuming the rows it had."""
        with self._lock:
            if key in self._released:
                return False
            if key in self._running and self._running[key] is handle:
                return True
            if step > 0 and key not in self.store:  # released while the engine restarted it
                return False
            if step == 0 and config is None:
                config = self._pending.pop(key, self.default)
            self.store.open(key, n_input, config, step=step)
            self._running[key] = handle
            return True

    def handle(self, key):
        """The handle `key` runs under (None for a request not running)."""
        with self._lock:
            return self._running.get(key)

    def replace(self, key, handle) -> None:
        """The engine goes on with `key` under another handle (a restart it announced before its next row)."""
        with self._lock:
            self._running[key] = handle

    def runs(self) -> list:
        """(key, handle) of every request the engine runs, a snapshot."""
        with self._lock:
            return list(self._running.items())

    def finish(self, key) -> None:
        """The engine is done with `key`: its rows wait for a reader (or are freed, if it was released)."""
        with self._lock:
            if self._running.pop(key, _ABSENT) is _ABSENT:
                return
            if key in self._released:
                self._released.discard(key)
                return
        self.store.finish(key)

    def put(self, keys: list, log_c: torch.Tensor, broken: torch.Tensor) -> None:
        """A pass's rows: keys (request id, step) per row, log_c (rows, >= N) and broken (rows,) bool on any device.
        A row with non-finite attention fails its request (its reads raise), not the engine."""
        log_c, broken = log_c.cpu(), broken.tolist()
        self.store.put((key, step, None if broken[r] else log_c[r]) for r, (key, step) in enumerate(keys))

    def _runs(self, key) -> bool:
        handle = self._running.get(key, _ABSENT)
        return handle is not _ABSENT and not self._finished(handle)


_ABSENT = object()
