"""What every entry point that generates shares, written once: prompt encoding (chat template, left padding,
vocabulary check), the generation defaults (greedy; the pad and end-of-sequence ids), and each token's text."""
from __future__ import annotations

import warnings

import torch

from macs_kernels.api.prompts import is_messages, plain_prompt
from macs_kernels.engines.hf_models import cache_argument


def _prompt_text(tokenizer, prompt) -> str:
    if is_messages(prompt):
        for i, message in enumerate(prompt):
            # The chat template would fail inside jinja ("'dict object' has no attribute 'content'"). An assistant's
            # tool call may have no content.
            content = message.get("content")
            if not isinstance(message.get("role"), str) or not (
                    isinstance(content, (str, list)) or content is None and "tool_calls" in message):
                raise ValueError(f"message {i} must have a string 'role' and a 'content' that is a string or a list "
                                 f"of parts (or 'tool_calls'), got {message!r}")
        if not getattr(tokenizer, "chat_template", None):
            return plain_prompt(prompt)
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return prompt


def encode_prompts(tokenizer, prompt=None, input_ids=None, *, vocab_size: int | None = None):
    """(input_ids (B, N_max) left-padded, attention_mask (B, N_max), batched) from the explain() inputs.

    vocab_size: the model's embedding rows; every id (pads included: they are embedded too) must be in
    [0, vocab_size), or a ValueError names the first offending ones.
    """
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None and tokenizer is None:
        raise ValueError("a text prompt needs the model's tokenizer; without one, give the prompt as input_ids=")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must have shape (N,) or (1, N), got {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        ids = input_ids.long().unsqueeze(0)
        _check_vocabulary(ids, vocab_size, "input_ids")
        return ids, torch.ones_like(ids), False
    batched = isinstance(prompt, list) and not is_messages(prompt)
    prompts = prompt if batched else [prompt]
    if not prompts:
        raise ValueError("the list of prompts is empty")
    texts = [_prompt_text(tokenizer, p) for p in prompts]
    # The chat template already carries the special tokens.
    special = not getattr(tokenizer, "chat_template", None)
    encoded = tokenizer(texts, padding=True, padding_side="left", add_special_tokens=special, return_tensors="pt")
    if encoded["input_ids"].shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens")
    _check_vocabulary(encoded["input_ids"], vocab_size, "the tokenizer's ids (is it the model's tokenizer?)")
    return encoded["input_ids"], encoded["attention_mask"], batched


def _check_vocabulary(ids: torch.Tensor, vocab_size: int | None, what: str) -> None:
    if vocab_size is None:
        return
    outside = (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        found = ", ".join(f"{int(ids[b, i])} (prompt {b}, position {i})" for b, i in outside.nonzero()[:5].tolist())
        raise ValueError(
            f"{what}: {int(outside.sum())} token id(s) outside the model's vocabulary [0, {vocab_size}): {found}"
        )


def context_window(model) -> int | None:
    """Positions the model was configured for (its text config's max_position_embeddings), or None when it has no
    fixed limit: a config that states none, or dynamic rope scaling (transformers rescales as the sequence grows).
    Other rope scalings (linear, yarn, llama3, longrope) count in that number: transformers' configs of scaled
    models state the scaled window there."""
    text_config = model.config.get_text_config()
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "dynamic":
        return None
    window = getattr(text_config, "max_position_embeddings", None)
    return window if isinstance(window, int) and window > 0 else None


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt that, with max_new_tokens generated after it, runs past the model's context window: the
    positions beyond it were never trained, and the answer would be wrong without a word."""
    window = context_window(model)
    if window is None:
        return
    if prompt_tokens >= window:
        raise ValueError(f"the prompt has {prompt_tokens} tokens; the model's context window holds {window} "
                         "(config.max_position_embeddings, prompt and answer together): shorten the prompt")
    if prompt_tokens + max_new_tokens > window:
        raise ValueError(f"the prompt has {prompt_tokens} tokens and max_new_tokens={max_new_tokens}; the model's "
                         f"context window holds {window} (config.max_position_embeddings), so at most "
                         f"{window - prompt_tokens} new tokens fit")


def check_tokenizer(model, tokenizer) -> None:
    """Refuse a tokenizer that cannot be the model's, by cheap signals: more tokens than the model embeds, or
    fewer than half of its embedding rows (a model pads its embedding to a multiple of 64 or 128, not to twice its
    vocabulary); warn when its end-of-sequence id is none of the model's."""
    if isinstance(tokenizer, str):  # len() of a name would be read as a vocabulary size
        raise TypeError(f"the tokenizer must be a tokenizer object (load_model() returns the model's), got the "
                        f"string {tokenizer!r}")
    rows = model.get_input_embeddings().num_embeddings
    try:
        size = len(tokenizer)
    except TypeError:  # a stand-in without a vocabulary size: the ids' own range check remains
        return
    if size > rows or size < rows // 2:
        raise ValueError(f"the tokenizer's ids (is it the model's tokenizer?): it has {size} tokens and the model's "
                         f"embedding {rows} rows, the vocabulary [0, {rows})")
    ends = set()
    for source in (model.config.get_text_config(), model.generation_config):
        value = getattr(source, "eos_token_id", None)
        ends.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    eos = getattr(tokenizer, "eos_token_id", None)
    if ends and eos is not None and eos not in ends:
        warnings.warn(f"the tokenizer's end-of-sequence id {eos} is none of the model's {sorted(ends)}: is it the "
                      "model's tokenizer?", stacklevel=3)


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sequence: the model's generation config's and the tokenizer's end-of-sequence ids."""
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def pad_id(model, tokenizer=None) -> int | None:
    """The id generate pads finished sequences with: the tokenizer's pad token, else its end-of-sequence token
    (without a tokenizer, the model's generation config names them), else the smallest end-of-sequence id."""
    source = model.generation_config if tokenizer is None else tokenizer
    for value in (source.pad_token_id, source.eos_token_id):
        if isinstance(value, int):
            return value
    ends = eos_ids(model, tokenizer)
    return min(ends) if ends else None


def generation_kwargs(model, tokenizer, max_new_tokens, generate_kwargs) -> dict:
    """The keywords explain() hands generate: greedy, max_new_tokens, the pad and end-of-sequence ids, then the
    caller's own (`generate_kwargs`; cache= and past_key_values= under the keyword this model takes)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if generate_kwargs.get("tokenizer", tokenizer) is not tokenizer:
        raise ValueError(
            "tokenizer= is another tokenizer than explain's own (its second argument): generate would read stop "
            "strings with one and the explanation decode with the other; drop tokenizer= (generate gets explain's "
            "own when it needs one) or pass the same object"
        )
    if "attention_mask" in generate_kwargs:
        raise ValueError("attention_mask= is explain's own: it pads and masks the prompt itself; drop it (for a "
                         "tokenizer's output, pass input_ids=encoding['input_ids'])")
    if tokenizer is None and generate_kwargs.get("stop_strings") is not None:
        raise ValueError("stop_strings= needs the model's tokenizer (explain's second argument) to read them")
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad_id(model, tokenizer)}
    # A sequence ends where generate stops it; the tokenizer's end-of-sequence token stops it too (as in the
    # serve engine and the at2 and evaluation responses), unless the caller's generation config says otherwise.
    eos = eos_ids(model, tokenizer)
    if eos and "generation_config" not in generate_kwargs:
        kwargs["eos_token_id"] = sorted(eos)
    caches = [name for name in ("cache", "past_key_values") if generate_kwargs.get(name) is not None]
    if len(caches) > 1:
        raise ValueError("cache= and past_key_values= both given: they name the same cache; pass one")
    kwargs.update({name: value for name, value in generate_kwargs.items() if name not in ("cache", "past_key_values")})
    if caches:  # by the keyword this model takes: transformers 5.24 warns on the old past_key_values
        kwargs.update(cache_argument(model, generate_kwargs[caches[0]]))
    return kwargs


def decode_tokens(tokenizer, ids) -> list[str]:
    """Each token's text; without a tokenizer, its id as "#id"."""
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def decode_text(tokenizer, ids) -> str:
    """The generated text; without a tokenizer there is none to give (generated_ids hold the answer)."""
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)
