"""Sources: the parts of the context a score is given to (tokens, words or sentences).

Every source is a run of consecutive prompt tokens; together the sources of a context partition the
context's tokens. Words and sentences come from character spans of the context, mapped to tokens with the
tokenizer's offsets (macs_kernels.apps.evaluation.alignment):

- token: one source per context token;
- word: maximal runs of non-whitespace characters (regex ``\\S+``);
- sentence: a simple regex splitter: a sentence ends after ``.``, ``!`` or ``?`` (and any closing quotes
  or brackets) followed by whitespace, or at a blank line. Abbreviations ("e.g. ", "Dr. ") therefore end a
  sentence too; that costs resolution, never correctness, since the sources still partition the context.

A token belongs to the unit holding its first non-whitespace character; a token of whitespace only joins
the unit before it (or the first unit).
"""
from __future__ import annotations

import bisect
import dataclasses
import re

import torch

SOURCE_TYPES = ("token", "word", "sentence")
_SENTENCE_BREAK = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?P<gap>\s+)|\n\s*\n")


@dataclasses.dataclass(frozen=True)
class Source:
    """text: the context characters [char_span); char_span: offsets into the context string;
    token_span: [start, end) positions in the prompt's token ids."""

    text: str
    char_span: tuple[int, int]
    token_span: tuple[int, int]

    def as_dict(self) -> dict:
        return {"text": self.text, "char_span": list(self.char_span), "token_span": list(self.token_span)}


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of `text`, surrounding whitespace stripped."""
    spans, start = [], 0
    for match in _SENTENCE_BREAK.finditer(text):
        spans.append((start, match.start("gap") if match.group("gap") else match.start()))
        start = match.end()
    spans.append((start, len(text)))
    return [_strip(text, a, b) for a, b in spans if text[a:b].strip()]


def word_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def _strip(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def make_sources(alignment, context: str, kind: str = "sentence") -> list[Source]:
    """The sources of `context` inside the prompt described by `alignment` (a ContextAlignment)."""
    if kind not in SOURCE_TYPES:
        raise ValueError(f"unknown source type {kind!r}; choose one of {SOURCE_TYPES}")
    first, stop = alignment.context_tokens
    shift = alignment.context_offset
    # Context-relative character span of each context token, clipped to the context.
    spans = [(max(s - shift, 0), min(e - shift, len(context))) for s, e in alignment.offsets[first:stop]]
    if kind == "token":
        return [Source(context[a:b], (a, b), (first + i, first + i + 1)) for i, (a, b) in enumerate(spans)]
    units = sentence_spans(context) if kind == "sentence" else word_spans(context)
    unit_starts = [a for a, _ in units]
    owner = []
    for a, b in spans:
        while a < b and context[a].isspace():
            a += 1
        if a == b and owner:
            owner.append(owner[-1])
            continue
        owner.append(max(bisect.bisect_right(unit_starts, a) - 1, 0))
    sources, i = [], 0
    while i < len(owner):
        j = i
        while j < len(owner) and owner[j] == owner[i]:
            j += 1
        a, b = units[owner[i]]
        sources.append(Source(context[a:b], (a, b), (first + i, first + j)))
        i = j
    return sources


def source_index(sources: list[Source], context_tokens: tuple[int, int]) -> torch.Tensor:
    """(n_context,) int64: the source of each context token (the sources must partition the context)."""
    first, stop = context_tokens
    index = torch.full((stop - first,), -1, dtype=torch.int64)
    for s, source in enumerate(sources):
        index[source.token_span[0] - first: source.token_span[1] - first] = s
    if bool((index < 0).any()):
        raise ValueError("the sources do not cover every context token")
    return index


def aggregate(token_features: torch.Tensor, index: torch.Tensor, n_sources: int) -> torch.Tensor:
    """Sum token features (..., n_context) into source features (..., n_sources)."""
    out = token_features.new_zeros(*token_features.shape[:-1], n_sources)
    return out.index_add_(-1, index.to(token_features.device), token_features)
