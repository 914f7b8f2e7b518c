"""Which prompt tokens hold the context, and which of those lie inside each gold answer, from tokenizer offsets.

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
    """(templated text, ids, offsets) of chat messages; raises if the ids differ from apply_chat_template's."""
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

    The paper's QA prompt (macs_kernels.prompts.qa_messages) puts the context last, so it is found as the
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
    from macs_kernels.prompts import qa_messages

    return align_context(tokenizer, qa_messages(question, context), context)


def answer_step(tokenizer, generated_ids, gold_texts) -> int | None:
    """Zero-based index of the generated token where a gold answer first appears (case-insensitive).

    The earliest appearance over all gold texts counts; the token is the one whose decoded text reaches
    the answer's first character. None when no gold text appears in the decoded generation.
    """
    ids = [int(i) for i in generated_ids]
    generation = tokenizer.decode(ids, skip_special_tokens=True).lower()
    found = [generation.find(t.lower()) for t in gold_texts if t.strip()]
    found = [p for p in found if p >= 0]
    if not found:
        return None
    first_char = min(found)
    for k in range(len(ids)):
        prefix = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        # A prefix that ends inside a multi-byte character decodes to replacement characters.
        if not prefix.endswith("\ufffd") and len(prefix.lower()) > first_char:
            return k
    raise AssertionError("unreachable: the decoded prefix never reached a character of the decoded text")
