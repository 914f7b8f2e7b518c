"""The generation tracer and its transformers integration.

`attach(model, **config)` swaps the model's attention implementation for a registered wrapper around it
(sdpa, eager or flash_attention_2) and wraps `model.generate`. Nothing in the tracer assumes that batch row
b is one sequence for the whole generation or that the newest key is the newest token; it follows what the
cache and `generate` say:

- a `generate` call starts new sequences: per batch row a record (input key range, row map: the MACS row
  of each generated step). The inputs are every key the first pass's last query attends, so a call on top
  of an existing cache (a continued conversation) counts the earlier turns as inputs;
- per forward pass a plan: which query rows to score, each with its key range read from the attention
  mask (a static cache hands over every slot; the mask marks the live ones). The first pass of a sequence
  scores its last query; later passes score every query (one on a decode step, K+1 on a verify pass of
  assisted decoding). Row k of a sequence is the query at key slot input_end - 1 + k, so a row computed
  again after `past_key_values.crop()` replaces the rejected one;
- a sliding-window layer's key slot j holds token j + its key offset, read each pass from the cache layer the
  model updates (the tokens it was handed less the keys it returns: dynamic windows, static rolled buffers,
  assisted decoding's crops, a cache passed in);
- per layer, the core's `DenseRows` (macs_kernels.core) picks the backend's kernel and writes m' (MACS's
  head-pooled row before the floor) of the scored rows; after the last layer it reduces over a tensor-parallel
  group, takes the floor and the log and sums over layers, once per pass;
- events that reorder rows act on the records: beam search's `reorder_cache(beam_idx)` permutes them, and
  the returned beams' rows are rebuilt from generate's `beam_indices`;
- a sequence ends where generate's stopping criteria (end-of-sequence, stop strings, the caller's) finished
  it: the tracer sees their per-row verdicts (beam search: the returned beams' `beam_indices`), so the pads
  generate appends to finished rows of a batch get no rows.

Generation modes the tracer is tested on are allowed by name; anything else raises before generation,
naming the option (`check_generate`). Under torch.compile (generate's own compile of a static-cache generation,
or a user's compiled forward) greedy and sampled generation with a static cache and softmax rows are traced:
each pass's bookkeeping runs outside the compiled region (`torch.compiler.disable`), the per-layer scoring
inside it. Per-layer extensions (AT2 query capture, row recording for
evaluation) hang on the same tracer as `TraceHook`s.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import sys
import threading
import weakref

import torch

from macs_kernels.core import support
from macs_kernels.core.config import MacsConfig
from macs_kernels.core.plans import DenseRows
from macs_kernels.core.rows import NAN_MESSAGE, RowStore
from macs_kernels.core.scores import step_scores
from macs_kernels.core.shards import HeadShards, head_shards
from macs_kernels.engines.hf_models import (
    check_model,
    check_variants,
    compiled_forward,
    layer_variant,
    passed_cache,
    set_text_attention,
    text_attention,
    window_key_offset,
)
from macs_kernels.ops import registry
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import PLAIN

# Registered names must contain neither "flash" nor "sdpa": transformers treats those specially.
WRAPPED_NAMES = {"sdpa": "macs_kernels", "eager": "macs_kernels_eager", "flash_attention_2": "macs_kernels_fa2"}


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


# ---- generation modes -----------------------------------------------------------------------------
SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")
_MODE_OPTIONS = {
    "contrastive_search": "penalty_alpha (contrastive search)",
    "dola_generation": "dola_layers (DoLa decoding)",
    "constrained_beam_search": "constraints / force_words_ids (constrained beam search)",
    "group_beam_search": "num_beam_groups (group beam search)",
}
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
# Under torch.compile (HF's own compile of a static-cache generate, or a compiled forward) the tracer's per-pass
# bookkeeping runs outside the compiled region; the modes whose rows tests prove equal to the eager reference.
COMPILED_MODES = ("greedy_search", "sample")
_GENERATE_ARGUMENTS = (
    "inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
    "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
    "custom_generate", "trust_remote_code", "assistant_tokenizer", "tokenizer",
)


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """What a `generate` call will do, as far as the tracer cares."""

    mode: str
    num_return_sequences: int
    num_beams: int
    static_cache: bool
    stop_strings: bool  # generate stops sequences at stop strings, which it needs `tokenizer=` to read
    compiled: bool = False  # the forward runs under torch.compile (HF's automatic compile or the user's)


def check_generate(model, generate_kwargs: dict, *, attention: str = "softmax") -> GenerationPlan:
    """The plan of `model.generate(**generate_kwargs)`, or an error naming the option that the tracer cannot
    follow. An allow-list: greedy, sampling, beam search (with sampling, num_return_sequences,
    length_penalty, early_stopping), assisted decoding with `assistant_model` or `prompt_lookup_num_tokens`,
    dynamic and static caches, a cache passed in (continued conversation); under torch.compile (`COMPILED_MODES`)
    greedy and sampled generation with a static cache and softmax rows."""
    from transformers import DynamicCache, StaticCache

    if generate_kwargs.get("custom_generate") is not None:
        raise NotImplementedError("custom_generate is not supported: macs_kernels traces generate's own modes only")
    config_kwargs = {k: v for k, v in generate_kwargs.items() if k not in _GENERATE_ARGUMENTS}
    config, model_kwargs = model._prepare_generation_config(generate_kwargs.get("generation_config"), **config_kwargs)
    mode = str(config.get_generation_mode(generate_kwargs.get("assistant_model")).value)
    if mode not in SUPPORTED_MODES:
        option = _MODE_OPTIONS.get(mode, f"the options that select {mode}")
        raise NotImplementedError(f"{option} is not supported by macs_kernels; supported modes: {SUPPORTED_MODES}")
    method = support.attention_method(attention)
    if getattr(config, "prefill_chunk_size", None):
        support.check("generate", method, "chunked_prefill")
    if getattr(config, "token_healing", False):
        raise NotImplementedError(
            "token_healing is not supported by macs_kernels: generate rewrites the prompt's last tokens, so the "
            "inputs it attends are not the prompt's"
        )
    for option in ("use_mtp", "assistant_early_exit"):
        if getattr(config, option, None):
            raise NotImplementedError(
                f"{option} is not supported by macs_kernels: it changes which passes see which keys"
            )
    cache_implementation = getattr(config, "cache_implementation", None)
    if cache_implementation not in SUPPORTED_CACHE_IMPLEMENTATIONS:
        raise NotImplementedError(
            f"cache_implementation={cache_implementation!r} is not supported; use one of "
            f"{SUPPORTED_CACHE_IMPLEMENTATIONS}"
        )
    videos = [name for name in ("pixel_values_videos", "video_grid_thw") if model_kwargs.get(name) is not None]
    if videos:
        raise NotImplementedError(f"video inputs ({', '.join(videos)}) are not supported by macs_kernels: it explains "
                                  "text and image prompts")
    cache = passed_cache(model_kwargs)
    if cache is not None and type(cache) not in (DynamicCache, StaticCache):
        raise NotImplementedError(
            f"past_key_values of type {type(cache).__name__} is not supported; pass a DynamicCache or StaticCache"
        )
    static = cache_implementation == "static" or isinstance(cache, StaticCache)
    compiled = compiled_forward(model) or (static and _generate_compiles(model, config))
    if compiled:
        _check_compiled(static, mode, method)
    if mode == "assisted_generation":
        support.check("generate", method, "assisted")
    beams = config.num_beams or 1
    return GenerationPlan(mode, config.num_return_sequences or 1, beams, static, config.stop_strings is not None,
                          compiled)


def _generate_compiles(model, config) -> bool:
    """Whether generate will torch.compile the decode steps of a static-cache generation: on an accelerator, or
    anywhere when its compile_config asks for all devices, unless disable_compile."""
    if getattr(config, "disable_compile", False):
        return False
    compile_config = getattr(config, "compile_config", None)
    everywhere = bool(compile_config is not None and getattr(compile_config, "_compile_all_devices", False))
    return everywhere or next(model.parameters()).device.type != "cpu"


def _check_compiled(static: bool, mode: str, method: str) -> None:
    """Refuse, before generate starts, what the tracer does not follow under torch.compile."""
    if not static:
        raise NotImplementedError(
            "a torch.compile'd forward is traced with a static cache only (cache_implementation='static'): a "
            "growing cache changes the compiled shapes every step"
        )
    if mode not in COMPILED_MODES:
        raise NotImplementedError(
            f"{mode} under torch.compile is not supported by macs_kernels; supported compiled modes: "
            f"{COMPILED_MODES} (or pass disable_compile=True, or use the uncompiled forward)"
        )
    if method != "exact":
        raise NotImplementedError(
            f"attention={method!r} under torch.compile is not supported by macs_kernels (softmax only); pass "
            "disable_compile=True or use the uncompiled forward"
        )


# ---- the tracer -----------------------------------------------------------------------------------
@dataclasses.dataclass
class _PassPlan:
    """One forward pass: the scored query rows (the last `rows` of the pass), their steps, and the core's
    accumulator that scores them per layer (`fused`: decode computes the attention output too)."""

    rows: int
    step: torch.Tensor  # (B, R): the row's index k in its sequence
    scorer: DenseRows
    fused: bool


class Tracer:
    """MACS state of the sequences that pass through one model.

    After a generate call, `rows(i)` gives (step_log_c, step_scores) of returned sequence i (generate's
    order); after plain forward calls, of batch row i. Those rows live in `store` (a RowStore keyed by i, as
    every engine keeps its finished rows; `pooled_store` holds keep_pooled's m' rows flattened to L*N): generate
    writes them when it returns, a plain forward after each pass. `passes` holds every pass's rows on the device
    as they are computed (what streaming reads while generate runs); `input_start`, `input_end`, `kv_len` (B,)
    and `n_input_list` describe the current pass (its last query) for hooks.
    """

    def __init__(self, config: MacsConfig, num_layers: int, device: torch.device, hooks=(), keep_pooled=False,
                 shards: HeadShards | None = None, variants: tuple[str, ...] = ()):
        self.config = config
        # Sliding-window layers see only their window's keys: the pass's ranges are in token positions (the
        # slots of a full layer), and each window layer's keys start at the token its cache layer says
        # (hf_models.window_key_offset): `_cache` is the cache of the pass in progress.
        self.windowed = "sliding_window" in variants
        self._cache = None
        self.variant = PLAIN  # the attention variant of the layer in progress (hooks read it)
        # Under tensor parallelism this rank pools its own heads; a pass's rows are reduced over the group.
        self.shards = shards
        # Set when the attach block hands over to continuous batching (macs_kernels.engines.continuous).
        self.continuous = None
        self.num_layers = num_layers
        self.hooks = list(hooks)
        self.keep_pooled = keep_pooled
        # A compiled pass and an eager one may run different kernels (registry.default_backend): each pass takes
        # those of how it runs.
        self._kernel_choice = functools.cache(functools.partial(registry.engine_kernels, config.backend, device,
                                                                variants))
        self.kernels = self._kernel_choice(captured=False)
        self._fused = config.fused_decode if config.fused_decode is not None else self.backend != "torch"
        self._efficient_backend = registry.op_backend(config.backend, device, "efficient_attention")
        self.owner = threading.get_ident()
        self._norm_grams: dict = {}  # attention="norm": each layer's head Gram matrices, kept across sequences
        self.output_watch = None  # attention="norm": norm.OutputWatch, set by attach
        self._generation = None  # the GenerationPlan of the generate call in progress
        self._nan = None  # whether a pass of the last generate call held a NaN: a bool tensor on the device
        self._start_pending = False
        self._prompt_length = None
        self._static = False
        self._suspended = 0
        self.prefill = False  # whether the pass in progress starts a sequence
        self.forward_compiled = lambda: False  # whether the model's forward is torch.compile'd now (set by attach)
        self.reset()

    @property
    def backend(self) -> str:
        """The backend of the kernels that scored the last pass (before any: an eager pass's)."""
        return self.kernels.backend

    def reset(self) -> None:
        self.passes: list[dict] = []
        self._bases: list[int] = []
        self._stored = 0
        # A generate call keeps every sequence it returned until the next sequence starts (keep_more).
        self.store = RowStore(keep_finished=0)
        self.pooled_store = RowStore(keep_finished=0) if self.keep_pooled else None
        self.input_start = self.input_end = self.kv_len = self.n_input = None
        self.n_input_list: list[int] | None = None
        self._unpadded = False  # every item's inputs are keys [0, N) with one N (set per sequence)
        self._row_map = None
        # Per batch row of a greedy, sampling or assisted generate: how many tokens it had generated when the
        # stopping criteria finished it (-1 while it runs). generate then appends pads (or, without an
        # end-of-sequence criterion, whatever it samples) until every row is done.
        self._stops = None
        self._beam_indices = None
        self._returned = None
        self._plan = None
        self._gram = self._norms = None
        if self.config.attention == "efficient":
            from macs_kernels.core.methods.efficient import GramState

            self._gram = GramState(self.num_layers)
        if self.config.attention == "norm":
            from macs_kernels.core.methods.norm import NormState

            self._norms = NormState(self._norm_grams)

    # ---- events from generate ---------------------------------------------------------------------
    def begin_generation(self, plan: GenerationPlan, prompt_length: int) -> None:
        """A generate call starts: its inputs are the key slots before `prompt_length` (the padded prompt,
        with any cached earlier turns)."""
        self._generation, self._start_pending, self._static = plan, True, plan.static_cache
        self._prompt_length = prompt_length
        self._nan = None

    def end_generation(self, output, prompt_length: int) -> None:
        """Record what generate returned: per returned sequence its generated length (and beam ancestry)."""
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        beam_indices = None if isinstance(output, torch.Tensor) else getattr(output, "beam_indices", None)
        self._beam_indices = beam_indices if self._generation.num_beams > 1 else None
        self._returned = (sequences.shape[0], sequences.shape[1] - prompt_length)
        self._generation = None
        self._store_returned()
        self._raise_on_nan()

    def _raise_on_nan(self) -> None:
        """Fail for a NaN row that a pass of the last generate call flagged on the device (a host sync)."""
        if self._nan is not None and bool(self._nan):
            raise FloatingPointError(NAN_MESSAGE)

    def record_stops(self, is_done: torch.Tensor, length: int) -> None:
        """generate's stopping criteria returned `is_done` (B,) with `length` tokens per row (prompt included):
        a row's sequence ends the first time it is done."""
        if self._stops is None:
            self._stops = torch.full(is_done.shape, -1, dtype=torch.int64, device=is_done.device)
        self._stops = torch.where(is_done & (self._stops < 0), length - self._prompt_length, self._stops)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search moved the cache's rows: row j now continues the sequence of row beam_idx[j]."""
        if self._row_map is None:
            return
        beam_idx = beam_idx.to(self._row_map.device)
        self._row_map = self._row_map.index_select(0, beam_idx)
        for state in (self._gram, self._norms):
            if state is not None:
                state.reorder(beam_idx)

    def check_compiled(self) -> None:
        """Refuse what this tracer does not follow under torch.compile (see check_generate for the modes)."""
        unsupported = [name for name, applies in (("per-layer hooks", self.hooks), ("tensor parallelism", self.shards),
                                                  ("sliding-window layers", self.windowed)) if applies]
        if unsupported:
            raise NotImplementedError(
                f"{', '.join(unsupported)} under torch.compile: not supported by macs_kernels; pass "
                "disable_compile=True or use the uncompiled forward"
            )

    # ---- one forward pass -------------------------------------------------------------------------
    # Under torch.compile a pass's bookkeeping (its plan from the mask, the rows stored per step) runs outside the
    # compiled region: it changes Python state every step, which the compiled code would guard on and recompile for.
    @torch.compiler.disable
    def _begin_pass(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, positions) -> None:
        if self._generation is None and self.forward_compiled():
            raise NotImplementedError(
                "a torch.compile'd forward is traced inside generate with a static cache only; call the uncompiled "
                "forward for plain forward passes"
            )
        batch, q_len, slots = query.shape[0], query.shape[2], key.shape[2]
        # Layer 0's mask is over its own key slots; a window layer's slot j holds token j + offset.
        offset = self._key_offset(0, slots)
        keys = slots + offset
        # A window's last query does not attend the first inputs: where inputs start, every query row says.
        attended = _any_row_attended if self.windowed else _last_row_attended
        start = attended(mask, batch, slots, key.device).int().argmax(-1).long() + offset
        last_end = _row_ends(mask, batch, q_len, slots, 1, key.device)[:, 0] + offset
        generating = self._start_pending
        self.prefill = self._starts_sequence(batch, q_len, keys, mask, last_end)
        if self.prefill and offset:
            start = self._dropped_pads(start, last_end, offset, positions)
        if self.prefill:
            # In generate the inputs end where the prompt does; an assisted generation's first pass already
            # verifies candidates after it. A plain forward's inputs are every key its last query attends.
            end = torch.full_like(last_end, self._prompt_length) if generating else last_end
            self._start_sequence(start, last_end, end, mask, batch, q_len, slots, offset)
            rows = int(last_end[0]) - self._prompt_length + 1 if generating else 1
        else:
            rows = q_len
        if (self._gram is not None or self._norms is not None) and rows > 1:
            raise NotImplementedError(
                f"attention={self.config.attention!r} scores one new query per pass (no verify passes)"
            )
        kv_len = last_end[:, None] if rows == 1 else _row_ends(mask, batch, q_len, slots, rows, key.device) + offset
        self.kv_len = kv_len[:, -1]
        step = kv_len - self.input_end[:, None]
        self._grow_row_map(keys)
        config = self.config
        # Every slot [0, S) attended by one row: an unpadded dynamic cache (the mask was dropped).
        dense = mask is None and rows == 1 and (q_len == 1 or q_len == keys)
        # A verify pass of an unpadded batch whose rows attend every slot causally (one host sync per pass).
        causal_block = rows > 1 and self._unpadded and bool(
            (kv_len == torch.arange(keys - rows + 1, keys + 1, device=kv_len.device)).all()
        )
        self.kernels = self._kernel_choice(captured=self._generation is not None and self._generation.compiled)
        has_dense = self.kernels.pool_dense is not None
        scorer = DenseRows(
            self.kernels, self.num_layers, input_start=self.input_start, input_end=self.input_end, kv_len=kv_len,
            n_max=max(self.n_input_list), pooling=config.pooling, redistribute=config.redistribute,
            alpha=config.alpha, n_dense=self.n_input_list[0] if has_dense and (dense or causal_block) else None,
            beams=self._generation.num_beams if self._generation is not None else 1, shards=self.shards,
        )
        verify_block = causal_block and has_dense and not self.windowed
        fused = self._fused and not self.prefill and (q_len == 1 or verify_block) and self.config.attention == "softmax"
        self._plan = _PassPlan(rows, step, scorer, fused)
        for hook in self.hooks:
            hook.begin_pass(self, self.prefill)

    def _key_offset(self, layer: int, keys: int) -> int:
        """The token that key slot 0 of `layer` holds in this pass (0 but for a window layer's cache)."""
        return window_key_offset(self._cache, layer, keys) if self.windowed else 0

    def _dropped_pads(self, start, last_end, offset: int, positions):
        """Where the inputs of a sequence start when layer 0's window cache already dropped its first tokens (a
        cache passed in): the last query's position id counts the attended tokens before it (generate's
        position ids), so the pads are its slot less its position. The window's mask must agree."""
        if positions is None or positions.dim() != 2:
            raise NotImplementedError(
                "a sliding-window model's cache passed in without (B, S) position_ids: the tracer cannot tell where "
                "the inputs its window layers no longer hold start"
            )
        counted = last_end - 1 - positions[:, -1].to(last_end.device).expand_as(last_end)
        seen_all = start == offset  # the window's first slot attended: the pads, if any, lie before it
        if bool(((counted < 0) | (seen_all & (counted > offset)) | (~seen_all & (counted != start))).any()):
            raise ValueError(
                "the position_ids do not count the attended tokens of a left-padded sequence (attended keys must "
                "form one run ending at the last key, position ids counting them from 0); pad on the left"
            )
        return counted

    def _starts_sequence(self, batch, q_len, keys, mask, last_end) -> bool:
        if self._start_pending:
            self._start_pending = False
            return True
        if self._generation is not None:
            return False
        if self.input_end is None or self.input_end.shape[0] != batch:
            return True
        if mask is None:
            return q_len > 1 or keys == 1
        # Outside generate, a pass with no cached keys before it starts a new sequence.
        return bool((last_end == q_len).all())

    def _start_sequence(self, start, last_end, end, mask, batch, q_len, slots, offset) -> None:
        # One host sync per sequence: the attended keys must be one contiguous run, the last query (a
        # prompt token, not a right pad) attends its own slot, and the inputs are not empty. Without a
        # mask there are no pads. The mask covers layer 0's `slots` key slots, from token `offset` on.
        bad = end <= start
        if mask is not None:
            attended = _any_row_attended if self.windowed else _last_row_attended
            counts = attended(mask, batch, slots, start.device).sum(-1)
            ends_at_query = (last_end - offset == q_len) | (last_end - offset == slots) | self._static
            bad = bad | (last_end - start.clamp(min=offset) != counts) | ~ends_at_query
        if bool(bad.any()):
            raise ValueError(
                "the attention mask is not left padding (attended keys must form one run ending at the "
                "last key); pad on the left"
            )
        self.reset()
        self.input_start, self.input_end = start, end
        self.n_input = end - start
        self.n_input_list = self.n_input.tolist()
        self._unpadded = len(set(self.n_input_list)) == 1 and not bool(start.any())
        self._row_map = torch.full((batch, 0), -1, dtype=torch.int64, device=start.device)

    def _grow_row_map(self, keys: int) -> None:
        # Row k is the query at slot input_end - 1 + k < keys: the map never needs more than `keys` columns.
        missing = keys - self._row_map.shape[1]
        if missing > 0:
            pad = torch.full((self._row_map.shape[0], missing), -1, dtype=torch.int64, device=self._row_map.device)
            self._row_map = torch.cat([self._row_map, pad], dim=1)

    def _gram_values(self, value):
        """(values (B, H_kv, T, D), valid (B, T)) of this pass's new slots in one full layer's value cache: every
        attended slot on a sequence's first pass (prompt, earlier turns), then the new token's slot (a static
        cache writes it anywhere)."""
        if self.prefill:
            slots = torch.arange(value.shape[2], device=value.device)
            return value, (slots >= self.input_start[:, None]) & (slots < self.kv_len[:, None])
        index = (self.kv_len - 1).view(-1, 1, 1, 1).expand(-1, value.shape[1], 1, value.shape[3])
        return value.gather(2, index), torch.ones(value.shape[0], 1, dtype=torch.bool, device=value.device)

    @torch.compiler.disable
    def _end_pass(self) -> None:
        plan = self._plan
        log_c, broken = plan.scorer.finish()
        if self._generation is None:
            # A plain forward's caller waits for its result anyway: a NaN row fails the call at once.
            if bool(broken.any()):
                raise FloatingPointError(NAN_MESSAGE)
        else:
            # Inside generate the flag stays on the device, so that a step makes no host sync; the call fails
            # when generate returns (or when a streaming reader reads a row first).
            self._nan = broken.any() if self._nan is None else self._nan | broken.any()
        batch, rows, n_max = log_c.shape
        flat = log_c.view(batch * rows, n_max)
        ids = self._stored + torch.arange(batch * rows, device=flat.device).view(batch, rows)
        self._row_map.scatter_(1, plan.step, ids)
        record = {"log_c": flat, "rows": rows}
        if self.keep_pooled:
            pooled = plan.scorer.pooled
            record["pooled"] = pooled.permute(1, 2, 0, 3).reshape(batch * rows, self.num_layers, n_max)
        self._bases.append(self._stored)
        self._stored += batch * rows
        self.passes.append(record)
        if self._generation is None and self._returned is None:
            # A plain forward's sequence may go on in the next call: its rows are stored as they come. (One that
            # continues a generate call's cache adds no rows to the sequences generate returned.)
            steps, pooled = plan.step.tolist(), record.get("pooled")
            for item, n in enumerate(self.n_input_list):
                own = None if pooled is None else pooled[item * rows:(item + 1) * rows]
                self._store_rows(item, n, steps[item], log_c[item], own)
        self._cache = None  # the model's cache is the caller's to free once generate returns
        for hook in self.hooks:
            hook.end_pass(self)

    def softmax_rows(self, query_last: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
        """The last query's softmax rows (B, H, S) over the attended keys (zeros elsewhere), float32, of the layer
        in progress: with its variant (`variant`), over token positions (a window layer's rows padded with zeros
        for the tokens its cache dropped)."""
        rows, _, _ = self._layer_softmax(query_last, key, scale)
        return self._in_tokens(rows)

    def _layer_softmax(self, query_last, key, scale):
        """(rows (B, H, S) over the layer's own key slots, their attended [start, end) slots (B,) each)."""
        variant = self.variant
        scores = torch_backend.grouped_scores(query_last, key, scale)
        attend, _, _, length = torch_backend.window_ranges(self.input_start, self.input_end, self.kv_len,
                                                           variant.key_offset, variant.window)
        rows, _ = torch_backend.attended_softmax(scores, attend, length, softcap=variant.softcap,
                                                 sinks=variant.sinks)
        return rows, attend, length

    def _in_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        offset = self.variant.key_offset
        return torch.nn.functional.pad(rows, (offset, 0)) if offset else rows

    def window_efficient_rows(self, query_last, key, value, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(efficient rows (B, H, S) in token positions, residual (B, H)) of the last query of the window layer in
        progress: its softmax row projected onto its window's values (the layer's cache holds the window only,
        so their Gram matrix is recomputed, O(W D^2))."""
        from macs_kernels.ops import efficient_attention

        rows, attend, length = self._layer_softmax(query_last, key, scale)
        projected, residual = efficient_attention(rows[:, :, None], value, kv_start=attend, kv_len=length,
                                                  backend=self._efficient_backend)
        return self._in_tokens(projected[:, :, 0]), residual[:, :, 0]

    def _efficient_pool(self, layer: int, query_last, key, value, scale: float) -> None:
        """m' of the last query's efficient rows, after adding this pass's values to the Gram state. A window
        layer's row projects onto its window's values (the keys it attends): their Gram matrix is recomputed
        from the layer's cache, which holds the window only."""
        from macs_kernels.core.methods.efficient import efficient_rows

        if self.variant.window is not None:
            self._plan.scorer.pool_rows(layer, self.window_efficient_rows(query_last, key, value, scale)[0])
            return
        self._gram.append(layer, *self._gram_values(value))
        rows, _ = efficient_rows(
            self.softmax_rows(query_last, key, scale), value, self._gram.gram(layer), self.input_start,
            self.kv_len, backend=self._efficient_backend,
        )
        self._plan.scorer.pool_rows(layer, rows)

    def _norm_pool(self, layer: int, module, query_last, key, value, scale: float) -> None:
        """m' of the last query's norm-weighted rows (macs_kernels.core.methods.norm), after adding this pass's values'
        norms to the norm state."""
        from macs_kernels.core.methods.norm import norm_weighted_rows

        norms = self._norms.update(layer, module, value, self.prefill, self.kv_len)
        rows = norm_weighted_rows(self.softmax_rows(query_last, key, scale), norms)
        self._plan.scorer.pool_rows(layer, rows)

    def attention(self, module, query, key, value, attention_mask, inner, scaling=None, dropout=0.0, **kwargs):
        # torch.compile cannot trace the thread's id (a graph break in every layer): a compiled forward is checked
        # where it starts (generate's wrapper) instead.
        if not torch.compiler.is_compiling() and threading.get_ident() != self.owner:
            raise RuntimeError(
                f"{type(module).__name__} is attached to a macs_kernels tracer owned by another thread (an "
                "explain() or a stream() that has not finished); run this call after it, or on another model instance"
            )
        if self._suspended:
            return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer = module.layer_idx
        if layer == 0:
            self._begin_pass(query, key, value, attention_mask, kwargs.get("position_ids"))
        scale = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        plan = self._plan
        variant = self.variant = layer_variant(kwargs, self._key_offset(layer, key.shape[2]))
        if plan.fused and not kwargs.get("output_attentions", False) and not module.training:
            result = (plan.scorer.decode(layer, query, key, value, scale, variant), None)
        else:
            result = inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            if self._gram is not None:
                self._efficient_pool(layer, query[:, :, -1, :], key, value, scale)
            elif self._norms is not None:
                self._norm_pool(layer, module, query[:, :, -1, :], key, value, scale)
            else:
                plan.scorer.pool(layer, query, key, scale, variant)
        if self.output_watch is not None:
            self.output_watch.saw(layer, result[0])
        for hook in self.hooks:
            hook.layer(self, layer, query, key, value, result[0], scale)
        if layer == self.num_layers - 1:
            self._end_pass()
        return result

    # ---- results ----------------------------------------------------------------------------------
    def sequences(self) -> int:
        """How many sequences there are rows for: generate's returned sequences, or the batch rows."""
        if self._returned is not None:
            return self._returned[0]
        return 0 if self._row_map is None else self._row_map.shape[0]

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

    def _store_returned(self) -> None:
        """Resolve each sequence generate returned to its rows and store them (host syncs once generate is done,
        never in a step). A NaN flagged in any pass fails every sequence's rows, as RowStore does."""
        count = self._returned[0]
        for store in (self.store, self.pooled_store):
            if store is not None:
                store.keep_more(count)
        if not self.passes:
            return
        log_c = torch.cat([p["log_c"] for p in self.passes])
        pooled = torch.cat([p["pooled"] for p in self.passes]) if self.keep_pooled else None
        broken = self._nan is not None and bool(self._nan)
        for item in range(count):
            ids, batch_row = self._row_ids(item)
            own = None if pooled is None else pooled[ids]
            self._store_rows(item, self.n_input_list[batch_row], range(ids.numel()), log_c[ids], own)
            if broken:
                self.store.put([(item, 0, None)])
            for store in (self.store, self.pooled_store):
                if store is not None:
                    store.finish(item)

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
        steps = min(written, self._returned[1])
        stop = -1 if self._stops is None else int(self._stops[item])
        return row[:steps if stop < 0 else min(steps, stop)], item

    def _check_item(self, item: int) -> None:
        if not self.passes:
            raise RuntimeError("nothing was traced: run a forward or generate call inside attach()")
        if not 0 <= item < self.sequences():
            raise IndexError(f"sequence {item} is outside [0, {self.sequences()})")

    # ---- continuous batching (after generate_batch / init_continuous_batching ran in the attach block) ----
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

    def rows(self, item: int, steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores) of sequence `item`: (steps, N_item) float32 tensors on the CPU; step_scores
        are Explanation's, the z-scores of each row's log c (core.SCORES["log_z"]), as request_rows returns.

        Default steps: every token of the sequence (generate: up to where its stopping criteria finished it,
        not the pads generate appends while other rows go on) or every scored row (plain forwards)."""
        self._check_item(item)
        if steps is not None and steps > self.store.count(item):
            raise ValueError(f"sequence {item} has {self.store.count(item)} rows, fewer than the {steps} asked for")
        log_c = self.store.rows(item, 0, steps)
        return log_c, step_scores(log_c)

    def pooled_rows(self, item: int, steps: int | None = None) -> torch.Tensor:
        """(steps, L, N_item) float32 m' per layer of sequence `item` (needs keep_pooled=True)."""
        if not self.keep_pooled:
            raise RuntimeError("pooled rows are kept only with keep_pooled=True")
        self._check_item(item)
        flat = self.pooled_store.rows(item, 0, steps)
        return flat.view(flat.shape[0], self.num_layers, -1)

    def row(self, item: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_c, its z-scores as in `rows`) (N_item,) of row `step` of batch row `item` while generating (one host
        sync)."""
        log_c = self.row_log_c(item, step)
        return log_c, step_scores(log_c)

    def row_log_c(self, item: int, step: int) -> torch.Tensor:
        """log c (N_item,) of row `step` of batch row `item` while generating: a streaming reader's O(1) read."""
        self._raise_on_nan()
        global_id = int(self._row_map[item, step])
        if global_id < 0:
            raise IndexError(f"row {step} of sequence {item} was not computed")
        index = bisect.bisect_right(self._bases, global_id) - 1
        record, offset = self.passes[index], global_id - self._bases[index]
        return record["log_c"][offset, : self.n_input_list[item]].cpu()


def _last_row_attended(mask, batch: int, keys: int, device) -> torch.Tensor:
    """(B, S) bool: which keys the LAST query attends, from whatever mask the wrapped implementation uses."""
    if mask is None:
        return torch.ones(batch, keys, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask (B, S), 1 = token
        return mask.bool()
    return _attended(mask[:, 0, -1, :]).expand(batch, keys)


def _any_row_attended(mask, batch: int, keys: int, device) -> torch.Tensor:
    """(B, S) bool: which keys ANY query of the pass attends (a window's last query does not attend them all)."""
    if mask is None or mask.dim() == 2:
        return _last_row_attended(mask, batch, keys, device)
    return _attended(mask[:, 0]).any(dim=1).expand(batch, keys)


def _attended(mask_rows: torch.Tensor) -> torch.Tensor:
    if mask_rows.dtype == torch.bool:
        return mask_rows
    return mask_rows > torch.finfo(mask_rows.dtype).min / 2  # additive float mask


def _row_ends(mask, batch, q_len, keys, rows, device) -> torch.Tensor:
    """(B, rows) int64: last attended key + 1 of the pass's last `rows` queries (each one's causal end).

    Without a mask, sdpa runs causal attention aligned at the first key: a multi-token pass then starts at
    slot 0 (a static cache's prefill hands over every slot), a one-token pass attends every slot. A
    flash-attention padding mask aligns the queries with the last keys."""
    if mask is None:
        first = keys if q_len == 1 else q_len - rows + 1
        return (first + torch.arange(rows, device=device)).expand(batch, rows)
    if mask.dim() == 2:
        return (keys - rows + 1 + torch.arange(rows, device=device)).expand(batch, rows)
    attended = _attended(mask[:, 0, -rows:, :]).expand(batch, rows, keys)
    return keys - attended.flip(-1).int().argmax(-1).long()


# ---- transformers integration ---------------------------------------------------------------------
def _model_eager(module):
    """The eager attention function of the module's own modeling file (transformers keeps eager out of
    the registry)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise TypeError(f"{type(module).__name__} has no module-level eager_attention_forward to wrap")
    return function


def _traced_attention(wrapped: str):
    from transformers import AttentionInterface

    registry = AttentionInterface()

    def forward(module, query, key, value, attention_mask, **kwargs):
        tracer = getattr(module, "_macs_tracer", None)
        if tracer is None:
            raise RuntimeError(
                f"{type(module).__name__} runs macs_kernels attention but no tracer is attached; "
                "use macs_kernels.attach(model)"
            )
        inner = _model_eager(module) if wrapped == "eager" else registry[wrapped]
        return tracer.attention(module, query, key, value, attention_mask, inner, **kwargs)

    return forward


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for wrapped, name in WRAPPED_NAMES.items():
        AttentionInterface.register(name, _traced_attention(wrapped))
        # Without a mask function of our own, transformers passes no mask and padded batches go wrong.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[wrapped])


_LOCKS_GUARD = threading.Lock()


def _model_lock(model) -> threading.RLock:
    """One lock per model: attaching is atomic, and a second explain() on the model waits for the first."""
    with _LOCKS_GUARD:
        lock = model.__dict__.get("_macs_lock")
        if lock is None:
            lock = model.__dict__["_macs_lock"] = threading.RLock()
        return lock


def _traced_generate(model, tracer: Tracer, generate):
    """`model.generate` while attached: checks the mode (allow-list), tells the tracer where a generation
    starts and what it returned. A generate nested in another (the model as its own assistant) runs
    untraced."""

    @functools.wraps(generate)
    def traced(*args, **kwargs):
        if threading.get_ident() != tracer.owner:
            raise RuntimeError(
                "this model is attached to a macs_kernels tracer owned by another thread (an explain() or a "
                "stream() that has not finished); generate after it, or on another model instance"
            )
        if tracer.continuous is not None:
            raise RuntimeError(
                "this attach block serves continuous batching (generate_batch / init_continuous_batching ran in "
                "it); call generate in another attach block"
            )
        if tracer._generation is not None:
            tracer._suspended += 1
            try:
                return generate(*args, **kwargs)
            finally:
                tracer._suspended -= 1
        inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if not isinstance(inputs, torch.Tensor):
            raise NotImplementedError(
                "generate without input_ids (inputs_embeds) is not supported: the tracer needs the prompt's token slots"
            )
        plan = check_generate(model, kwargs, attention=tracer.config.attention)
        layouts = [layout for layout, applies in (("beams", plan.num_beams > 1),
                                                  ("assisted", plan.mode == "assisted_generation")) if applies]
        for hook in tracer.hooks:
            for layout in layouts if hook.method is not None else ():
                support.check("generate", hook.method, layout)
        if plan.compiled:
            tracer.check_compiled()
        wants_dict = kwargs.get("return_dict_in_generate", False)
        if plan.num_beams > 1:
            kwargs["return_dict_in_generate"] = True  # the returned beams' ancestry: beam_indices
        tracer.begin_generation(plan, inputs.shape[-1])
        try:
            output = generate(*args, **kwargs)
        except BaseException:
            tracer._generation = None
            raise
        tracer.end_generation(output, inputs.shape[-1])
        return output if wants_dict or isinstance(output, torch.Tensor) else output.sequences

    return traced


# The ways into transformers' continuous-batching engine (which accepts only its own attention names).
_CONTINUOUS_ENTRIES = ("generate_batch", "init_continuous_batching")


def _continuous_entry(model, tracer: Tracer, name: str, saved: dict, previous: str, stack: contextlib.ExitStack):
    """`model.<name>` while attached: the first call hands the rest of the attach block to a continuous-batching
    tracer (macs_kernels.engines.continuous), whose rows `tracer.request_rows(request_id)` reads."""

    def enter(*args, **kwargs):
        if tracer.continuous is None:
            from macs_kernels.engines.continuous import attach_continuous

            # Refused before the hand-over changes anything: the block keeps tracing generate.
            support.check_method("continuous", support.method_of(tracer.config))
            check_variants(model, "continuous", support.method_of(tracer.config))

            for entry in _CONTINUOUS_ENTRIES:  # the engine's own methods again, for the continuous tracer to wrap
                if entry in saved:
                    setattr(model, entry, saved[entry])
                else:
                    model.__dict__.pop(entry, None)
            set_text_attention(model, previous)
            config = tracer.config.as_dict() | {"fused_decode": None}
            tracer.continuous = stack.enter_context(attach_continuous(model, **config))
        return getattr(model, name)(*args, **kwargs)

    return functools.wraps(getattr(model, name))(enter)


def _traced_stopping_criteria(tracer: Tracer, get_criteria):
    """`model._get_stopping_criteria` while attached: the criteria of a traced generate also tell the tracer
    which rows they finished (`Tracer.record_stops`). Beam search calls its criteria on candidate beams; the
    returned beams' lengths come from beam_indices instead."""
    from transformers import StoppingCriteriaList

    class ObservedCriteria(StoppingCriteriaList):
        def __call__(self, input_ids, scores, **kwargs):
            is_done = super().__call__(input_ids, scores, **kwargs)
            tracer.record_stops(is_done, input_ids.shape[-1])
            return is_done

    @functools.wraps(get_criteria)
    def criteria(*args, **kwargs):
        found = get_criteria(*args, **kwargs)
        generation = tracer._generation
        if tracer._suspended or generation is None or generation.num_beams > 1:
            return found
        return ObservedCriteria(found)

    return criteria


def _traced_reorder(tracer: Tracer, reorder):
    def reorder_cache(cache, beam_idx):
        if not tracer._suspended:
            tracer.reorder(beam_idx)
        if reorder is not None:
            return reorder(cache, beam_idx)
        cache.reorder_cache(beam_idx)
        return cache

    return reorder_cache


def _cache_reader(tracer: Tracer):
    """A forward pre-hook on layer 0's attention module: the cache of the pass in progress (None without one)."""

    def read(module, args, kwargs):
        tracer._cache = passed_cache(kwargs)

    return read


@contextlib.contextmanager
def attach(model, *, hooks=(), keep_pooled=False, **config):
    """Trace every generate/forward call on `model` inside the block; yields the `Tracer`.

    config: MacsConfig fields (alpha, pooling, redistribute, attention, backend, fused_decode). The model's
    previous attention implementation (sdpa, eager or flash_attention_2) is wrapped, and restored on exit.
    Attaching holds the model's lock: another thread's attach waits, and another thread's forward or
    generate on the attached model raises. keep_pooled: keep every pass's per-layer m' (`pooled_rows`).
    """
    macs_config = MacsConfig(**config)
    modules = check_model(model)
    shards = head_shards(model, modules)
    variants = check_variants(model, "generate", support.method_of(macs_config))
    if shards is not None:
        support.check("generate", support.method_of(macs_config), "tensor_parallel")
    if macs_config.attention == "norm":
        from macs_kernels.core.methods.norm import check_projections

        check_projections(model, modules)
    for hook in hooks:
        if hook.method is not None:
            check_variants(model, "generate", hook.method)
    with _model_lock(model):
        previous = text_attention(model)
        if previous in WRAPPED_NAMES.values():
            raise RuntimeError("a macs_kernels tracer is already attached to this model")
        if previous not in WRAPPED_NAMES:
            raise ValueError(f"cannot wrap attention implementation {previous!r}; use one of {list(WRAPPED_NAMES)}")
        device = next(model.parameters()).device
        tracer = Tracer(macs_config, len(modules), device, hooks, keep_pooled=keep_pooled, shards=shards,
                        variants=variants)
        model_ref = weakref.ref(model)  # the tracer outlives the block: it must not keep the model alive
        tracer.forward_compiled = lambda: compiled_forward(model_ref())
        _register()
        wrapped = ("generate", "_reorder_cache", "_get_stopping_criteria", *_CONTINUOUS_ENTRIES)
        saved = {name: model.__dict__[name] for name in wrapped if name in model.__dict__}
        for module in modules.values():
            module._macs_tracer = tracer
        # A window layer's keys start where its cache layer says: the tracer reads the cache each pass hands in.
        cache_hook = modules[0].register_forward_pre_hook(_cache_reader(tracer), with_kwargs=True) \
            if tracer.windowed else None
        model.generate = _traced_generate(model, tracer, model.generate)
        model._reorder_cache = _traced_reorder(tracer, getattr(model, "_reorder_cache", None))
        model._get_stopping_criteria = _traced_stopping_criteria(tracer, model._get_stopping_criteria)
        continuous = contextlib.ExitStack()
        for name in _CONTINUOUS_ENTRIES:
            setattr(model, name, _continuous_entry(model, tracer, name, saved, previous, continuous))
        set_text_attention(model, WRAPPED_NAMES[previous])
        if macs_config.attention == "norm":
            from macs_kernels.core.methods.norm import OutputWatch

            tracer.output_watch = continuous.enter_context(OutputWatch(modules))
        try:
            yield tracer
        finally:
            continuous.close()
            set_text_attention(model, previous)
            for name in wrapped:
                if name in saved:
                    setattr(model, name, saved[name])
                else:
                    model.__dict__.pop(name, None)
            for module in modules.values():
                del module._macs_tracer
            if cache_hook is not None:
                cache_hook.remove()
