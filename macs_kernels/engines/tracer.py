"""The generation tracer: per forward pass, a plan of which query rows to score read from the pass's layout
(engines.layout), per layer the core's `DenseRows` scoring them with the backend's kernels, after the last layer the
pass's rows into the generation's `SequenceRows` (engines.sequences).

- A `generate` call starts new sequences: per batch row its input key range and row map. The inputs are every key
  the first pass's last query attends, so a call on top of an existing cache (a continued conversation) counts the
  earlier turns as inputs.
- Per pass, the scored rows and their key ranges come from the attention mask (a static cache hands over every
  slot; the mask marks the live ones). The first pass of a sequence scores its last query; later passes score every
  query (one on a decode step, K+1 on a verify pass of assisted decoding).
- Per layer, `DenseRows` writes m' (MACS's head-pooled row before the floor) of the scored rows; after the last layer
  it reduces over a tensor-parallel group, takes the floor and the log and sums over layers, once per pass.
- Under torch.compile the decode steps of a static-cache generation run as one graph each (engines.captured_steps);
  the prefill and the bookkeeping of eager passes run outside any compiled region.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from macs_kernels.core import support
from macs_kernels.core.config import MacsConfig
from macs_kernels.core.rows import NAN_MESSAGE
from macs_kernels.core.scores import step_scores
from macs_kernels.core.shards import HeadShards
from macs_kernels.engines.captured_steps import CapturedSteps
from macs_kernels.engines.generation_modes import GenerationPlan
from macs_kernels.engines.hf_models import layer_variant
from macs_kernels.engines.method_rows import MethodRows, RowRanges, softmax_rows, window_efficient_rows
from macs_kernels.engines.pass_plan import PassKeys, PassPlan, PassPlanner
from macs_kernels.engines.sequences import SequenceRows
from macs_kernels.ops import registry
from macs_kernels.ops.variant import PLAIN


class TraceHook:
    """Per-layer extension point: subclasses see each pass and each layer's tensors. `method` names the
    support table's method a hook computes (None: it follows any layout), so generation layouts it cannot
    follow are refused before generate starts."""

    method: str | None = None

    def begin_pass(self, tracer: Tracer, prefill: bool) -> None:
        pass

    def layer(self, tracer: Tracer, layer_idx: int, query, key, value, output, scale: float) -> None:
        """`scale`: the softmax scale this layer used (its own `module.scaling` or the call's `scaling`)."""

    def end_pass(self, tracer: Tracer) -> None:
        pass


@dataclasses.dataclass
class GenerateCall:
    """The generate call in progress, as the tracer follows it: its plan (None between calls), the padded prompt
    length (its inputs are the key slots before it), whether its first pass is still to come, and how many generate
    calls nested in it run untraced (the model as its own assistant)."""

    plan: GenerationPlan | None = None
    prompt_length: int = 0
    start_pending: bool = False
    nested: int = 0


class TraceResults:
    """What a tracer's caller reads: the rows of the sequences it traced (`sequence_rows`, engines.sequences), and
    after a hand-over to continuous batching (`continuous`) the requests' rows."""

    sequence_rows: SequenceRows
    steps: CapturedSteps | None
    call: GenerateCall
    continuous: object
    num_layers: int

    @property
    def passes(self) -> list[dict]:
        """Every pass's rows on the device, as computed (engines.sequences.SequenceRows.passes)."""
        return self.sequence_rows.passes

    @property
    def store(self):
        return self.sequence_rows.store

    @property
    def pooled_store(self):
        return self.sequence_rows.pooled_store

    def sequences(self) -> int:
        """How many sequences there are rows for: generate's returned sequences, or the batch rows."""
        return self.sequence_rows.count()

    def rows(self, item: int, steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores) of sequence `item`: (steps, N_item) float32 tensors on the CPU; step_scores
        are Explanation's, the z-scores of each row's log c (core.SCORES["log_z"]), as request_rows returns.

        Default steps: every token of the sequence (generate: up to where its stopping criteria finished it,
        not the pads generate appends while other rows go on) or every scored row (plain forwards)."""
        self.sequence_rows.check_item(item)
        store = self.sequence_rows.store
        if steps is not None and steps > store.count(item):
            raise ValueError(f"sequence {item} has {store.count(item)} rows, fewer than the {steps} asked for")
        log_c = store.rows(item, 0, steps)
        return log_c, step_scores(log_c)

    @property
    def keep_pooled(self) -> bool:
        return self.sequence_rows.pooled_store is not None

    def pooled_rows(self, item: int, steps: int | None = None) -> torch.Tensor:
        """(steps, L, N_item) float32 m' per layer of sequence `item` (needs keep_pooled=True)."""
        if not self.keep_pooled:
            raise RuntimeError("pooled rows are kept only with keep_pooled=True")
        self.sequence_rows.check_item(item)
        flat = self.sequence_rows.pooled_store.rows(item, 0, steps)
        return flat.view(flat.shape[0], self.num_layers, -1)

    def row(self, item: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_c, its z-scores as in `rows`) (N_item,) of row `step` of batch row `item` while generating (one host
        sync)."""
        log_c = self.row_log_c(item, step)
        return log_c, step_scores(log_c)

    def row_log_c(self, item: int, step: int) -> torch.Tensor:
        """log c (N_item,) of row `step` of batch row `item` while generating: a streaming reader's O(1) read."""
        steps = self.steps if self.call.plan is not None and self.call.plan.compiled else None
        return self.sequence_rows.row_log_c(item, step, steps)

    # ---- continuous batching (after generate_batch / init_continuous_batching ran in the attach block) ----------
    def _continuous(self):
        if self.continuous is None:
            raise RuntimeError("no continuous batching ran in this attach block: call model.generate_batch(...) or "
                               "model.init_continuous_batching() inside it")
        return self.continuous

    def request_rows(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores) of a continuous-batching request so far (see ContinuousTracer)."""
        return self._continuous().request_rows(request_id)

    def configure(self, request_id: str, **config) -> None:
        """Per-request alpha/pooling/redistribute/attention of a request not added yet (see ContinuousTracer)."""
        self._continuous().configure(request_id, **config)

    def release(self, request_id: str) -> None:
        """Free a finished or cancelled request's rows (see ContinuousTracer)."""
        self._continuous().release(request_id)


class Tracer(TraceResults):
    """MACS state of the sequences that pass through one model.

    After a generate call, `rows(i)` gives (step_log_c, step_scores) of returned sequence i (generate's order);
    after plain forward calls, of batch row i (`sequence_rows`: engines.sequences.SequenceRows). `input_start`,
    `input_end`, `kv_len` (B,), `n_input_list`, `prefill` and `variant` describe the current pass (its last query)
    for hooks.
    """

    def __init__(self, config: MacsConfig, num_layers: int, device: torch.device, hooks=(), keep_pooled=False,
                 shards: HeadShards | None = None, variants: tuple[str, ...] = ()):
        self.config, self.num_layers, self.hooks = config, num_layers, list(hooks)
        self.planner = PassPlanner(config, num_layers, device, variants, shards)
        self.continuous = None  # set when the attach block hands over to continuous batching
        self.owner = threading.get_ident()
        self.methods = MethodRows(config.attention, num_layers,
                                  registry.op_backend(config.backend, device, "efficient_attention"))
        self.call = GenerateCall()
        self.sequence_rows = SequenceRows(num_layers, keep_pooled)
        self.plan: PassPlan | None = None
        self.steps: CapturedSteps | None = None  # a compiled generation's decode-step buffers
        self.forward_compiled = lambda: False  # whether the model's forward is torch.compile'd now (set by attach)

    @property
    def backend(self) -> str:
        """The backend of the kernels that scored the last pass (before any: an eager pass's)."""
        return (self.plan.scorer.kernels if self.plan is not None else self.planner.kernels(False)).backend

    @property
    def layout(self):
        return self.planner.layout

    @property
    def shards(self):
        return self.planner.shards

    @property
    def windowed(self) -> bool:
        return self.planner.layout.windowed

    # ---- what hooks read of the pass in progress ------------------------------------------------------------
    @property
    def input_start(self):
        return None if self.sequence_rows.inputs is None else self.sequence_rows.inputs.start

    @property
    def input_end(self):
        return None if self.sequence_rows.inputs is None else self.sequence_rows.inputs.end

    @property
    def n_input_list(self):
        return None if self.sequence_rows.inputs is None else self.sequence_rows.inputs.counts

    @property
    def kv_len(self):
        return None if self.plan is None else self.plan.kv_len[:, -1]

    @property
    def prefill(self) -> bool:
        return self.plan is not None and self.plan.prefill

    @property
    def variant(self):
        return PLAIN if self.plan is None else self.plan.variant

    def ranges(self) -> RowRanges:
        """The last query's ranges in the layer in progress (engines.method_rows)."""
        return RowRanges(self.input_start, self.input_end, self.kv_len, self.variant)

    def softmax_rows(self, query_last: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
        """The last query's softmax rows (B, H, S) of the layer in progress (engines.method_rows.softmax_rows)."""
        return softmax_rows(self.ranges(), query_last, key, scale)

    def window_efficient_rows(self, query_last, key, value, scale: float):
        """(efficient rows (B, H, S), residual (B, H)) of the window layer in progress
        (engines.method_rows.window_efficient_rows)."""
        return window_efficient_rows(self.ranges(), query_last, key, value, scale, self.methods.efficient_backend)

    # ---- events from generate -------------------------------------------------------------------------------
    def begin_generation(self, plan, prompt_length: int) -> None:
        """A generate call starts: its inputs are the key slots before `prompt_length` (the padded prompt,
        with any cached earlier turns)."""
        self.call = GenerateCall(plan, prompt_length, start_pending=True)
        self.sequence_rows.nan = None

    def end_generation(self, output, prompt_length: int) -> None:
        """Record what generate returned: per returned sequence its generated length (and beam ancestry)."""
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        beam_indices = None if isinstance(output, torch.Tensor) else getattr(output, "beam_indices", None)
        plan, self.call = self.call.plan, GenerateCall()
        if plan.compiled and self.steps is not None:
            self.sequence_rows.add_captured(self.steps)
        self.sequence_rows.finish(sequences.shape[0], sequences.shape[1] - prompt_length,
                                  beam_indices if plan.num_beams > 1 else None)
        self.sequence_rows.raise_on_nan()

    def abort_generation(self) -> None:
        self.call = GenerateCall()

    def record_stops(self, is_done: torch.Tensor, length: int) -> None:
        """generate's stopping criteria returned `is_done` (B,) with `length` tokens per row (prompt included)."""
        self.sequence_rows.record_stops(is_done, length - self.call.prompt_length)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search moved the cache's rows: row j now continues the sequence of row beam_idx[j]."""
        self.sequence_rows.reorder(beam_idx)
        self.methods.reorder(beam_idx)

    def check_compiled(self) -> None:
        """Refuse what this tracer does not follow under torch.compile (see check_generate for the modes)."""
        if self.windowed:
            support.check_together("generate", support.method_of(self.config), ("sliding_window", "compiled"))
        unsupported = [name for name, applies in (("per-layer hooks", self.hooks), ("tensor parallelism", self.shards),
                                                  ("keep_pooled", self.keep_pooled)) if applies]
        if unsupported:
            raise NotImplementedError(
                f"{', '.join(unsupported)} under torch.compile: not supported by macs_kernels; pass "
                "disable_compile=True or use the uncompiled forward"
            )

    # ---- one forward pass -----------------------------------------------------------------------------------
    def attention(self, module, query, key, value, attention_mask, inner, scaling=None, dropout=0.0, **kwargs):
        # torch.compile cannot trace the thread's id (a graph break in every layer): a compiled forward is checked
        # where it starts (generate's wrapper) instead.
        compiling = torch.compiler.is_compiling()
        if not compiling and threading.get_ident() != self.owner:
            raise RuntimeError(
                f"{type(module).__name__} is attached to a macs_kernels tracer owned by another thread (an "
                "explain() or a stream() that has not finished); run this call after it, or on another model instance"
            )
        if self.call.nested:
            return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer = module.layer_idx
        scale = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        wrapped = functools.partial(inner, module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
        fusable = not kwargs.get("output_attentions", False) and not module.training
        if compiling and query.shape[2] == 1 and self.steps is not None and self.call.plan is not None:
            # A compiled decode step: tensor operations on the step buffers only, so the step stays one graph.
            return self.steps.attention(layer, query, key, value, attention_mask, scale, layer_variant(kwargs, 0),
                                        wrapped, fusable)
        if layer == 0:
            self._begin_pass(query, key, attention_mask, kwargs.get("position_ids"))
        plan = self.plan
        variant = plan.variant = layer_variant(kwargs, self.planner.layout.key_offset(layer, key.shape[2]))
        if plan.fused and fusable:
            result = (plan.scorer.decode(layer, query, key, value, scale, variant), None)
        else:
            result = wrapped()
            if self.methods.active:
                plan.scorer.pool_rows(layer, self.methods.rows(self.ranges(), layer, module, query[:, :, -1, :], key,
                                                               value, scale, plan.prefill))
            else:
                plan.scorer.pool(layer, query, key, scale, variant)
        if self.methods.output_watch is not None:
            self.methods.output_watch.saw(layer, result[0])
        for hook in self.hooks:
            hook.layer(self, layer, query, key, value, result[0], scale)
        if layer == self.num_layers - 1:
            self._end_pass()
        return result

    # A pass's bookkeeping (its plan from the mask, the rows stored per step) changes Python state every pass: under a
    # user's compiled forward it runs outside the compiled region (its prefill; decode steps take `steps`).
    @torch.compiler.disable
    def _begin_pass(self, query: torch.Tensor, key: torch.Tensor, mask, positions) -> None:
        call = self.call
        if call.plan is None and self.forward_compiled():
            raise NotImplementedError(
                "a torch.compile'd forward is traced inside generate with a static cache only; call the uncompiled "
                "forward for plain forward passes"
            )
        keys = self.planner.read(query, key, mask)
        generating = call.start_pending
        prefill = self._starts_sequence(keys, mask)
        if prefill:
            self._start_sequence(keys, mask, positions, generating)
            rows = int(keys.last_end[0]) - call.prompt_length + 1 if generating else 1
        else:
            rows = keys.q_len
        if self.methods.active and rows > 1:
            raise NotImplementedError(
                f"attention={self.config.attention!r} scores one new query per pass (no verify passes)"
            )
        inputs = self.sequence_rows.inputs
        self.sequence_rows.grow_row_map(keys.keys)
        compiled = call.plan is not None and call.plan.compiled
        self.plan = self.planner.plan(keys, mask, rows, inputs, prefill=prefill, compiled=compiled,
                                      beams=call.plan.num_beams if call.plan is not None else 1)
        if prefill and compiled:
            config = self.config
            # Shaped by the cache and generate's length limit in steps of powers of two (256 at least), not by the
            # prompt: later generations in the same cache replay the graph compiled for the first.
            max_steps = call.plan.max_steps(call.prompt_length)
            self.steps = CapturedSteps.reuse_or_allocate(
                self.steps, kernels=self.plan.scorer.kernels, num_layers=self.num_layers, batch=keys.batch,
                n_max=keys.keys,
                max_rows=min(keys.keys, max(256, 1 << (max_steps - 1).bit_length())),
                device=key.device, alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
                fused=self.planner.fuses(),
            )
            self.steps.start(inputs.start, inputs.end)
        for hook in self.hooks:
            hook.begin_pass(self, prefill)

    def _starts_sequence(self, keys: PassKeys, mask) -> bool:
        if self.call.start_pending:
            self.call.start_pending = False
            return True
        if self.call.plan is not None:
            return False
        inputs = self.sequence_rows.inputs
        if inputs is None or inputs.end.shape[0] != keys.batch:
            return True
        if mask is None:
            return keys.q_len > 1 or keys.keys == 1
        # Outside generate, a pass with no cached keys before it starts a new sequence.
        return bool((keys.last_end == keys.q_len).all())

    def _start_sequence(self, keys: PassKeys, mask, positions, generating: bool) -> None:
        """In generate the inputs end where the prompt does (an assisted generation's first pass already verifies
        candidates after it); a plain forward's inputs are every key its last query attends."""
        layout, start = self.planner.layout, keys.start
        if keys.offset:
            start = layout.dropped_pads(start, keys.last_end, keys.offset, positions)
        end = torch.full_like(keys.last_end, self.call.prompt_length) if generating else keys.last_end
        layout.check_left_padding(start, keys.last_end, end, mask, keys.batch, keys.q_len, keys.slots, keys.offset,
                                  self.call.plan is not None and self.call.plan.static_cache)
        self.sequence_rows = SequenceRows(self.num_layers, self.keep_pooled)
        self.sequence_rows.start(start, end)
        self.methods.reset()

    @torch.compiler.disable
    def _end_pass(self) -> None:
        plan = self.plan
        log_c, broken = plan.scorer.finish()
        generating = self.call.plan is not None
        if generating:
            self.sequence_rows.flag_nan(broken)
        elif bool(broken.any()):
            # A plain forward's caller waits for its result anyway: a NaN row fails the call at once.
            raise FloatingPointError(NAN_MESSAGE)
        pooled = plan.scorer.pooled if self.keep_pooled else None
        self.sequence_rows.add_pass(log_c, plan.step, pooled, plain_forward=not generating)
        self.planner.layout.cache = None  # the model's cache is the caller's to free once generate returns
        for hook in self.hooks:
            hook.end_pass(self)
