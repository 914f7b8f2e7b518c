"""attach(): the generation tracer's transformers integration.

`attach(model, **config)` swaps the model's attention implementation for a registered wrapper around it (sdpa, eager
or flash_attention_2) that hands every layer's call to the `Tracer` (engines.tracer), and wraps the model's generate
methods so that the tracer sees what it cannot read from a pass: where a generate call starts and what it returned
(`check_generate` refuses, before generation, what it does not follow: engines.generation_modes), which rows its
stopping criteria finished, how beam search reordered the cache, the cache a window layer reads, and the hand-over to
continuous batching. Per-layer extensions (AT2 query capture, row recording for evaluation) hang on the same tracer
as `TraceHook`s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import weakref

import torch

from macs_kernels.core import support
from macs_kernels.core.config import MacsConfig, config_of
from macs_kernels.core.shards import head_shards
from macs_kernels.engines.generation_modes import (  # noqa: F401 - the public names of this module
    COMPILED_MODES,
    SUPPORTED_MODES,
    GenerationPlan,
    check_generate,
)
from macs_kernels.engines.hf_models import (  # noqa: F401 - check_model: a public name of this module
    check_model,
    check_variants,
    compiled_forward,
    passed_cache,
    set_text_attention,
    text_attention,
)
from macs_kernels.engines.tracer import TraceHook, Tracer  # noqa: F401 - TraceHook: a public name of this module

# Registered names must contain neither "flash" nor "sdpa": transformers treats those specially.
WRAPPED_NAMES = {"sdpa": "macs_kernels", "eager": "macs_kernels_eager", "flash_attention_2": "macs_kernels_fa2"}


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
        if tracer.call.plan is not None:
            tracer.call.nested += 1
            try:
                return generate(*args, **kwargs)
            finally:
                tracer.call.nested -= 1
        inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if not isinstance(inputs, torch.Tensor):
            raise NotImplementedError(
                "generate without input_ids (inputs_embeds) is not supported: the tracer needs the prompt's token slots"
            )
        plan = check_generate(model, kwargs, attention=tracer.config.attention, prompt_length=inputs.shape[-1])
        layouts = [layout for layout, applies in (("beams", plan.num_beams > 1), ("compiled", plan.compiled),
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
            tracer.abort_generation()
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
            config = dataclasses.replace(tracer.config, fused_decode=None)
            tracer.continuous = stack.enter_context(attach_continuous(model, config=config))
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
        generation = tracer.call.plan
        if tracer.call.nested or generation is None or generation.num_beams > 1:
            return found
        return ObservedCriteria(found)

    return criteria


def _traced_reorder(tracer: Tracer, reorder):
    def reorder_cache(cache, beam_idx):
        if not tracer.call.nested:
            tracer.reorder(beam_idx)
        if reorder is not None:
            return reorder(cache, beam_idx)
        cache.reorder_cache(beam_idx)
        return cache

    return reorder_cache


def _cache_reader(tracer: Tracer):
    """A forward pre-hook on layer 0's attention module: the cache of the pass in progress (None without one)."""

    def read(module, args, kwargs):
        tracer.layout.cache = passed_cache(kwargs)

    return read


@contextlib.contextmanager
def attach(model, *, hooks=(), keep_pooled=False, config: MacsConfig | None = None, **options):
    """Trace every generate/forward call on `model` inside the block; yields the `Tracer`.

    config: the MacsConfig (an entry point passes its own on), or options: its fields (alpha, pooling, redistribute,
    attention, backend, fused_decode). The model's previous attention implementation (sdpa, eager or
    flash_attention_2) is wrapped, and restored on exit. Attaching holds the model's lock: another thread's attach
    waits, and another thread's forward or generate on the attached model raises. keep_pooled: keep every pass's
    per-layer m' (`pooled_rows`).
    """
    macs_config = config_of(config, options)
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

            tracer.methods.output_watch = continuous.enter_context(OutputWatch(modules))
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
