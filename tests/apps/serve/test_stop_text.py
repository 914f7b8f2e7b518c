"""The server's stop-string rule on a tokenizer whose tokens are known strings: the text ends before the first
stop string, the tokens returned are those whose text begins before it, and nothing a stop string takes back
is released early."""
from __future__ import annotations

import pytest

from macs_kernels.apps.serve.app import _Choice
from macs_kernels.apps.serve.engine import Step

PIECES = ["He", "llo", " wor", "ld", "!", " The", " end"]


class PieceTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(PIECES[i] for i in ids)


def run(stops):
    """(the pieces each add released, the end's pieces (None after a stop), the content)."""
    choice = _Choice(PieceTokenizer(), 0, stops, None)
    released = []
    for token in range(len(PIECES)):
        released.append([piece for _, piece in choice.add(Step(token))])
        if choice.reason is not None:
            break
    end = None if choice.reason else [piece for _, piece in choice.end()[0]]
    return released, end, choice.content


@pytest.mark.parametrize("stops, content, kept", [
    (["llo wo"], "He", 1),  # begins with token 1: tokens 1.. are the stop's
    (["lo w"], "Hel", 2),  # begins inside token 1: it is returned, cut to "l"
    (["d! T"], "Hello worl", 4),  # spans tokens 3-5: token 3 returned, cut
    (["He"], "", 0),  # at the very start: nothing returned
    (["nowhere", "rld! X"], "Hello world! The end", 7),  # a prefix that never completes is released at the end
])
def test_the_text_ends_before_the_stop_and_only_its_own_tokens_are_returned(stops, content, kept):
    released, end, text = run(stops)
    assert text == content
    pieces = [piece for step in released for piece in step] + (end or [])
    assert "".join(pieces) == content and len(pieces) == kept


def test_text_that_may_begin_a_stop_is_held_back_until_it_cannot():
    released, end, _ = run(["ld!!"])
    # "ld" and then "ld!" could begin "ld!!": "ld" and "!" wait until " The" rules it out.
    assert released[:3] == [["He"], ["llo"], [" wor"]]
    assert released[3] == [] and released[4] == [] and released[5] == ["ld", "!", " The"]
    assert end == []
