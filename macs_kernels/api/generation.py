"""What every entry point that generates shares, written once: prompt encoding (chat template, left padding,
vocabulary check), the generation defaults (greedy; the pad and end-of-sequence ids), and each token's text."""
from __future__ import annotations

import torch

from macs_kernels.api.prompts import is_messages, plain_prompt
from macs_kernels.engines.hf_models import cache_argument


def _prompt_text(tokenizer, prompt) -> str:
    if is_messages(prompt):
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
