"""Which `generate` calls the tracer follows: an allow-list of generation modes and options, checked before
generation starts (`check_generate`), and what a call will do as far as the tracer cares (`GenerationPlan`). Anything
else raises, naming the option."""
from __future__ import annotations

import dataclasses

from macs_kernels.core import support
from macs_kernels.engines.hf_models import compiled_forward, passed_cache

SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")
_MODE_OPTIONS = {
    "contrastive_search": "penalty_alpha (contrastive search)",
    "dola_generation": "dola_layers (DoLa decoding)",
    "constrained_beam_search": "constraints / force_words_ids (constrained beam search)",
    "group_beam_search": "num_beam_groups (group beam search)",
}
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
# Under torch.compile (HF's own compile of a static-cache generate, or a compiled forward) the modes whose rows tests
# prove equal to the eager reference: the decode steps run as one graph each (engines.captured_steps).
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
    max_new_tokens: int | None = None  # generate's length limit: new tokens, or else
    max_length: int | None = None  # tokens in all, the prompt's included

    def max_steps(self, prompt_length: int) -> int:
        """The most tokens the call can generate after a prompt of `prompt_length` (its decode passes + 1)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(1, (self.max_length or prompt_length + 1) - prompt_length)


def check_generate(model, generate_kwargs: dict, *, attention: str = "softmax",
                   prompt_length: int | None = None) -> GenerationPlan:
    """The plan of `model.generate(**generate_kwargs)` on a prompt of `prompt_length` tokens, or an error naming the
    option that the tracer cannot follow. An allow-list: greedy, sampling, beam search (with sampling,
    num_return_sequences, length_penalty, early_stopping), assisted decoding with `assistant_model` or
    `prompt_lookup_num_tokens`, dynamic and static caches, a cache passed in (continued conversation, with a prompt
    longer than the cache); under torch.compile (`COMPILED_MODES`)
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
    if config.use_cache is False:
        raise NotImplementedError(
            "use_cache=False is not supported by macs_kernels: every pass would then recompute the whole sequence "
            "without a KV cache, and the tracer reads each pass's last query against the cache of the keys before "
            "it; generate with the cache (use_cache=True, the default)"
        )
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
    if cache is not None and prompt_length is not None and cache.get_seq_length() >= prompt_length:
        raise ValueError(
            f"the cache holds {cache.get_seq_length()} tokens and the prompt has {prompt_length}: with the cache of "
            "earlier turns, the prompt is the whole conversation (those turns, then the new tokens), longer than "
            "the cache"
        )
    static = cache_implementation == "static" or isinstance(cache, StaticCache)
    compiled = compiled_forward(model) or (static and _generate_compiles(model, config))
    if compiled:
        _check_compiled(static, mode, method)
    if mode == "assisted_generation":
        support.check("generate", method, "assisted")
    beams = config.num_beams or 1
    return GenerationPlan(mode, config.num_return_sequences or 1, beams, static, config.stop_strings is not None,
                          compiled, config.max_new_tokens, config.max_length)


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
    support.check("generate", method, "compiled")
