"""MACS under transformers' continuous batching (`model.generate_batch`, `ContinuousBatchingManager`).

The engine packs the requests of a forward pass into one query (1, H, T, D): request i owns query rows
[cu_seq_lens_q[i], cu_seq_lens_q[i+1]) and, after the paged cache's update, keys [cu_seq_lens_k[i],
cu_seq_lens_k[i+1]) of the packed key tensor, which are its tokens 0, 1, ... in order (read back from its
pages, shared prefix pages included). A request's prefill may be split into chunks over several passes;
only the pass that ends it emits a token. So per pass the tracer

1. reads which requests are in the batch, in packing order, from the manager that prepared it;
2. scores only the query rows that produce a token (the last row of a finished prefill, every decode row):
   row r of request i attends keys [cu_k[i], cu_k[i+1]), whose first N (the whole prompt) are its inputs;
3. per layer, computes MACS's pooled row m' (before the floor) of each scored row over its own keys
   (`ops.macs_pool` with per-row ranges on the GPU backends, `macs_pool_packed` on torch) and adds
   log(alpha * clamp(m', 0) + 1 - alpha) to a (rows, N_max) float32 state;
4. after the last layer, appends each row of log c to its request's record (scores are its z-scores).

transformers accepts only "sdpa", "paged|eager" and flash names in continuous batching, so `attach_continuous`
wraps the registered functions under those names (restored on exit): the wrapper computes exactly what the
original does, and traces only modules of an attached model called with a paged cache.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import threading

import torch

from .config import MacsConfig
from .ops._dispatch import implementation, resolve_backend
from .ops.torch_backend import _POOL as POOL
from .tracing import check_model

__all__ = ["ContinuousTracer", "Segments", "attach_continuous", "explain_continuous", "macs_pool_packed"]

# The names continuous batching accepts that run on any device; flash names need CUDA and hand the attention
# function a block table on decode steps instead of packed keys.
WRAPPED_NAMES = ("sdpa", "paged|eager")
_TRACER_ATTRIBUTE = "_macs_continuous_tracer"
_PER_REQUEST_FIELDS = ("alpha", "pooling", "redistribute", "attention")


# ---- the registry wrapper -------------------------------------------------------------------------
class _ReadCache:
    """Stands in for the paged cache once the wrapper has updated it: hands back the keys it already read."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value

    def update(self, key_states, value_states, layer_idx, kwargs):
        return self.key, self.value


def _continuous_attention(original):
    def forward(module, query, key, value, attention_mask, **kwargs):
        from transformers.generation.continuous_batching.cache import (
            PagedAttentionCache,
        )

        tracer = getattr(module, _TRACER_ATTRIBUTE, None)
        cache = kwargs.get("cache")
        if tracer is None or not isinstance(cache, PagedAttentionCache):
            return original(module, query, key, value, attention_mask, **kwargs)
        return tracer.attention(module, query, key, value, attention_mask, original, **kwargs)

    forward.__wrapped__ = original
    return forward


_install_lock = threading.Lock()
_originals: dict[str, object] = {}
_attached_models = 0


def _install() -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _attached_models
    with _install_lock:
        if _attached_models == 0:
            wrappers = {}
            for name in WRAPPED_NAMES:
                # A fresh instance has no local overrides: this is the library-wide function.
                _originals[name] = AttentionInterface()[name]
                wrappers[name] = _continuous_attention(_originals[name])
                AttentionInterface.register(name, wrappers[name])
            shadowed = [name for name in WRAPPED_NAMES if ALL_ATTENTION_FUNCTIONS[name] is not wrappers[name]]
            if shadowed:
                for name in WRAPPED_NAMES:
                    AttentionInterface.register(name, _originals.pop(name))
                raise RuntimeError(
                    f"transformers' attention registry overrides {shadowed} locally; macs_kernels cannot wrap them"
                )
        _attached_models += 1


def _uninstall() -> None:
    from transformers import AttentionInterface

    global _attached_models
    with _install_lock:
        _attached_models -= 1
        if _attached_models == 0:
            for name in WRAPPED_NAMES:
                AttentionInterface.register(name, _originals.pop(name))


# ---- per-request state ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Request:
    n_input: int
    config: MacsConfig
    state: object  # the engine's RequestState (replaced when the engine re-queues the request)
    log_c: list = dataclasses.field(default_factory=list)
    error: str | None = None

    def generated(self) -> int:
        """Tokens the engine has accepted so far (a re-queued request carries earlier ones in its prompt)."""
        state = self.state
        return len(state.initial_tokens) - self.n_input + len(state.generated_tokens)

    def finished(self) -> bool:
        from transformers.generation.continuous_batching.requests import RequestStatus

        return self.state.status in (RequestStatus.FINISHED, RequestStatus.FAILED)


def _prompt_length(state) -> int:
    # A request the engine soft-reset is re-queued with its generated tokens appended to its prompt.
    return getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)


# ---- the per-layer op over packed keys -------------------------------------------------------------
class Segments:
    """Key ranges of R query rows over a packed key tensor, and the constants every layer of a pass shares.

    Row r attends keys [starts[r], starts[r] + lengths[r]); the first n_input[r] of them are its inputs,
    the rest generated tokens (their attention is spread over the inputs where redistribute[r]).
    """

    def __init__(self, starts, lengths, n_input, redistribute, device):
        if not (len(starts) == len(lengths) == len(n_input) == len(redistribute)) or not starts:
            raise ValueError("starts, lengths, n_input and redistribute must be equally long and not empty")
        if any(n < 1 or n > length for n, length in zip(n_input, lengths)):
            raise ValueError(f"every row needs 1 <= n_input <= its key count, got {n_input} for {lengths}")
        self.starts, self.lengths, self.n_input = list(starts), list(lengths), list(n_input)
        self.n_max, self.length_max = max(self.n_input), max(self.lengths)
        self.device = device
        positions = torch.arange(self.length_max, device=device)
        lengths_t = torch.tensor(self.lengths, device=device).view(-1, 1)
        n_input_t = torch.tensor(self.n_input, device=device).view(-1, 1)
        spread = torch.tensor(redistribute, dtype=torch.float32, device=device).view(-1, 1) / n_input_t
        # (R, L_max, 1): weight of each key's probability in the spill every input receives, 1/N on generated
        # keys, so that one batched product sums a row's spill.
        self.spill_weight = (((positions >= n_input_t) & (positions < lengths_t)) * spread).unsqueeze(-1)
        as_index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        self.input_start = as_index([self.starts])
        self.input_end = as_index([[s + n for s, n in zip(self.starts, self.n_input)]])
        self.kv_len = as_index([[s + length for s, length in zip(self.starts, self.lengths)]])
        self._scores = None

    def _score_buffer(self, kv_heads: int, group: int) -> tuple[torch.Tensor, list]:
        """The (R, H_kv, G, L_max) float32 score buffer of the pass and each row's (H_kv, G, length) view.

        Every layer writes the same per-row ranges, so the -inf padding past a row's length is written once
        per pass, not per layer."""
        if self._scores is None or self._scores[0].shape[1:3] != (kv_heads, group):
            scores = torch.full(
                (len(self.starts), kv_heads, group, self.length_max), float("-inf"), dtype=torch.float32,
                device=self.device,
            )
            self._scores = scores, [scores[r, :, :, :length] for r, length in enumerate(self.lengths)]
        return self._scores

    def probabilities(self, q, key, scale: float) -> torch.Tensor:
        """Softmax rows (R, H, L_max) float32 of q (H, R, D) over each row's own keys of key (H_kv, S, D),
        zeros past a row's length. One product per row over its own keys: R x S for the whole packed tensor
        would cost R times more."""
        heads, rows, dim = q.shape
        kv_heads = key.shape[0]
        grouped = (q.float() * scale).reshape(kv_heads, heads // kv_heads, rows, dim).permute(2, 0, 1, 3)
        keys_t = key.transpose(-1, -2)
        scores, row_scores = self._score_buffer(kv_heads, heads // kv_heads)
        for r, (start, length) in enumerate(zip(self.starts, self.lengths)):
            torch.bmm(grouped[r], keys_t[:, :, start : start + length].float(), out=row_scores[r])
        return torch.softmax(scores.view(rows, heads, self.length_max), dim=-1)

    def spread_inputs(self, probabilities) -> torch.Tensor:
        """(R, H, N_max): each input's probability plus the row's spill, written over `probabilities`' input
        columns; entries past a row's N are not inputs."""
        spill = torch.bmm(probabilities, self.spill_weight)
        return probabilities[:, :, : self.n_max].add_(spill)


def macs_pool_packed(q, key, segments: Segments, *, scale, pooling="max") -> torch.Tensor:
    """MACS's head-pooled rows m' (before the floor) of R query rows over a packed key tensor: the torch form
    of `ops.macs_pool` with per-row ranges (B = 1), computing each row against its own keys only.

    q: (H, R, D), one row per request; key: (H_kv, S, D), the requests' keys back to back (continuous
    batching's layout); segments: each row's key range, input count and redistribution.
    Returns float32 (R, N_max); entries past a row's N are unspecified.
    """
    MacsConfig(pooling=pooling)
    if q.dim() != 3 or key.dim() != 3 or q.shape[0] % key.shape[0] or q.shape[2] != key.shape[2]:
        raise ValueError(f"q (H, R, D) and key (H_kv, S, D) with H a multiple of H_kv, got {tuple(q.shape)}, "
                         f"{tuple(key.shape)}")
    ends = [start + length for start, length in zip(segments.starts, segments.lengths)]
    if q.shape[1] != len(segments.starts) or max(ends) > key.shape[1]:
        raise ValueError("segments must give one key range per query row, inside the key tensor")
    return POOL[pooling](segments.spread_inputs(segments.probabilities(q, key, float(scale))))


@dataclasses.dataclass
class _Pass:
    """The scored rows of one forward pass: which query rows, whose records, their key ranges."""

    rows: torch.Tensor  # (R,) query rows that emit a token
    records: list
    segments: Segments
    groups: list  # (pooling, redistribute, row indices or None, alpha (R_g, 1), 1 - alpha (R_g, 1))
    log_c: torch.Tensor  # (R, N_max) float32


class ContinuousTracer:
    """MACS rows of the requests that a continuous-batching engine runs on one model, keyed by request id.

    Thread-safe: the engine's loop appends rows in its own thread while others read them.
    """

    def __init__(self, config: MacsConfig, num_layers: int, device: torch.device, keep_finished: int = 256):
        self.config = config
        self.num_layers = num_layers
        self.backend = resolve_backend(config.backend, device, "macs_pool")
        self._macs_pool = implementation(self.backend, "macs_pool")
        self.keep_finished = keep_finished
        self._lock = threading.Lock()
        self._managers: list = []
        self._requests: dict[str, _Request] = {}
        self._pending: dict[str, MacsConfig] = {}
        self._skipped: set[str] = set()
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._untracked_passes = 0
        self._pass: _Pass | None = None

    # ---- public API ---------------------------------------------------------------------------------
    def configure(self, request_id: str, **config) -> None:
        """Per-request alpha, pooling, redistribute or attention, given before the request is added."""
        unknown = set(config) - set(_PER_REQUEST_FIELDS)
        if unknown:
            raise ValueError(f"configure() takes {_PER_REQUEST_FIELDS} per request, not {sorted(unknown)}")
        merged = dataclasses.replace(self.config, **config)
        _check_supported(merged)
        with self._lock:
            running = self._requests.get(request_id)
            if running is not None and not running.finished():
                raise RuntimeError(f"request {request_id!r} is already running; configure it before adding it")
            self._pending[request_id] = merged

    def skip(self, request_id: str) -> None:
        """No MACS work for this request (a server's request that did not ask for attribution), until release."""
        with self._lock:
            self._skipped.add(request_id)

    def request_rows(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores), each (steps, N) float32 on the CPU, steps = tokens generated so far;
        step_scores are Explanation's: the z-scores of each row's log c (`log_zscores`)."""
        from .explanation import log_zscores

        with self._lock:
            record = self._record(request_id)
            steps = min(len(record.log_c), record.generated())
            rows = record.log_c[:steps]
        log_c = torch.stack(rows) if rows else torch.zeros(0, record.n_input, dtype=torch.float32)
        return log_c, log_zscores(log_c)

    def request_input_count(self, request_id: str) -> int:
        """N: the number of prompt tokens of the request (its inputs)."""
        with self._lock:
            return self._record(request_id).n_input

    def release(self, request_id: str) -> None:
        """Free a finished or cancelled request's rows (a no-op for a request already released or never seen)."""
        with self._lock:
            self._pending.pop(request_id, None)
            self._skipped.discard(request_id)
            self._drop(request_id, "released")

    def track(self, manager) -> None:
        """Trace the passes of `manager` (one created before attach_continuous; those created inside it are
        tracked already). Raises for engine modes whose passes the tracer cannot follow."""
        _check_manager(manager)
        with self._lock:
            if all(known is not manager for known in self._managers):
                self._managers.append(manager)

    # ---- bookkeeping (callers hold the lock) --------------------------------------------------------
    def _record(self, request_id: str) -> _Request:
        record = self._requests.get(request_id)
        if record is None:
            if request_id in self._released:
                raise KeyError(f"request {request_id!r} was {self._released[request_id]}; its rows are gone")
            hint = (
                f" ({self._untracked_passes} forward passes came from a manager this tracer does not know: pass "
                "it to tracer.track(manager) or create it inside attach_continuous)"
                if self._untracked_passes else ""
            )
            raise KeyError(f"no MACS rows for request {request_id!r}: no pass has produced a token for it yet{hint}")
        if record.error is not None:
            raise FloatingPointError(record.error)
        return record

    def _drop(self, request_id: str, why: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._released[request_id] = why
            while len(self._released) > 4 * self.keep_finished + 64:
                self._released.popitem(last=False)
        self._finished.pop(request_id, None)

    def _retire_finished(self) -> None:
        """Keep the rows of at most `keep_finished` finished requests that nobody released (oldest go first)."""
        for request_id, record in self._requests.items():
            if request_id not in self._finished and record.finished():
                self._finished[request_id] = None
        while len(self._finished) > self.keep_finished:
            oldest = next(iter(self._finished))
            self._drop(oldest, f"dropped: more than keep_finished={self.keep_finished} finished requests were kept")

    def _request_for(self, state) -> _Request:
        record = self._requests.get(state.request_id)
        # A finished request's id can come back as a new request (a fresh manager numbers from req_0 again).
        if record is None or (record.state is not state and record.finished()):
            self._finished.pop(state.request_id, None)
            config = self._pending.pop(state.request_id, self.config)
            record = _Request(n_input=_prompt_length(state), config=config, state=state)
            self._requests[state.request_id] = record
        record.state = state
        return record

    # ---- one forward pass -----------------------------------------------------------------------------
    def _batch(self, cache):
        """The requests of the pass being run on `cache`, in packing order, or None for an unknown engine."""
        with self._lock:
            managers = list(self._managers)
        for manager in managers:
            processor = manager.batch_processor
            if processor is not None and processor.cache is cache:
                return processor.inputs_and_outputs.requests_in_batch
        return None

    def _begin_pass(self, cache, kwargs, device) -> None:
        self._pass = None
        batch = self._batch(cache)
        if batch is None:
            with self._lock:
                self._untracked_passes += 1
            return
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k_by_type = kwargs["cu_seq_lens_k"]
        cu_k = (cu_k_by_type["full_attention"] if isinstance(cu_k_by_type, dict) else cu_k_by_type).tolist()
        if len(batch) != len(cu_q) - 1 or len(cu_k) != len(cu_q):
            raise RuntimeError(
                f"continuous batching pass with {len(batch)} requests but {len(cu_q) - 1} query segments"
            )
        rows, starts, ends, records, emitting = [], [], [], [], []
        with self._lock:
            self._retire_finished()
            for i, future in enumerate(batch):
                if not future.has_new_token:  # a prefill chunk that does not end its prompt
                    continue
                emitting.append(cu_q[i + 1] - 1)
                if future.state.request_id in self._skipped:
                    continue
                record = self._request_for(future.state)
                if cu_k[i + 1] - cu_k[i] < record.n_input:
                    raise RuntimeError(
                        f"request {future.state.request_id!r} emits a token after {cu_k[i + 1] - cu_k[i]} keys but "
                        f"has {record.n_input} prompt tokens"
                    )
                rows.append(cu_q[i + 1] - 1)
                starts.append(cu_k[i])
                ends.append(cu_k[i + 1])
                records.append(record)
        # The engine computes logits at exactly these rows; a mismatch means its packing changed under us.
        if kwargs["logits_indices"][: len(emitting)].tolist() != emitting:
            raise RuntimeError(
                f"continuous batching pass: rows that emit a token {emitting} differ from the engine's logits_indices"
            )
        if not records:
            return
        segments = Segments(
            starts, [end - start for start, end in zip(starts, ends)], [r.n_input for r in records],
            [r.config.redistribute for r in records], device,
        )
        # The torch form takes per-row redistribution, so only pooling splits its rows into groups.
        by_config = collections.defaultdict(list)
        for r, record in enumerate(records):
            redistribute = None if self.backend == "torch" else record.config.redistribute
            by_config[(record.config.pooling, redistribute)].append(r)
        groups = []
        for (pooling, redistribute), members in by_config.items():
            alphas = torch.tensor([[records[r].config.alpha] for r in members], dtype=torch.float32, device=device)
            index = None if len(members) == len(records) else torch.tensor(members, device=device)
            groups.append((pooling, redistribute, index, alphas, 1.0 - alphas))
        self._pass = _Pass(
            rows=torch.tensor(rows, device=device), records=records, segments=segments, groups=groups,
            log_c=torch.zeros(len(records), segments.n_max, dtype=torch.float32, device=device),
        )

    def _kernel_pooled(self, q_rows, key, scale, pooling, redistribute, index) -> torch.Tensor:
        """m' (R_g, N_max) of the rows `index` (all when None) from the backend's macs_pool kernel, which reads
        only each row's own key range of the packed tensor."""
        segments = self._pass.segments
        ranges = (segments.input_start, segments.input_end, segments.kv_len)
        if index is not None:
            q_rows = q_rows[:, :, index, :]
            ranges = tuple(bound[:, index] for bound in ranges)
        pooled = torch.empty(1, q_rows.shape[2], segments.n_max, dtype=torch.float32, device=q_rows.device)
        self._macs_pool(
            q_rows, key, pooled, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=scale,
            pooling=pooling, redistribute=redistribute, lse=None,
        )
        return pooled[0]

    def _add_layer(self, query, key, scale: float) -> None:
        step = self._pass
        q_rows = query.index_select(2, step.rows)
        inputs = None
        if self.backend == "torch":
            inputs = step.segments.spread_inputs(step.segments.probabilities(q_rows[0], key[0], scale))
        for pooling, redistribute, index, alphas, keep in step.groups:
            if inputs is None:
                pooled = self._kernel_pooled(q_rows, key, scale, pooling, redistribute, index)
            else:
                pooled = POOL[pooling](inputs if index is None else inputs[index])
            # Entries past a row's N are never read: rows are cut to N.
            term = pooled.clamp_min_(0.0).mul_(alphas).add_(keep).log_()
            if index is None:
                step.log_c.add_(term)
            else:
                step.log_c.index_add_(0, index, term)

    def _end_pass(self) -> None:
        step, self._pass = self._pass, None
        log_c = step.log_c.cpu()
        broken = torch.isnan(log_c).any(dim=1).tolist()
        with self._lock:
            for r, record in enumerate(step.records):
                n = record.n_input
                if broken[r]:
                    record.error = (
                        "NaN in an attention row during generation: the model produced non-finite attention; "
                        "no scores were computed for this step"
                    )
                record.log_c.append(log_c[r, :n].clone())

    def attention(self, module, query, key, value, attention_mask, inner, **kwargs):
        """One layer of a packed pass: the paged cache's update, the wrapped implementation on the keys it
        read (its output untouched), and this layer's MACS term for the rows that emit a token."""
        layer = module.layer_idx
        cache = kwargs.pop("cache")
        updated = dict(kwargs)
        key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=updated)
        # sdpa updates the cache only when it is given one; paged|eager always asks it for the keys.
        stand_in = _ReadCache(key, value) if inner is _originals.get("paged|eager") else None
        result = inner(module, query, key, value, attention_mask, cache=stand_in, **updated)
        if layer == 0:
            self._begin_pass(cache, kwargs, key.device)
        if self._pass is not None:
            scale = kwargs.get("scaling")
            scale = float(scale if scale is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
            self._add_layer(query, key, scale)
            if layer == self.num_layers - 1:
                self._end_pass()
        return result

    def _close(self) -> None:
        with self._lock:
            self._managers.clear()
            self._pass = None


# ---- checks -----------------------------------------------------------------------------------------
def _check_supported(config: MacsConfig) -> None:
    if config.attention != "softmax":
        raise NotImplementedError(
            f"attention={config.attention!r} is not supported under continuous batching (softmax rows only)"
        )
    if config.fused_decode:
        raise NotImplementedError(
            "fused_decode=True is not supported under continuous batching: the engine's own attention computes "
            "the output"
        )


def _check_manager(manager) -> None:
    from transformers.utils.generic import is_flash_attention_requested

    implementation_name = manager.model.config._attn_implementation
    if is_flash_attention_requested(requested_attention_implementation=implementation_name):
        raise NotImplementedError(
            f"the continuous batching manager runs {implementation_name!r}: its decode fast path hands the attention a "
            "block table of the paged cache; ops.macs_pool_paged scores such a cache, but the continuous tracer "
            "does not follow flash passes yet (they run on CUDA only), so use sdpa or eager and "
            "ContinuousBatchingConfig(auto_switch_to_flash=False)"
        )
    cb_config = manager.continuous_batching_config
    if cb_config.use_async_batching:
        raise NotImplementedError("use_async_batching=True is not supported by macs_kernels' continuous tracer")
    if any(cb_config.cuda_graph_booleans) or cb_config.varlen_compile_config or cb_config.decode_compile_config:
        raise NotImplementedError(
            "CUDA graphs and torch.compile in continuous batching replay the forward without the Python attention "
            "function that computes MACS; set use_cuda_graph=False and no compile configs"
        )
    if manager.num_return_sequences > 1:
        raise NotImplementedError(
            "num_return_sequences > 1 (forked requests) is not supported by the continuous tracer"
        )


def _restore_attention(manager) -> None:
    """Undo the switch a refused manager made to the model's attention implementation."""
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        manager.model.set_attn_implementation(original)
        manager._original_attn_impl = None


# ---- entry points ---------------------------------------------------------------------------------
@contextlib.contextmanager
def attach_continuous(model, *, manager=None, keep_finished: int = 256, **config):
    """Trace every continuous-batching pass on `model` inside the block; yields a `ContinuousTracer`.

    Use it around `model.generate_batch(...)` or a `ContinuousBatchingManager`: managers created inside the
    block (`model.init_continuous_batching()`, generate_batch) are tracked; pass one created before as
    `manager=`. config: MacsConfig fields (alpha, pooling, redistribute, attention, backend), the default
    of every request (`tracer.configure` overrides them per request). keep_finished: how many finished
    requests keep their rows until `release` (older ones are dropped). On exit the model, its attention
    implementation and transformers' registries are as they were.
    """
    macs_config = MacsConfig(**config)
    _check_supported(macs_config)
    if isinstance(keep_finished, bool) or not isinstance(keep_finished, int) or keep_finished < 0:
        raise ValueError(f"keep_finished must be an int >= 0, got {keep_finished!r}")
    modules = check_model(model)
    current = model.config._attn_implementation
    if current not in ("sdpa", "eager", "paged|eager"):
        raise NotImplementedError(
            f"continuous batching with attention implementation {current!r} is not supported; use sdpa or eager"
        )
    if any(hasattr(module, _TRACER_ATTRIBUTE) for module in modules.values()):
        raise RuntimeError("a macs_kernels continuous tracer is already attached to this model")
    tracer = ContinuousTracer(macs_config, len(modules), next(model.parameters()).device, keep_finished)
    for known in (manager, getattr(model, "_cached_continuous_batching_manager", None)):
        if known is not None:
            tracer.track(known)

    own_init = vars(model).get("init_continuous_batching")
    original_init = model.init_continuous_batching

    @functools.wraps(original_init)
    def init_continuous_batching(*args, **kwargs):
        created = original_init(*args, **kwargs)
        try:
            tracer.track(created)
        except NotImplementedError:
            _restore_attention(created)
            raise
        return created

    _install()
    for module in modules.values():
        setattr(module, _TRACER_ATTRIBUTE, tracer)
    model.init_continuous_batching = init_continuous_batching
    try:
        yield tracer
    finally:
        if own_init is None:
            del model.init_continuous_batching
        else:
            model.init_continuous_batching = own_init
        for module in modules.values():
            delattr(module, _TRACER_ATTRIBUTE)
        _uninstall()
        tracer._close()


def explain_continuous(model, tokenizer, prompts, *, max_new_tokens=64, continuous_batching_config=None, **config):
    """Run `prompts` through `model.generate_batch` (greedy) and explain each with MACS.

    prompts: a list of prompts (strings, wrapped in the chat template when the tokenizer has one, or lists of
        chat messages). Returns one Explanation per prompt, in prompt order, whose rows equal explain() of
        that prompt alone. continuous_batching_config: a transformers ContinuousBatchingConfig (page size,
        token budget, ...); flash attention, CUDA graphs and async batching stay off unless asked for (then
        they are refused: they bypass the traced attention). Without `num_blocks` in it, the paged cache
        holds exactly these prompts and their new tokens (sized from free memory, its allocation would dominate).
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from .explanation import Explanation, encode_prompts

    macs_config = MacsConfig(**config)
    _check_supported(macs_config)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts")
    check_model(model)
    vocab_size = model.get_input_embeddings().num_embeddings
    inputs = [encode_prompts(tokenizer, prompt, vocab_size=vocab_size)[0][0].tolist() for prompt in prompts]
    if continuous_batching_config is None:
        continuous_batching_config = ContinuousBatchingConfig()
    elif not isinstance(continuous_batching_config, ContinuousBatchingConfig):
        raise TypeError("continuous_batching_config must be a transformers ContinuousBatchingConfig")
    # Flash, CUDA graphs and async batching bypass the traced attention; left to the engine they could be on.
    continuous_batching_config = dataclasses.replace(
        continuous_batching_config, auto_switch_to_flash=False,
        use_cuda_graph=continuous_batching_config.use_cuda_graph or False,
        use_async_batching=continuous_batching_config.use_async_batching or False,
    )
    if continuous_batching_config.num_blocks is None:
        page = continuous_batching_config.page_size
        continuous_batching_config.num_blocks = sum(-(-(len(ids) + max_new_tokens) // page) for ids in inputs) + 1
    # explain() generates with the model's own generation config, greedy: so does this.
    generation_config = copy.deepcopy(model.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generation_config.update(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    if generation_config.eos_token_id is None:
        generation_config.eos_token_id = tokenizer.eos_token_id
    with attach_continuous(model, **macs_config.as_dict()) as tracer:
        outputs = model.generate_batch(
            inputs, generation_config=generation_config, continuous_batching_config=continuous_batching_config,
        )
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(inputs)} prompts")
        explanations = []
        for prompt_ids, (request_id, output) in zip(inputs, outputs.items()):
            if output.error is not None:
                raise RuntimeError(f"request {request_id} failed in generate_batch: {output.error}")
            log_c, _ = tracer.request_rows(request_id)
            tracer.release(request_id)
            generated = list(output.generated_tokens)
            if list(output.prompt_ids) != prompt_ids or log_c.shape[0] != len(generated):
                raise RuntimeError(
                    f"request {request_id}: {log_c.shape[0]} MACS rows for {len(generated)} generated tokens"
                )
            explanations.append(Explanation(
                input_ids=torch.tensor(prompt_ids),
                generated_ids=torch.tensor(generated, dtype=torch.long),
                input_tokens=[tokenizer.decode([i]) for i in prompt_ids],
                generated_tokens=[tokenizer.decode([i]) for i in generated],
                step_log_c=log_c,
                config=macs_config.as_dict() | {"backend": tracer.backend},
                text=tokenizer.decode(generated, skip_special_tokens=True),
            ))
    return explanations
