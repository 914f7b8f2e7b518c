"""MACS under transformers' continuous batching (`model.generate_batch`, `ContinuousBatchingManager`).

The engine packs the requests of a forward pass into one query (1, H, T, D): request i owns query rows
[cu_seq_lens_q[i], cu_seq_lens_q[i+1]) and, after the paged cache's update, keys [cu_seq_lens_k[i],
cu_seq_lens_k[i+1]) of the packed key tensor, which are its tokens 0, 1, ... in order (read back from its
pages, shared prefix pages included). A request's prefill may be split into chunks over several passes;
only the pass that ends it emits a token. So per pass the tracer

1. reads which requests are in the batch, in packing order, from the manager that prepared it;
2. plans only the query rows that produce a token (the last row of a finished prefill, every decode row):
   row r of request i attends keys [cu_k[i], cu_k[i+1]), whose first N (the whole prompt) are its inputs,
   and produces its step k = (keys - N);
3. hands them to the core's `PackedRows`, which scores each layer (`ops.macs_pool` with per-row ranges on
   the GPU backends, `macs_pool_packed`'s torch form on torch), reduces over a tensor-parallel group and
   takes the floor, the log and the sum over layers once per pass;
4. stores each row under (request id, step) in the core's `RowStore`.

transformers accepts only "sdpa", "paged|eager" and flash names in continuous batching, so `attach_continuous`
wraps the registered functions under those names (restored on exit): the wrapper computes exactly what the
original does, and traces only modules of an attached model called with a paged cache. The one exception is a
layer with a logit cap (Gemma 2): the originals drop `softcap`, so the wrapper computes the capped attention the
model defines (`capped_attention`) instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading

import torch

from macs_kernels.core import support
from macs_kernels.core.config import MacsConfig, config_of, option_names
from macs_kernels.core.methods.efficient import GramState, efficient_rows
from macs_kernels.core.plans import PackedRows
from macs_kernels.core.requests import Requests
from macs_kernels.core.rows import RowStore
from macs_kernels.core.scores import step_scores
from macs_kernels.core.shards import head_shards
from macs_kernels.engines.hf_models import check_model, check_variants, compiled_forward, layer_variant, takes_cache
from macs_kernels.ops import efficient_attention, registry
from macs_kernels.ops.torch import row as torch_row
from macs_kernels.ops.torch.packed import Segments, macs_pool_packed

__all__ = ["ContinuousTracer", "Segments", "attach_continuous", "batching_config_class",
           "engine_config", "generate_options", "macs_pool_packed"]

# The names continuous batching accepts that run on any device; flash names need CUDA and hand the attention
# function a block table on decode steps instead of packed keys.
WRAPPED_NAMES = ("sdpa", "paged|eager")
_TRACER_ATTRIBUTE = "_macs_continuous_tracer"
# From transformers 5.24 the attention module updates the paged cache itself and hands its attention function only
# what it read: a pre-hook keeps, for the thread running the module, its paged cache and the layout keywords that
# update rewrites (the pass's layout as it was before), and the attention function takes them back.
_REWRITTEN_BY_UPDATE = ("cu_seq_lens_k", "max_length_k", "block_table")
_module_call = threading.local()
# What a request may set for itself (the backend is the engine's: one kernel bundle per tracer).
_PER_REQUEST_FIELDS = option_names("rows", "pass")
AT2_FEATURES = "at2_features"


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
        call = vars(_module_call).pop(module, None)
        if "cache" in kwargs:
            call = None
        cache = kwargs.get("cache") if call is None else call["cache"]
        if tracer is None or not isinstance(cache, PagedAttentionCache):
            return original(module, query, key, value, attention_mask, **kwargs)
        return tracer.attention(module, query, key, value, attention_mask, original, call, **kwargs)

    forward.__wrapped__ = original
    return forward


def _keep_module_call(module, args, kwargs) -> None:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if isinstance(kwargs.get("cache"), PagedAttentionCache):
        vars(_module_call)[module] = {key: kwargs[key] for key in ("cache", *_REWRITTEN_BY_UPDATE) if key in kwargs}


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
def _prompt_length(state) -> int:
    # A request the engine soft-reset is re-queued with its generated tokens appended to its prompt.
    return getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)


def _finished(state) -> bool:
    from transformers.generation.continuous_batching.requests import RequestStatus

    return state.status in (RequestStatus.FINISHED, RequestStatus.FAILED)


@dataclasses.dataclass
class _Pass:
    """The scored rows of one forward pass: the core's accumulator over them, and what each row is."""

    scorer: PackedRows
    keys: list  # (request id, step) per scored row
    requests: list  # per scored row, its request's index in the pass's packing (a layer type's cu_seq_lens_k)
    tokens: list  # per scored row, its request's token count (prompt and generated tokens so far)
    windows: dict  # sliding window -> the Segments of that window's layers, built at their first layer
    efficient: list  # (row, request id) of rows whose config asks for efficient attention
    fused: bool  # every query row is scored: the attention output comes from the same probabilities

    def window_segments(self, window: int | None, cu_k: torch.Tensor) -> Segments:
        """Where the pass's scored rows' keys lie in a layer with this sliding window (None: a full layer): the
        window's cache holds each request's last tokens only, packed by the layer type's own cu_seq_lens_k."""
        found = self.windows.get(window)
        if found is None:
            base, cu = self.scorer.segments, cu_k.tolist()
            starts = [cu[i] for i in self.requests]
            lengths = [cu[i + 1] - cu[i] for i in self.requests]
            found = self.windows[window] = Segments(
                starts, lengths, base.n_input, [c.redistribute for c in self.scorer.configs], base.device,
                offsets=[total - length for total, length in zip(self.tokens, lengths)], window=window,
            )
        return found


class RequestRows:
    """What a continuous-batching tracer's readers call: each request's rows in `store` (a RowStore keyed by request
    id), read while the engine's loop writes them in its own thread. `untracked_passes` counts the passes of managers
    the tracer does not know, which a missing request's error names."""

    def __init__(self, keep_finished: int):
        self.store = RowStore(keep_finished)
        self.untracked_passes = 0

    def request_rows(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores), each (steps, N) float32 on the CPU, steps = tokens generated so far;
        step_scores are Explanation's: the z-scores of each row's log c (core.SCORES["log_z"]), as Tracer.rows
        returns."""
        log_c = self._rows(lambda: self.store.rows(request_id), request_id)
        return log_c, step_scores(log_c)

    def read_rows(self, request_id: str, cursor: int = 0, stop: int | None = None) -> tuple[torch.Tensor, int]:
        """(step_log_c rows [cursor, stop), the new cursor); stop defaults to every row so far. A streaming
        reader's O(1) per token."""
        return self._rows(lambda: self.store.read(request_id, cursor, stop), request_id)

    def at2_features(self, request_id: str) -> torch.Tensor:
        """(L, H, N) float32: per layer and query head, the softmax attention of the request's scored rows on
        each prompt token, averaged over its generated tokens so far (AT2's features before the sum over a
        source's tokens; configure(request_id, at2_features=True) asks for them)."""
        return self._rows(lambda: self.store.mean(request_id, AT2_FEATURES), request_id)

    def request_input_count(self, request_id: str) -> int:
        """N: the number of prompt tokens of the request (its inputs)."""
        return self._rows(lambda: self.store.n_input(request_id), request_id)

    def _rows(self, read, request_id):
        try:
            return read()
        except KeyError as error:
            if self.untracked_passes and "no pass" in str(error):
                raise KeyError(
                    f"{error.args[0]} ({self.untracked_passes} forward passes came from a manager this tracer does "
                    "not know: pass it to tracer.track(manager) or create it inside attach_continuous)"
                ) from None
            raise


class ContinuousTracer(RequestRows):
    """MACS rows of the requests that a continuous-batching engine runs on one model, keyed by request id.

    An adapter: it reads which requests a pass packs (the manager's batch, cu_seq_lens) into the core's
    `PackedRows` and stores each row under (request id, step) in a `RowStore`, so a request that the engine
    offloads and re-queues under its id keeps its rows and its options. Thread-safe: the engine's loop
    appends rows in its own thread while others read them.
    """

    def __init__(self, config: MacsConfig, num_layers: int, device: torch.device, keep_finished: int = 256,
                 shards=None, variants: tuple[str, ...] = ()):
        super().__init__(keep_finished)
        self.config = config
        self.num_layers = num_layers
        self.variants = variants
        self.kernels = registry.engine_kernels(config.backend, device, variants, "macs_pool")
        self.shards = shards
        self._lock = threading.Lock()
        self._managers: list = []
        # Per request: its config (MacsConfig, AT2 features?) in the store, its RequestState as the run's handle.
        self.requests = Requests(self.store, default=(config, False), finished=_finished)
        self._schedulers: dict[str, object] = {}  # request id -> the scheduler that runs it
        self._grams: dict[str, GramState] = {}  # efficient attention: each request's Gram state per layer
        self._pass: _Pass | None = None

    @property
    def backend(self) -> str:
        return self.kernels.backend

    # ---- public API ---------------------------------------------------------------------------------
    def configure(self, request_id: str, *, at2_features: bool = False, **config) -> None:
        """Per-request alpha, pooling, redistribute, attention or fused_decode, given before the request is
        added. at2_features: also keep AT2's features of its softmax rows (`at2_features(request_id)`)."""
        unknown = set(config) - set(_PER_REQUEST_FIELDS)
        if unknown:
            raise ValueError(f"configure() takes {_PER_REQUEST_FIELDS} per request, not {sorted(unknown)}")
        if config.get("attention", "softmax") != "softmax" and "fused_decode" not in config:
            config["fused_decode"] = None  # the engine's fused decode is for softmax rows: these never fuse
        merged = dataclasses.replace(self.config, **config)
        support.check_method("continuous", support.method_of(merged))
        if at2_features and self.shards is not None:
            support.check("continuous", "at2", "tensor_parallel")
        for variant in self.variants:
            support.check("continuous", support.method_of(merged), variant)
            if at2_features:
                support.check("continuous", "at2", variant)
        self.requests.configure(request_id, (merged, bool(at2_features)))

    def skip(self, request_id: str) -> None:
        """No MACS work for this request (a server's request that did not ask for attribution), until release."""
        self.requests.skip(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished or cancelled request's rows (a no-op for a request already released or never seen)."""
        with self._lock:
            self._grams.pop(request_id, None)
            self.requests.release(request_id)
            if not self.requests.running(request_id):
                self._schedulers.pop(request_id, None)

    def track(self, manager) -> None:
        """Trace the passes of `manager` (one created before attach_continuous; those created inside it are
        tracked already). Raises for engine modes whose passes the tracer cannot follow."""
        _check_manager(manager)
        with self._lock:
            if all(known is not manager for known in self._managers):
                self._managers.append(manager)

    # ---- one forward pass -----------------------------------------------------------------------------
    def _batch(self, cache):
        """(the requests of the pass being run on `cache` in packing order, their scheduler), or None for a
        manager this tracer does not know."""
        with self._lock:
            managers = list(self._managers)
        for manager in managers:
            processor = manager.batch_processor
            if processor is not None and processor.cache is cache:
                return processor.inputs_and_outputs.requests_in_batch, processor.scheduler
        return None

    def _retire_finished(self) -> None:
        """Tell the store which requests the engine finished. A request the engine offloaded and re-queued
        under its id is not finished: its old state is, but the scheduler holds a new one."""
        for request_id, state in self.requests.runs():
            if not _finished(state):
                continue
            scheduler = self._schedulers[request_id]
            live = scheduler.waiting_requests.get(request_id) or scheduler.active_requests.get(request_id)
            if live is not None and live is not state and not _finished(live):
                self.requests.replace(request_id, live)
                continue
            del self._schedulers[request_id]
            self._grams.pop(request_id, None)
            self.requests.finish(request_id)

    def _begin_pass(self, cache, kwargs, device) -> None:
        self._pass = None
        found = self._batch(cache)
        if found is None:
            with self._lock:
                self.untracked_passes += 1
            return
        batch, scheduler = found
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k_by_type = kwargs["cu_seq_lens_k"]
        # Every layer a sliding window (Mistral): no layer's keys are all of a request's tokens.
        window = None
        if isinstance(cu_k_by_type, dict) and "full_attention" not in cu_k_by_type:
            window = kwargs.get("sliding_window")
            cu_k_by_type = cu_k_by_type["sliding_attention"]
        cu_k = (cu_k_by_type["full_attention"] if isinstance(cu_k_by_type, dict) else cu_k_by_type).tolist()
        if len(batch) != len(cu_q) - 1 or len(cu_k) != len(cu_q):
            raise RuntimeError(
                f"continuous batching pass with {len(batch)} requests but {len(cu_q) - 1} query segments"
            )
        rows, starts, ends, n_inputs, configs, keys, kept, emitting = [], [], [], [], [], [], [], []
        requests, tokens = [], []
        with self._lock:
            self._retire_finished()
            for i, future in enumerate(batch):
                if not future.has_new_token:  # a prefill chunk that does not end its prompt
                    continue
                emitting.append(cu_q[i + 1] - 1)
                state = future.state
                request_id = state.request_id
                n_input = _prompt_length(state)
                step = len(state.initial_tokens) - n_input + len(state.generated_tokens)
                if not self.requests.admit(request_id, n_input, step, state):
                    continue
                self._schedulers[request_id] = scheduler
                if step == 0:  # the request's first scored row: no Gram state of an earlier run applies
                    self._grams.pop(request_id, None)
                if window is None and cu_k[i + 1] - cu_k[i] != n_input + step:
                    raise RuntimeError(
                        f"request {request_id!r} emits token {step} after {cu_k[i + 1] - cu_k[i]} keys; its "
                        f"{n_input} prompt tokens and {step} generated ones make {n_input + step}"
                    )
                rows.append(cu_q[i + 1] - 1)
                requests.append(i)
                tokens.append(n_input + step)
                starts.append(cu_k[i])
                ends.append(cu_k[i + 1])
                n_inputs.append(n_input)
                config, at2 = self.store.config(request_id)
                configs.append(config)
                if at2:
                    kept.append(len(keys))
                keys.append((request_id, step))
        # The engine computes logits at exactly these rows; a mismatch means its packing changed under us.
        if kwargs["logits_indices"][: len(emitting)].tolist() != emitting:
            raise RuntimeError(
                f"continuous batching pass: rows that emit a token {emitting} differ from the engine's logits_indices"
            )
        if not rows:
            return
        lengths = [end - start for start, end in zip(starts, ends)]
        segments = Segments(starts, lengths, n_inputs, [c.redistribute for c in configs], device,
                            offsets=[total - length for total, length in zip(tokens, lengths)], window=window)
        efficient = [(r, key) for r, ((key, _), c) in enumerate(zip(keys, configs)) if c.attention == "efficient"]
        scorer = PackedRows(self.kernels, self.num_layers, torch.tensor(rows, device=device), segments, configs,
                            self.shards, keep=torch.tensor(kept, device=device) if kept else None)
        # Fused when every query row of the pass is scored and every request asked for it.
        fused = all(c.fused_decode for c in configs) and not efficient and rows == list(range(cu_q[-1]))
        self._pass = _Pass(scorer, keys, requests, tokens, {window: segments}, efficient, fused)

    def _efficient_rows(self, layer: int, query, key, value, scale: float, variant, segments) -> None:
        """Efficient rows of the pass's efficient requests, after adding their new values to their Gram state
        (from the layer's own softmax rows: softcap and sinks included). A window layer's row projects onto its
        window's values, whose Gram matrix is recomputed (the layer's cache holds the window only)."""
        step = self._pass
        segments = step.scorer.segments if segments is None else segments
        for row, request_id in step.efficient:
            start, length = segments.starts[row], segments.lengths[row]
            values = value[:, :, start : start + length]
            q_row = query[:, :, int(step.scorer.rows[row])]
            scores = torch_row.grouped_scores(q_row, key[:, :, start : start + length], scale)
            end = torch.tensor([length], device=scores.device)
            attend = torch_row.window_start(torch.zeros_like(end), end, variant.window)
            softmax, _ = torch_row.attended_softmax(scores, attend, end, softcap=variant.softcap, sinks=variant.sinks)
            if variant.window is not None:
                rows, _ = efficient_attention(softmax[:, :, None], values, kv_start=int(attend), kv_len=length)
                offset = segments.offsets[row]
                step.scorer.pool_rows(layer, row, torch.nn.functional.pad(rows[0, :, 0], (offset, 0)))
                continue
            gram = self._grams.setdefault(request_id, GramState(self.num_layers))
            seen = int(gram.tokens(layer)[0]) if gram.started(layer) else 0
            fresh = values[:, :, seen:]
            gram.append(layer, fresh, torch.ones(1, fresh.shape[2], dtype=torch.bool, device=fresh.device))
            rows, _ = efficient_rows(softmax, values, gram.gram(layer), 0, length)
            step.scorer.pool_rows(layer, row, rows[0])

    def _end_pass(self) -> None:
        step, self._pass = self._pass, None
        self.requests.put(step.keys, *step.scorer.finish())
        if step.scorer.keep is not None:
            kept = step.scorer.kept.cpu()
            for j, r in enumerate(step.scorer.keep.tolist()):
                self.store.add(step.keys[r][0], AT2_FEATURES, kept[:, j, :, : step.scorer.segments.n_input[r]])

    def attention(self, module, query, key, value, attention_mask, inner, module_call=None, **kwargs):
        """One layer of a packed pass: the paged cache's update, the wrapped implementation on the keys it
        read (its output untouched) or, in a fused pass, the output from the probabilities MACS scores, and
        this layer's MACS term for the rows that emit a token.

        module_call: None when the paged cache comes in `kwargs` (transformers before 5.24: updated here); else
        the module's own keywords before it updated the cache itself (from 5.24), `kwargs` being what that update
        left."""
        layer = module.layer_idx
        if module_call is None:
            cache = kwargs.pop("cache")
            updated = dict(kwargs)
            key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=updated)
            layout = kwargs
        else:  # the pass's layout as it was before the module's update; the window comes with kwargs alone
            cache, updated, layout = module_call["cache"], kwargs, {**kwargs, **module_call}
        if layer == 0:
            self._begin_pass(cache, layout, key.device)
        step = self._pass
        scale = kwargs.get("scaling")
        scale = float(scale if scale is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        variant = layer_variant(updated, 0)
        segments = None if step is None else step.window_segments(variant.window, updated["cu_seq_lens_k"])
        if step is not None and step.fused:
            result = (step.scorer.decode(layer, query, key, value, scale, variant, segments), None)
        else:
            if variant.softcap is not None:  # transformers' paged|eager and sdpa drop the cap
                result = (capped_attention(query, key, value, attention_mask, scale, variant), None)
            else:
                # sdpa updates the cache only when it is given one; paged|eager always asks it for the keys.
                stand_in = _ReadCache(key, value) if inner is _originals.get("paged|eager") else None
                result = inner(module, query, key, value, attention_mask, cache=stand_in, **updated)
            if step is not None:
                step.scorer.pool(layer, query, key, scale, variant, segments)
        if step is not None:
            if step.efficient:
                self._efficient_rows(layer, query, key, value, scale, variant, segments)
            if layer == self.num_layers - 1:
                self._end_pass()
        return result

    def close(self) -> None:
        with self._lock:
            self._managers.clear()
            self._pass = None


def capped_attention(query, key, value, attention_mask, scale: float, variant) -> torch.Tensor:
    """The attention output (1, T, H, D) of a packed pass's query (1, H, T, D) over the paged cache's keys and
    values (1, H_kv, S, D) with the engine's additive mask (1, 1, T, S), as the model's eager attention defines
    it (in float32): logits capped to softcap * tanh(s / softcap) before the mask (Gemma 2), sink logits
    (variant.sinks) in the denominator when the layer has them."""
    scores = torch_row.cap_logits_(torch_row.grouped_scores(query, key, scale), variant.softcap)
    if attention_mask is not None:
        scores += attention_mask
    weights = torch_row.softmax(scores, variant.sinks)
    return torch_row.grouped_output(weights, value, query.dtype).transpose(1, 2).contiguous()


# ---- checks -----------------------------------------------------------------------------------------
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
    if (getattr(getattr(manager, "generation_config", None), "num_beams", None) or 1) > 1:
        support.check("continuous", "exact", "beams")
    if manager.num_return_sequences > 1:
        support.check("continuous", "exact", "several")
    if getattr(getattr(manager, "generation_config", None), "stop_strings", None):
        support.check("continuous", "exact", "stop_strings")


def _restore_attention(manager) -> None:
    """Undo the switch a refused manager made to the model's attention implementation."""
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        manager.model.set_attn_implementation(original)
        manager._original_attn_impl = None


# ---- entry points ---------------------------------------------------------------------------------
@contextlib.contextmanager
def attach_continuous(model, *, manager=None, keep_finished: int = 256, config: MacsConfig | None = None, **options):
    """Trace every continuous-batching pass on `model` inside the block; yields a `ContinuousTracer`.

    Use it around `model.generate_batch(...)` or a `ContinuousBatchingManager`: managers created inside the
    block (`model.init_continuous_batching()`, generate_batch) are tracked; pass one created before as
    `manager=`. config: a MacsConfig, or options: its fields, the default of every request (`tracer.configure`
    overrides those of kinds "rows" and "pass" per request). keep_finished: how many finished
    requests keep their rows until `release` (older ones are dropped). On exit the model, its attention
    implementation and transformers' registries are as they were.
    """
    batching_config_class()
    macs_config = config_of(config, options)
    if isinstance(keep_finished, bool) or not isinstance(keep_finished, int) or keep_finished < 0:
        raise ValueError(f"keep_finished must be an int >= 0, got {keep_finished!r}")
    modules = check_model(model)
    if compiled_forward(model):
        support.check("continuous", support.method_of(macs_config), "compiled")
    shards = head_shards(model, modules)
    support.check_method("continuous", support.method_of(macs_config))
    variants = check_variants(model, "continuous", support.method_of(macs_config))
    current = model.config._attn_implementation
    if current not in ("sdpa", "eager", "paged|eager"):
        raise NotImplementedError(
            f"continuous batching with attention implementation {current!r} is not supported; use sdpa or eager"
        )
    if any(hasattr(module, _TRACER_ATTRIBUTE) for module in modules.values()):
        raise RuntimeError("a macs_kernels continuous tracer is already attached to this model")
    tracer = ContinuousTracer(macs_config, len(modules), next(model.parameters()).device, keep_finished,
                              shards=shards, variants=variants)
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
    calls = []
    for module in modules.values():
        setattr(module, _TRACER_ATTRIBUTE, tracer)
        if takes_cache(type(module)):  # transformers 5.24 on
            calls.append(module.register_forward_pre_hook(_keep_module_call, with_kwargs=True))
    model.init_continuous_batching = init_continuous_batching
    try:
        yield tracer
    finally:
        if own_init is None:
            del model.init_continuous_batching
        else:
            model.init_continuous_batching = own_init
        for call in calls:
            call.remove()
        for module in modules.values():
            delattr(module, _TRACER_ATTRIBUTE)
        _uninstall()
        tracer.close()


# ---- the engine's options and sizing (for explain(continuous_batching=True)) ---------------------------
# generate options that continuous batching follows, and those that select a layout it cannot (support table).
SAMPLING = ("do_sample", "temperature", "top_k", "top_p")
_LAYOUTS = {
    "num_beams": ("beams", lambda value: value > 1),
    "num_return_sequences": ("several", lambda value: value > 1),
    "assistant_model": ("assisted", lambda value: value is not None),
    "prompt_lookup_num_tokens": ("assisted", lambda value: value is not None),
    "cache_implementation": ("static_cache", lambda value: value == "static"),
    "stop_strings": ("stop_strings", lambda value: value is not None),
}


def generate_options(generate_kwargs: dict, method: str) -> dict:
    """The engine's arguments taken out of explain()'s generate options (sampling, continuous_batching_config);
    refuses, before any work, an option that selects a layout continuous batching cannot follow with `method`,
    and any other generate option."""
    for option, (layout, selects) in _LAYOUTS.items():
        if option in generate_kwargs and selects(generate_kwargs[option]):
            support.check("continuous", method, layout)
    engine = {key: generate_kwargs.pop(key) for key in ("continuous_batching_config", *SAMPLING)
              if key in generate_kwargs}
    if generate_kwargs:
        raise ValueError(f"continuous_batching=True takes {SAMPLING} and continuous_batching_config; "
                         f"{sorted(generate_kwargs)} cannot be passed with it")
    return engine


def engine_config(continuous_batching_config, prompt_lengths: list[int], max_new_tokens: int):
    """The ContinuousBatchingConfig to run prompts of `prompt_lengths` tokens with: the one given (None: the
    default) with flash attention, CUDA graphs and async batching off unless asked for (they bypass the traced
    attention; asked for, they are refused later), and without `num_blocks` a paged cache that holds exactly these
    prompts and their new tokens (sized from free memory, its allocation would dominate)."""
    config_class = batching_config_class()
    if continuous_batching_config is None:
        continuous_batching_config = config_class()
    elif not isinstance(continuous_batching_config, config_class):
        raise TypeError("continuous_batching_config must be a transformers ContinuousBatchingConfig")
    continuous_batching_config = dataclasses.replace(
        continuous_batching_config, auto_switch_to_flash=False,
        use_cuda_graph=continuous_batching_config.use_cuda_graph or False,
        use_async_batching=continuous_batching_config.use_async_batching or False,
    )
    if continuous_batching_config.num_blocks is None:
        page = continuous_batching_config.page_size
        pages = sum(-(-(length + max_new_tokens) // page) for length in prompt_lengths)
        continuous_batching_config.num_blocks = pages + 1
    return continuous_batching_config


def batching_config_class():
    """transformers' ContinuousBatchingConfig where the installed transformers runs continuous batching the way the
    tracer follows it (5.19 on); elsewhere a clear error, raised before any work. Read from transformers' wheels and
    run here: 5.17 names the page size `block_size`; 5.17 and 5.18 have no `auto_switch_to_flash` (their manager
    switches to flash attention wherever flash-attn is installed), run a model's sdpa layers as "paged|sdpa" and
    update the paged cache without the pass's keywords; versions before 5.4 have no such class."""
    import transformers

    config_class = getattr(importlib.import_module("transformers.generation.configuration_utils"),
                           "ContinuousBatchingConfig", None)
    if config_class is None or "auto_switch_to_flash" not in {field.name for field in dataclasses.fields(config_class)}:
        raise RuntimeError(f"MACS under continuous batching (explain(continuous_batching=True), attach_continuous, "
                           f"macs-kernels serve) needs transformers>=5.19; this is transformers "
                           f"{transformers.__version__}")
    return config_class

