"""Where a text sits in a chat prompt, from tokenizer offsets: the context of a QA prompt, or the user's own
message in a free prompt (the default source span: what the views colour and rank).

The chat-templated prompt is tokenized as text with offsets (add_special_tokens=False: the template
writes its own special tokens) and checked against apply_chat_template's own ids, so the token
positions here are exactly the positions the model sees.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ContextAlignment:
    """A tokenized chat prompt and where the context sits in it.

    input_ids: the prompt ids (N,). offsets: (start, end) characters of `text` per token.
    context_tokens: [start, stop) prompt positions of the tokens that overlap the context's characters
    (a token that also covers the separator before the context, like " Paris" after "Context:", counts).
    context_offset: text index of context[0] (answer spans are context offsets, shifted by this).
    """

    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    context_tokens: tuple[int, int]
    context_offset: int

    @property
    def n_context(self) -> int:
        return self.context_tokens[1] - self.context_tokens[0]

    def span_labels(self, start: int, end: int) -> np.ndarray:
        """0/1 (n_context,) marking the context tokens that overlap context characters [start, end).

        An empty span marks nothing.
        """
        a, b = self.context_offset + start, self.context_offset + end
        first, stop = self.context_tokens
        return np.array([int(a < b and s < b and a < e) for s, e in self.offsets[first:stop]], dtype=np.int64)

    def answer_labels(self, answers) -> list[np.ndarray]:
        """One 0/1 vector per (text, answer_start) answer; all zeros when the span covers no context token."""
        return [self.span_labels(start, start + len(text)) for text, start in answers]


def encode_chat(tokenizer, messages, *, add_generation_prompt: bool = True) -> tuple[str, list[int], list]:
    """(templated text, ids, offsets) of chat messages; raises if the ids differ from apply_chat_template's.
    Without a chat template (a base model) the text is `prompts.plain_prompt`, with the tokenizer's own special
    tokens (BOS)."""
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        from macs_kernels.api.prompts import plain_prompt

        text = plain_prompt(messages, add_generation_prompt)
        encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        return text, list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    ids = list(encoded["input_ids"])
    if ids != list(expected):
        raise ValueError(
            "tokenizing the chat-templated text does not reproduce apply_chat_template's ids; "
            "context positions from offsets would be wrong for this tokenizer"
        )
    return text, ids, [tuple(o) for o in encoded["offset_mapping"]]


def align_context(tokenizer, messages, context: str, *, add_generation_prompt: bool = True) -> ContextAlignment:
    """Tokenize `messages` with the chat template and locate `context`, which must end the last user message.

    The paper's QA prompt (macs_kernels.api.prompts.qa_messages) puts the context last, so it is found as the
    last occurrence inside that message and nowhere else in the template.
    """
    text, ids, offsets = encode_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    content = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
    if content is None:
        raise ValueError("no user message")
    if not context.strip() or not content.rstrip().endswith(context.rstrip()):
        raise ValueError("the context must be non-empty and end the last user message")
    at = text.rfind(content)
    if at < 0:
        # Templates that trim messages (Llama 3's does) drop the context's trailing whitespace too.
        at = text.rfind(content.strip())
        content = content.strip()
    if at < 0:
        raise ValueError("the chat template rewrote the user message; cannot locate the context in it")
    kept = context.rstrip()
    context_offset = at + content.rfind(kept)
    end = context_offset + len(kept)
    covering = [i for i, (s, e) in enumerate(offsets) if s < end and context_offset < e]
    if not covering:
        raise ValueError("no token covers the context")
    return ContextAlignment(text, ids, offsets, (covering[0], covering[-1] + 1), context_offset)


def align_qa(tokenizer, question: str, context: str) -> ContextAlignment:
    """align_context for the paper's QA prompt."""
    from macs_kernels.api.prompts import qa_messages

    return align_context(tokenizer, qa_messages(question, context), context)


def user_span(tokenizer, prompt) -> tuple[int, int] | None:
    """[start, end) prompt tokens of the last user message's text in the chat-templated `prompt` (a string, which
    becomes one user message, or chat messages), or None where there is no chat template, no user text or the
    template rewrites it. The template's special tokens and system prompt stay outside: they are scored, but a
    free prompt's heatmap and top tokens are the user's own words."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    content = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
    if not isinstance(content, str) or not content.strip():
        return None
    try:
        return align_context(tokenizer, messages, content).context_tokens
    except ValueError:
        return None
