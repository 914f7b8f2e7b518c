"""MACS rows in a vLLM engine that runs CUDA graphs (its default on GPUs: FULL_AND_PIECEWISE).

A full CUDA graph captures the attention layers once per batch size, at engine start, and replays them: the
Python of a layer's forward runs at capture only. So the rows' kernels are captured too, reading fixed-address
device buffers (`PersistentPagedRows`), and each step's plan is written into those buffers in place where vLLM
builds the step's attention metadata, outside any graph (the FLASH_ATTN metadata builder's `build`, from
`CommonAttentionMetadata`'s host copies: no device sync). A step's rows are finished and copied out when the next
step is planned, or when a reader asks (`collect`).

The buffers exist only in an engine whose `additional_config` asks for them (`CONFIG_KEY`), sized by the
attributed sequences it runs at once and their prompt length, never by vLLM's max_num_seqs x max_model_len;
requests beyond them are refused, each with its reason (`tracer.VllmTracer.capacity`). A captured step scores
every slot: slots without a scored row hold a one-key dummy (page 0, which vLLM reserves as its null block) and
are never read back, and each (pooling, redistribute) pair runs as its own kernel call over all slots, so
per-request options need no shape that depends on the step. A step run outside a graph scores only its scored
slots with the option groups they ask for, and one with no scored row runs no kernel and writes no buffer.
"""
from __future__ import annotations

import torch

from macs_kernels.core.accumulate import PassRows
from macs_kernels.core.plans import paged_slots
from macs_kernels.core.shards import HeadShards
from macs_kernels.engines.vllm import tracer as tracing
from macs_kernels.engines.vllm.engine_config import CONFIG_KEY, has_worker_extension, head_shards, layer_order
from macs_kernels.engines.vllm.tracer import StepPlan, layer_variant
from macs_kernels.ops import POOLINGS, registry
from macs_kernels.ops.registry import Kernels
from macs_kernels.ops.variant import PLAIN, Variant

# vLLM 0.32's CUDAGraphMode names (config/compilation.py) the rows follow, its default first. Attention runs
# inside a graph for FULL batches (decode batches for the *_DECODE_ONLY and *_AND_PIECEWISE modes, every batch
# for FULL) and eagerly otherwise; both read the same buffers.
SUPPORTED_CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "FULL")
# The (pooling, redistribute) pairs a request may ask for: each is one captured kernel call per layer.
OPTION_GROUPS = tuple((pooling, redistribute) for pooling in POOLINGS for redistribute in (True, False))

BUFFER_OPTIONS = ("max_seqs", "max_input_tokens")

ACTIVE: GraphSteps | None = None  # this worker process's, once an engine with graphs and buffers built its model


def graph_mode(vllm_config) -> str | None:
    """The name of the engine's CUDA-graph mode when it runs graphs, None when it runs eagerly; raises, naming the
    supported modes, for one the rows cannot follow, and for vLLM's micro-batching (two half-batches' metadata
    per step)."""
    compilation = vllm_config.compilation_config
    name = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    # No capture sizes: no graph is captured (vLLM's CPU platform clears them), attention runs eagerly.
    if vllm_config.model_config.enforce_eager or name == "NONE" or not compilation.cudagraph_capture_sizes:
        return None
    if name not in SUPPORTED_CUDAGRAPH_MODES:
        raise NotImplementedError(f"cudagraph_mode {name}: macs_kernels follows {SUPPORTED_CUDAGRAPH_MODES} (or "
                                  "enforce_eager=True)")
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        raise NotImplementedError("dual-batch overlap (enable_dbo) splits each step's attention metadata in two: "
                                  "macs_kernels with CUDA graphs plans one batch per step")
    return name


def buffer_sizes(vllm_config) -> tuple[int, int] | None:
    """(attributed sequences at once, prompt tokens of each) that the engine's `additional_config` sizes the
    persistent buffers for, or None where it asks for none; raises naming a bad entry."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if options is None:
        return None
    where = f"additional_config[{CONFIG_KEY!r}]"
    if not isinstance(options, dict) or sorted(options) != sorted(BUFFER_OPTIONS):
        raise ValueError(f"{where} must be a dict of exactly {BUFFER_OPTIONS}, got {options!r}")
    limits = {"max_seqs": vllm_config.scheduler_config.max_num_seqs,
              "max_input_tokens": vllm_config.model_config.max_model_len}
    for name, limit in limits.items():
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ValueError(f"{where}[{name!r}] must be an int from 1 to {limit} (the engine's "
                             f"{'max_num_seqs' if name == 'max_seqs' else 'max_model_len'}), got {value!r}")
    return options["max_seqs"], options["max_input_tokens"]


def reserve(vllm_config) -> None:
    """At the construction of the model's attention layers, inside vLLM's `load_model`: the persistent buffers'
    owner (`ACTIVE`) for an engine that captures CUDA graphs, has the worker extension and sizes buffers in its
    `additional_config`; None for any other engine. Allocated there, the buffers are part of the memory vLLM
    measures before it sizes its KV cache: 4 * (layers + 1) * max_seqs * max_input_tokens bytes."""
    global ACTIVE
    if ACTIVE is not None and ACTIVE.vllm_config is vllm_config:
        return
    ACTIVE = None
    if not has_worker_extension(vllm_config) or graph_mode(vllm_config) is None:
        return
    sizes = buffer_sizes(vllm_config)
    if sizes is None:
        return
    ACTIVE = GraphSteps(vllm_config.model_config.get_total_num_hidden_layers(), *sizes,
                        vllm_config.device_config.device, head_shards(vllm_config))
    ACTIVE.vllm_config = vllm_config


def prepare(vllm_config, layer_names) -> None:
    """At the construction of an engine's metadata builder (`backend.MacsMetadataBuilder`), before vLLM captures its
    graphs: names the layers of the buffers `reserve` allocated, after refusing a model whose layers are split over
    several metadata builders (vLLM's hybrid KV-cache groups)."""
    if ACTIVE is None or ACTIVE.vllm_config is not vllm_config:
        return
    layers = layer_order(vllm_config)
    if set(layer_names) != set(layers):
        raise NotImplementedError(
            f"a metadata builder for {len(layer_names)} of the model's {len(layers)} attention layers (KV-cache "
            "groups of a hybrid model): macs_kernels with CUDA graphs plans every layer from one block table; "
            "build the LLM with enforce_eager=True"
        )
    ACTIVE.layers = {name: index for index, name in enumerate(layers)}


def unbuffered(vllm_config) -> str | None:
    """Why rows cannot be attached to an engine, or None: one that captures CUDA graphs without buffers replays
    attention that runs no kernel of this package."""
    mode = graph_mode(vllm_config)
    if mode is None or (ACTIVE is not None and ACTIVE.vllm_config is vllm_config):
        return None
    return (f"this engine captures CUDA graphs (cudagraph_mode {mode}) without attribution buffers: build it with "
            f"additional_config={{{CONFIG_KEY!r}: {{'max_seqs': ..., 'max_input_tokens': ...}}}} "
            "(macs_kernels.vllm.graph_buffers(...)), or with enforce_eager=True")


def collect() -> None:
    """Store the rows of the step planned last (a reader asks: no further step may come to do it)."""
    if ACTIVE is not None:
        ACTIVE.collect(tracing.ACTIVE)


def capturing(query: torch.Tensor) -> bool:
    """Whether this forward is being recorded (a CUDA graph capture, or a torch.compile trace): what it runs is
    replayed for later steps, asked or not."""
    return torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing())


class PersistentPagedRows(PassRows):
    """`core.PagedRows`' rows over buffers whose addresses never change, for kernels inside a CUDA graph.

    max_rows: the most rows one step scores (the attributed sequences the engine runs at once); n_max: the longest
    attributed prompt. The block table's copy takes its width from vLLM's at the first `update` (before any
    capture). `update` (outside any graph) writes a step's plan into the buffers in place; `pool` (inside or
    outside a graph) reads only them; `finish` reads the pooled rows of the scored slots.
    """

    def __init__(self, kernels: Kernels, num_layers: int, max_rows: int, n_max: int, device,
                 shards: HeadShards | None = None):
        super().__init__(num_layers, (max_rows,), n_max, device, shards)
        self.kernels = kernels
        self.table: torch.Tensor | None = None
        self.count = 0  # scored slots of the step planned last; the rest hold the one-key dummy
        index = dict(dtype=torch.int64, device=device)
        self.rows = torch.zeros(max_rows, **index)
        # The paged op's (rows, 1) ranges: one query row per slot.
        self.input_start = torch.zeros(max_rows, 1, **index)
        self.input_end = torch.ones(max_rows, 1, **index)
        self.kv_len = torch.ones(max_rows, 1, **index)
        self.members = torch.zeros(len(OPTION_GROUPS), max_rows, 1, 1, dtype=torch.bool, device=device)
        self.alpha = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.poolings = [OPTION_GROUPS[0][0]] * max_rows
        self.groups: set = set()  # the option groups the step's scored slots ask for
        self.scratch = torch.empty(max_rows, 1, n_max, dtype=torch.float32, device=device)

    @property
    def max_rows(self) -> int:
        return self.rows.shape[0]

    def update(self, plan: StepPlan, block_table: torch.Tensor) -> None:
        """Write a step's plan into the buffers in place (slots past the plan get the one-key dummy). block_table:
        the step's (rows, pages) device table, whose rows `plan.table_rows` name. Costs no device sync: host
        values go up by non-blocking copies from pinned memory. A step without scored rows after one without
        writes nothing: the buffers hold the dummies already."""
        if self.table is None:
            self.table = torch.zeros(self.max_rows, block_table.shape[1], dtype=torch.int32, device=self.rows.device)
        count = len(plan.keys)
        if count == 0 and self.count == 0:
            return
        if count > self.max_rows:
            raise RuntimeError(f"{count} scored rows in one step, more than the {self.max_rows} slots of the "
                               f"buffers ({CONFIG_KEY}'s max_seqs)")
        if block_table.shape[1] > self.table.shape[1]:
            raise RuntimeError(f"a block table of {block_table.shape[1]} pages; the buffers hold "
                               f"{self.table.shape[1]}")
        dummies = self.max_rows - count
        groups = [OPTION_GROUPS.index((c.pooling, bool(c.redistribute))) for c in plan.configs]
        host = torch.tensor([plan.rows + [0] * dummies, plan.n_input + [1] * dummies, plan.lengths + [1] * dummies],
                            dtype=torch.int64)
        members = torch.zeros(len(OPTION_GROUPS), self.max_rows, dtype=torch.bool)
        members[groups, list(range(count))] = True
        alpha = torch.tensor([c.alpha for c in plan.configs] + [1.0] * dummies, dtype=torch.float32)
        pinned = self.rows.is_cuda
        if pinned:
            host, members, alpha = host.pin_memory(), members.pin_memory(), alpha.pin_memory()
        self.rows.copy_(host[0], non_blocking=True)
        self.input_end[:, 0].copy_(host[1], non_blocking=True)
        self.kv_len[:, 0].copy_(host[2], non_blocking=True)
        self.members.copy_(members.view(self.members.shape), non_blocking=True)
        self.alpha.copy_(alpha, non_blocking=True)
        # The scored rows' block-table rows, gathered on the device; page 0 (vLLM's null block) elsewhere.
        self.table.zero_()
        if count:
            table_rows = torch.tensor(plan.table_rows, dtype=torch.int64)
            table_rows = table_rows.pin_memory().to(block_table.device, non_blocking=True) if pinned else table_rows
            self.table[:count, : block_table.shape[1]].copy_(block_table.index_select(0, table_rows))
        self.poolings = [c.pooling for c in plan.configs] + [OPTION_GROUPS[0][0]] * dummies
        self.groups, self.count = set(groups), count

    def pool(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float, variant: Variant = PLAIN,
             gather=None, every_slot: bool = True) -> None:
        """m' of the slots of this layer's packed query (T, H, D) over the paged keys (P, page_size, H_kv, D), as
        `core.PagedRows.pool` (the `core.RowPlan` protocol). every_slot: what a CUDA graph records, replayed with
        the plan `update` wrote whatever the step: every slot, one kernel call per option group, the buffers'
        shapes and addresses (so a layer's own block table, `gather`, has no place here). Otherwise (a step run
        outside a graph) only the step's scored slots and the option groups they ask for."""
        if gather is not None:
            raise ValueError("the persistent buffers hold one block table for every layer: no per-layer gather")
        slots = self.max_rows if every_slot else self.count
        q_rows = query.index_select(0, self.rows[:slots]).unsqueeze(2)
        out = self.pooled[layer, :slots].unsqueeze(1)
        scratch = self.scratch[:slots]
        ranges, extra = paged_slots(variant, (self.input_start[:slots], self.input_end[:slots], self.kv_len[:slots]))
        for group, (pooling, redistribute) in enumerate(OPTION_GROUPS):
            if not (every_slot or group in self.groups):
                continue
            self.kernels.pool_paged(q_rows, keys, self.table[:slots], scratch, *ranges, scale, pooling, redistribute,
                                    None, **extra)
            torch.where(self.members[group, :slots], scratch, out, out=out)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log c (count, N_max) float32, 0 past each row's N; which rows hold a NaN, (count,) bool) of the
        scored slots of the step `update` planned last, queued on the device after that step."""
        count, pooled = self.count, self.pooled
        self.pooled = pooled[:, :count]
        try:
            log_c, broken = super().finish(self.alpha[:count], self.poolings[:count], self.input_end[:count, 0])
        finally:
            self.pooled = pooled
        return log_c, broken


class GraphSteps:
    """The worker's side of an engine with CUDA graphs: the persistent buffers, the step they were last planned
    for (rows not yet stored), and the layer order (`prepare` names the layers).

    num_layers: the model's attention layers; max_rows, n_max: the buffers' slots and prompt length (`reserve`);
    the tracer (`tracer.ACTIVE`, attached later) says which requests ask and where their rows go.
    """

    def __init__(self, num_layers: int, max_rows: int, n_max: int, device, shards: HeadShards | None = None):
        self.layers: dict = {}
        self.vllm_config = None  # the engine's, which these buffers serve
        self.buffers = PersistentPagedRows(registry.paged_kernels(device, captured=True), num_layers, max_rows, n_max,
                                           device, shards)
        self.pending: list | None = None  # the planned step's (request id, step) keys
        self.warmed: set = set()  # layers whose GPU kernels ran once outside a capture (compiled, autotuned)

    @property
    def max_rows(self) -> int:
        return self.buffers.max_rows

    @property
    def n_max(self) -> int:
        return self.buffers.pooled.shape[-1]

    def plan(self, tracer, common) -> None:
        """At `build` of a step's attention metadata (outside the graphs): store the previous step's rows, then
        write this step's plan into the buffers."""
        self.collect(tracer)
        table = common.block_table_tensor
        step = None
        if tracer is not None:
            num_reqs = len(tracer.runner.input_batch.req_ids)
            step = tracer.plan_rows(common.seq_lens_cpu_upper_bound[:num_reqs].tolist(),
                                    common.query_start_loc_cpu[1: num_reqs + 1].tolist())
        self.buffers.update(step or StepPlan([], [], [], [], [], []), table)
        self.pending = step.keys if step else None

    def layer(self, impl, layer, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """This layer's rows: over every slot while a graph records the step (its replays serve later steps,
        whatever they ask; unused slots cost a one-key dummy each), otherwise over the step's scored slots only,
        and nothing in a step that scores none, except once per layer on a GPU, as a capture would: vLLM's warm-up
        runs before its captures are where the layer's Triton kernels compile and tune, which a capture cannot."""
        index = self.layers.get(layer.layer_name)
        if index is None or self.buffers.table is None:
            return
        recorded = capturing(query)
        warming = not recorded and self.buffers.count == 0
        if warming:
            if not query.is_cuda or index in self.warmed:
                return
            self.warmed.add(index)
        self.buffers.pool(index, query, impl.macs_key_pages(layer, kv_cache), impl.scale, layer_variant(impl),
                          every_slot=recorded or warming)

    def collect(self, tracer) -> None:
        """Store the last planned step's rows (waits for the device to finish that step). vLLM allocated the
        rows' storage inside its `torch.inference_mode()`, where they are written again here, whoever asks (a
        reader's `collective_rpc` runs outside it). A step whose rows cannot be finished fails its requests'
        reads, never the reader's call nor the engine's step."""
        keys, self.pending = self.pending, None
        if not keys or tracer is None:
            return
        try:
            with torch.inference_mode():
                tracer.requests.put(keys, *self.buffers.finish())
        except Exception as error:  # noqa: BLE001 - any failure here belongs to these requests alone
            tracer.fail([key for key, _ in keys], f"their rows of step {keys[0][1]} failed: "
                                                  f"{type(error).__name__}: {error}")
