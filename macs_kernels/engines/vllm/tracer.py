"""The vLLM adapter over the attribution core: it turns each forward pass's attention metadata into the core's
row plan (`PagedRows`) and stores the rows in a `RowStore`, keyed by (request id, step).

Per pass (at the model's first attention layer) the tracer reads which requests the pass runs, in batch
order, from the model runner (`input_batch.req_ids`, the same order as the metadata's query_start_loc,
seq_lens and block_table rows) and plans one scored row per request that asked for attribution and gets a
token from this pass: the last query of a prefill's final chunk (chunks that end before the prompt does are
skipped: the runner discards their sample) or the single decode query. Its keys are the request's first
seq_len keys in vLLM's paged KV cache, shared prefix blocks included; its step is seq_len - N. A request that
vLLM preempts and recomputes replays prompt + output as one prefill whose last query is the step it resumes
at: the store resumes the rows it had. Every layer then scores all planned rows at once (`PagedRows.pool`);
the last layer takes the floor, the log and the sum over layers in the core and stores the rows.

Nothing here has a formula of its own.
"""
from __future__ import annotations

import dataclasses
import json
import threading

import torch

from macs_kernels.core import support
from macs_kernels.core.config import MacsConfig, option_names
from macs_kernels.core.plans import PagedRows
from macs_kernels.core.requests import Requests
from macs_kernels.core.rows import RowStore
from macs_kernels.core.shards import HeadShards
from macs_kernels.ops import registry
from macs_kernels.ops.variant import Variant

OPTION = "attribution"  # the key of SamplingParams.extra_args that asks for attribution
# The key of SamplingParams.extra_args whose (unique) text names one engine request to readers: clients may send
# one request id for several requests (vLLM accepts that), and the endpoint reads each request's rows by its ticket.
TICKET = "attribution_ticket"
# What a vLLM request may set: the options that change its rows (vLLM's own attention computes the outputs, so fused
# decode does not apply; the backend is the worker's).
OPTIONS = option_names("rows")
ACTIVE: VllmTracer | None = None  # this worker process's tracer, once the worker extension attached it


def parse_options(options) -> MacsConfig:
    """The MacsConfig of a request's `extra_args["attribution"]` (a dict of OPTIONS; {} or True: the paper's
    defaults; or that dict as JSON text, how `vllm serve`'s vllm_xargs carry it). Raises naming the option vLLM's
    integration cannot take."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError:
            raise ValueError(f"extra_args[{OPTION!r}] is text but not JSON: {options!r}") from None
    if options is True:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"extra_args[{OPTION!r}] must be a dict of {OPTIONS} (or True), got {options!r}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown attribution option(s) {unknown}: vLLM requests take {OPTIONS}")
    config = MacsConfig(**options)
    support.check_method("vllm", support.method_of(config))
    return config


def key_pages(kv_cache: torch.Tensor, transposed: bool) -> torch.Tensor:
    """vLLM's CPU cache [num_blocks, H_kv, block_size, 2 * D] (each (block, head) holds its block_size keys,
    then its values) as the keys' (num_blocks, block_size, H_kv, D) view, no copy. The backend stores a key
    block transposed ([D, block_size]) for its `vec` ISAs and plain otherwise (`probe_layout` says which)."""
    blocks, kv_heads, block_size, twice = kv_cache.shape
    dim = twice // 2
    keys = kv_cache.view(blocks, kv_heads, 2 * block_size * dim)[:, :, : block_size * dim]
    if transposed:
        return keys.unflatten(2, (dim, block_size)).permute(0, 3, 1, 2)
    return keys.unflatten(2, (block_size, dim)).permute(0, 2, 1, 3)


def flash_key_pages(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """vLLM's FLASH_ATTN cache, logical shape (num_blocks, H_kv, block_size, 2 * D) in any physical axis order
    (each slot's key, then its value, on the last axis), as the keys' (num_blocks, block_size, H_kv, D) view at
    unit stride in D, no copy: the view FlashAttention itself reads."""
    return kv_cache.transpose(1, 2)[..., :head_size]


def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> bool:
    """Whether the CPU backend's cache writer stores key blocks transposed for this ISA, found by writing known
    keys with the backend's own writer (`cpu_attn_reshape_and_cache`) and reading them back through
    `key_pages`. Raises for a packing that is neither plain nor transposed (AMX's bf16 pairs)."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    halves = cache.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size, 2 * block_size)  # block 1: a block other than the first
    # Slot and dimension indices (mod 256, exact in every float type) identify where each key element went.
    codes = [torch.arange(block_size).view(-1, 1, 1).expand(-1, 1, head_size),
             torch.arange(head_size).view(1, 1, -1).expand(block_size, 1, -1)]
    for transposed in (True, False):
        found = True
        for code in codes:
            written = (code % 256).to(dtype).contiguous()
            cache.zero_()
            ops.cpu_attn_reshape_and_cache(written, written, halves[0], halves[1], slots, isa, k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")
            found = found and torch.equal(key_pages(cache, transposed)[1, :, 0], written[:, 0])
        if found:
            return transposed
    raise NotImplementedError(
        f"vLLM's CPU attention ISA {isa!r} packs {dtype} key blocks in a layout macs_kernels cannot read; "
        "run the model in float32"
    )


def layer_window(impl) -> int | None:
    """The keys a query of this layer attends, itself included (transformers' convention), or None: CPU_ATTN keeps
    the window (-1: none), FLASH_ATTN FlashAttention's (window - 1, 0) ((-1, -1): none). The blocks before a
    window may be freed and reused, and the rows never read them."""
    window = impl.sliding_window
    if isinstance(window, tuple):
        if window == (-1, -1):
            return None
        if window[1] != 0:
            raise NotImplementedError(f"sliding window {window}: macs_kernels follows causal windows only")
        return window[0] + 1
    return None if window == -1 else window


def layer_variant(impl) -> Variant:
    """The layer's attention as the row plans take it: its window, gpt-oss's sinks, Gemma 2's logit cap (0: none)."""
    return Variant(window=layer_window(impl), softcap=impl.logits_soft_cap or None, sinks=impl.sinks)


@dataclasses.dataclass
class StepPlan:
    """One step's scored rows, in slot order, as the host knows them (no device values read)."""

    keys: list  # (request id, step) per scored row
    rows: list  # query row (token index of the step) per scored row
    table_rows: list  # the row of the step's block table per scored row
    lengths: list  # keys attended per scored row
    n_input: list  # inputs per scored row
    configs: list  # MacsConfig per scored row


@dataclasses.dataclass
class _Pass:
    scorer: PagedRows
    keys: list  # (request id, step) per scored row
    index: torch.Tensor  # the scored requests' rows of the pass's block tables
    table: torch.Tensor  # the block table the scorer was planned with (layer 0's KV-cache group)
    plans: dict = dataclasses.field(default_factory=dict)  # other groups' tables (vLLM's hybrid cache) -> their plans


class VllmTracer:
    """MACS rows of one vLLM worker's requests, keyed by worker-side request id (`<external id>-<8 chars>`).

    runner: the worker's model runner (its input batch and request states); layers: the model's attention
    layers by name, in forward order; shards: vLLM's tensor-parallel split of the heads (every rank plans the
    same rows from the same scheduler output, so the core's one reduction per pass pairs up across ranks).
    Thread-safe for readers (collective_rpc) while the engine runs passes.
    """

    def __init__(self, runner, layers: dict, keep_finished: int = 256, shards: HeadShards | None = None):
        self.runner = runner
        self.shards = shards
        self.layers = {name: index for index, name in enumerate(layers)}
        self.num_layers = len(layers)
        self.device = torch.device("cpu")  # where the cache lives; the kernels follow it at the first pass
        self.kernels = registry.paged_kernels(self.device)
        self.store = RowStore(keep_finished)
        self.requests = Requests(self.store)
        self._lock = threading.Lock()
        self._configs: dict[str, MacsConfig | None] = {}  # the requests the runner holds; None: did not ask
        self._errors: dict[str, str] = {}  # requests whose options were refused
        # Ids readers may ask by (vLLM's external id, a ticket) -> the worker-side ids of the requests they named.
        self._names: dict[str, list[str]] = {}
        self._unasked: dict[str, None] = {}  # ids of requests seen without attribution, so a read can say so
        # (attributed sequences at once, prompt tokens each) that an engine with CUDA graphs has buffers for; a
        # request beyond them is refused when it first runs. None: no bound (eager rows are sized per pass).
        self.capacity: tuple[int, int] | None = None
        self._pass: _Pass | None = None

    # ---- readers (collective_rpc) -------------------------------------------------------------------
    def worker_id(self, request_id: str) -> str:
        """The worker-side id of `request_id`, given as either (or as the request's ticket). Raises KeyError for
        an external id that more than one request still held here was sent with: whose rows are meant is
        unknowable."""
        with self._lock:
            if request_id in self._errors or request_id in self.store:
                return request_id
            named = self._names.get(request_id)
            if not named:
                return request_id
            held = [key for key in named if self._held(key)]
            if len(held) > 1:
                raise KeyError(f"request id {request_id!r} was sent with {len(held)} requests whose rows are held: "
                               f"ask by their worker-side ids {held}")
            return held[0] if held else named[-1]

    def _held(self, key: str) -> bool:
        """Whether a request is running here, or its rows or refusal wait for a reader (callers hold the lock)."""
        return ((key in self._configs and not self.requests.released(key)) or key in self._errors
                or key in self.store)

    def rows(self, request_id: str, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, int]:
        """(log c (steps, N) float32 of steps [start, stop) (stop: every step so far), N) of a request (by any id
        `worker_id` takes)."""
        key = self.worker_id(request_id)
        with self._lock:
            error = self._errors.get(key)
            unasked = key in self._unasked and key not in self.store
        if error is not None:
            raise ValueError(f"request {request_id!r}: {error}")
        if unasked:
            raise KeyError(f"request {request_id!r} never asked for attribution (no SamplingParams.extra_args"
                           f"[{OPTION!r}]): it has no rows")
        return self.store.rows(key, start, stop), self.store.n_input(key)

    def release(self, request_id: str) -> None:
        key = self.worker_id(request_id)
        with self._lock:
            self._errors.pop(key, None)
        self.requests.release(key)

    def fail(self, keys: list, error: str) -> None:
        """These requests get no more rows, and their reads raise `error`."""
        with self._lock:
            for key in keys:
                self._record_error(key, error)
                self.requests.skip(key)

    def keep_more(self, count: int) -> None:
        """Keep `count` more finished requests' rows (negative: give them back)."""
        self.store.keep_more(count)

    # ---- one forward pass -----------------------------------------------------------------------------
    def _config(self, request_id: str, state) -> MacsConfig | None:
        """The request's options (parsed once); a refused option records an error for the reader, never a
        failed engine."""
        if request_id in self._configs:
            return self._configs[request_id]
        extra = getattr(state.sampling_params, "extra_args", None) or {}
        config = None
        if OPTION not in extra or extra[OPTION] is False:
            for name in (request_id, request_id.rsplit("-", 1)[0]):
                self._unasked[name] = None
            while len(self._unasked) > 4 * self.store.keep_finished + 64:
                del self._unasked[next(iter(self._unasked))]
        else:
            names = [request_id.rsplit("-", 1)[0]] + ([str(extra[TICKET])] if TICKET in extra else [])
            for name in names:  # the requests a name held no more are forgotten
                self._names[name] = [key for key in self._names.pop(name, ()) if self._held(key)] + [request_id]
            # Kept past release, so a late read says the rows were released; bounded like the store's record.
            while len(self._names) > 4 * self.store.keep_finished + 64:
                del self._names[next(iter(self._names))]
            try:
                config = parse_options(extra[OPTION])
                self._check_capacity(state.num_prompt_tokens)
            except (TypeError, ValueError, NotImplementedError, RuntimeError) as error:
                config = None
                self._record_error(request_id, str(error))
        self._configs[request_id] = config
        return config

    def _check_capacity(self, n_input: int) -> None:
        """Raises when a new attributed request does not fit the buffers of an engine with CUDA graphs (callers
        hold the lock)."""
        if self.capacity is None:
            return
        seqs, inputs = self.capacity
        how = "build the engine with larger macs_kernels.vllm.graph_buffers(...), or with enforce_eager=True"
        if n_input > inputs:
            raise RuntimeError(f"a prompt of {n_input} tokens; this engine's attribution buffers hold prompts of up "
                               f"to {inputs} (max_input_tokens): {how}")
        running = sum(config is not None for config in self._configs.values())
        if running >= seqs:
            raise RuntimeError(f"{running} attributed requests were running, as many as this engine's attribution "
                               f"buffers hold (max_seqs): {how}")

    def _record_error(self, request_id: str, error: str) -> None:
        self._errors[request_id] = error
        if len(self._errors) > self.store.keep_finished:  # never read: the oldest go, like finished rows
            del self._errors[next(iter(self._errors))]

    def _retire(self) -> None:
        """Requests the runner no longer holds are finished (a preempted request keeps its state there)."""
        requests = self.runner.requests
        for key in [key for key in self._configs if key not in requests]:
            del self._configs[key]
            self.requests.finish(key)

    def plan_rows(self, seq_lens: list, ends: list) -> StepPlan | None:
        """The pass's scored rows from its metadata's per-request key counts and query ends (host lists, in the
        runner's batch order; entries past the runner's requests are vLLM's CUDA-graph padding), or None when no
        request of the pass asks. Opens the rows of requests the engine runs for the first time."""
        runner = self.runner
        request_ids = runner.input_batch.req_ids
        with self._lock:
            self._retire()
            configs = [self._config(key, runner.requests[key]) for key in request_ids]
            if all(config is None for config in configs):
                return None
            if len(ends) < len(request_ids):
                raise RuntimeError(
                    f"vLLM pass with {len(ends)} query segments but {len(request_ids)} requests in the runner's "
                    "batch: macs_kernels cannot tell whose rows these are"
                )
            # The runner's own record of which requests this pass gives no token (chunks that end before the
            # prompt); its logits rows are sampled and thrown away.
            discarded = runner.discard_request_mask.np[: len(request_ids)].tolist()
            plan = StepPlan([], [], [], [], [], [])
            for i, (key, config) in enumerate(zip(request_ids, configs)):
                if config is None or discarded[i]:
                    continue
                n_input = runner.requests[key].num_prompt_tokens
                step = seq_lens[i] - n_input
                if not self.requests.admit(key, n_input, step, config=config):
                    continue
                plan.keys.append((key, step))
                plan.rows.append(ends[i] - 1)
                plan.table_rows.append(i)
                plan.lengths.append(seq_lens[i])
                plan.n_input.append(n_input)
                plan.configs.append(config)
        return plan if plan.keys else None

    def _begin_pass(self, metadata, page_size: int) -> None:
        self._pass = None
        plan = self.plan_rows(metadata.seq_lens.tolist(), metadata.query_start_loc[1:].tolist())
        if plan is None:
            return
        device = metadata.block_table.device
        if device != self.device:
            self.device, self.kernels = device, registry.paged_kernels(device)
        index = torch.tensor(plan.table_rows, device=device)
        scorer = PagedRows(self.kernels, self.num_layers, torch.tensor(plan.rows, device=device),
                           metadata.block_table.index_select(0, index), plan.lengths, plan.n_input, page_size,
                           plan.configs, self.shards)
        self._pass = _Pass(scorer, plan.keys, index, metadata.block_table)

    def layer(self, impl, layer, query: torch.Tensor, kv_cache: torch.Tensor, metadata) -> None:
        """This layer's MACS term for the pass's scored rows, after vLLM's own attention wrote its output (and
        the cache holds this pass's keys)."""
        index = self.layers.get(layer.layer_name)
        if index is None:
            return
        if index == 0:
            self._begin_pass(metadata, kv_cache.shape[2])
        step = self._pass
        if step is None:
            return
        step.scorer.pool(index, query, impl.macs_key_pages(layer, kv_cache), impl.scale, layer_variant(impl),
                         self._plan(step, metadata.block_table))
        if index == self.num_layers - 1:
            self._end_pass()

    @staticmethod
    def _plan(step: _Pass, table: torch.Tensor):
        """The scorer's plan for a layer whose KV-cache group has its own block table (a hybrid model's
        sliding-window and full layers), or None for the pass's own."""
        if table is step.table:
            return None
        key = table.data_ptr()
        if key not in step.plans:
            step.plans[key] = step.scorer.plan(table.index_select(0, step.index))
        return step.plans[key]

    def _end_pass(self) -> None:
        step, self._pass = self._pass, None
        self.requests.put(step.keys, *step.scorer.finish())
