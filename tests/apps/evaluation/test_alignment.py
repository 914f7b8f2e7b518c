import copy

import numpy as np
import pytest

from macs_kernels.apps.evaluation.alignment import align_context, align_qa, answer_step, encode_chat
from tests.apps.evaluation import stqa_350


@pytest.fixture(scope="session")
def tokenizer():
    from macs_kernels.api.models import load_tokenizer

    return load_tokenizer()


def _labelled_text(tok, alignment, labels):
    start = alignment.context_tokens[0]
    return tok.decode([alignment.input_ids[start + i] for i in np.flatnonzero(labels)])


def _assert_minimal_cover(tok, alignment, labels, answer):
    """The labelled tokens are contiguous, their text holds the answer, and neither end token can go."""
    picked = np.flatnonzero(labels)
    assert picked.size and np.all(np.diff(picked) == 1)
    assert answer in _labelled_text(tok, alignment, labels)
    without_first, without_last = labels.copy(), labels.copy()
    without_first[picked[0]] = 0
    without_last[picked[-1]] = 0
    assert answer not in _labelled_text(tok, alignment, without_first)
    assert answer not in _labelled_text(tok, alignment, without_last)


def test_context_tokens_of_the_qa_prompt(tokenizer):
    from macs_kernels.api.prompts import qa_messages

    question, context = "What is the capital of France?", "Paris is the capital of France."
    alignment = align_qa(tokenizer, question, context)
    start, stop = alignment.context_tokens
    expected = tokenizer.apply_chat_template(qa_messages(question, context), tokenize=True, add_generation_prompt=True)
    assert alignment.input_ids == list(expected["input_ids"])
    assert alignment.text[alignment.context_offset:].startswith(context)
    assert tokenizer.decode(alignment.input_ids[start:stop]) == " " + context
    assert tokenizer.decode(alignment.input_ids[stop:stop + 1]) == "<|im_end|>"
    labels = alignment.answer_labels([("Paris", 0), ("France", 24)])
    assert labels[0].tolist() == [1] + [0] * (alignment.n_context - 1)
    assert _labelled_text(tokenizer, alignment, labels[1]) == " France"


@pytest.mark.parametrize(
    "context, answer",
    [
        ("Der Kölner Dom steht in Köln; 東京は日本の首都です。Straße und Café.", "東京"),
        ("Der Kölner Dom steht in Köln; 東京は日本の首都です。Straße und Café.", "Café"),
        ("Der Kölner Dom steht in Köln; 東京は日本の首都です。Straße und Café.", "Kölner Dom"),
        ("   leading spaces, then naïve text", "leading"),
        ("   leading spaces, then naïve text", "naïve"),
        ("\u00a0\u2003emoji 🙂 inside and after", "🙂"),
    ],
)
def test_answer_labels_with_unicode_and_leading_spaces(tokenizer, context, answer):
    alignment = align_qa(tokenizer, "Where?", context)
    start, stop = alignment.context_tokens
    assert context in tokenizer.decode(alignment.input_ids[start:stop])
    # Dropping an end token loses a context character (or byte): the range is the smallest one.
    assert context not in tokenizer.decode(alignment.input_ids[start + 1:stop])
    assert context not in tokenizer.decode(alignment.input_ids[start:stop - 1])
    labels = alignment.span_labels(context.index(answer), context.index(answer) + len(answer))
    _assert_minimal_cover(tokenizer, alignment, labels, answer)


def test_context_words_in_the_question_are_not_the_context(tokenizer):
    alignment = align_qa(tokenizer, "Is Paris in France? Paris", "Paris")
    start, stop = alignment.context_tokens
    assert (stop - start, tokenizer.decode(alignment.input_ids[start:stop])) == (1, " Paris")
    assert alignment.answer_labels([("Paris", 0), ("", 3)])[1].tolist() == [0]


def test_trimming_template_and_mismatch_are_handled(tokenizer):
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    alignment = align_context(trimming, [{"role": "user", "content": "Context: Paris is big.  \n"}],
                              "Paris is big.  \n")
    labels = alignment.span_labels(9, 12)
    assert _labelled_text(trimming, alignment, labels) == " big"

    class Mismatched:
        def __init__(self, tok):
            self.tok = tok

        def __call__(self, *args, **kwargs):
            return self.tok(*args, **kwargs)

        def apply_chat_template(self, messages, tokenize, **kwargs):
            out = self.tok.apply_chat_template(messages, tokenize=tokenize, **kwargs)
            return out if not tokenize else list(out["input_ids"])[1:]

    with pytest.raises(ValueError, match="does not reproduce"):
        encode_chat(Mismatched(tokenizer), [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="end the last user message"):
        align_context(tokenizer, [{"role": "user", "content": "Context: Paris. Question: ?"}], "Paris.")


def test_answer_step(tokenizer):
    ids = tokenizer.encode("The capital is PARIS, in 東京 terms.")
    step = answer_step(tokenizer, ids, ["London", "paris"])
    assert tokenizer.decode(ids[step:step + 1]).strip().lower().startswith("par")
    assert "par" not in tokenizer.decode(ids[:step]).lower()
    step = answer_step(tokenizer, ids, ["京 terms"])
    assert "京" in tokenizer.decode(ids[: step + 1]) and "京" not in tokenizer.decode(ids[:step])
    assert answer_step(tokenizer, ids, ["Berlin"]) is None
    assert answer_step(tokenizer, ids + [tokenizer.eos_token_id], ["terms"]) == answer_step(tokenizer, ids, ["terms"])


def test_gold_answers_of_stqa_350_map_to_their_tokens(tokenizer):
    from macs_kernels.apps.evaluation.data import load_qa

    path = stqa_350()
    for sample in load_qa(path, n=25):
        alignment = align_qa(tokenizer, sample.question, sample.context)
        for (text, _), labels in zip(sample.answers, alignment.answer_labels(sample.answers)):
            _assert_minimal_cover(tokenizer, alignment, labels, text)
