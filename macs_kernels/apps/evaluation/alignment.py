"""Which generated token holds a gold answer, and the QA prompt's context tokens (macs_kernels.api.alignment locates
a text inside a chat prompt; its names are re-exported here for the evaluation's callers)."""
from __future__ import annotations

from macs_kernels.api.alignment import ContextAlignment, align_context, align_qa, encode_chat

__all__ = ["ContextAlignment", "align_context", "align_qa", "answer_step", "encode_chat"]


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
