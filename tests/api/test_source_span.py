"""A free prompt's default source span is the user's own text: the chat template's special tokens and system
prompt are still scored, but the views rank and colour the user's words."""
import json

import pytest
import torch

from macs_kernels import explain
from macs_kernels.api.alignment import user_span
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("span_model"))


def _span_text(explanation) -> str:
    start, end = explanation.source_span
    return "".join(explanation.input_tokens[start:end])


def test_a_free_prompt_spans_the_user_text_only(chat_model):
    model, tokenizer = chat_model
    prompt = "Why is the sky blue on a clear day?"
    explanation = explain(model, tokenizer, prompt, max_new_tokens=2)
    start, end = explanation.source_span
    assert _span_text(explanation).strip() == prompt
    before = "".join(explanation.input_tokens[:start])
    assert "<|im_start|>" in before and "SmolLM" in before  # the template and its system prompt stay outside
    assert "<|im_start|>" in "".join(explanation.input_tokens[end:])  # the assistant turn's opening too
    assert explanation.step_log_c.shape[1] == len(explanation.input_ids)  # every prompt token is still scored
    assert all(start <= i < end for i, _, _ in explanation.top_k(3, span=True))


@NEEDS_CONTINUOUS_BATCHING
def test_messages_batches_and_ids(chat_model):
    model, tokenizer = chat_model
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one, please."}]
    batch = explain(model, tokenizer, [chat, "Hi there"], max_new_tokens=2)
    assert [_span_text(e).strip() for e in batch] == ["Another one, please.", "Hi there"]
    ids = torch.tensor(tokenizer("plain text")["input_ids"])
    assert explain(model, tokenizer, input_ids=ids, max_new_tokens=2).source_span is None
    continuous = explain(model, tokenizer, ["Hi there"], max_new_tokens=2, continuous_batching=True)
    assert continuous[0].source_span == batch[1].source_span


def test_no_span_without_a_chat_template_or_user_text(chat_model):
    _, tokenizer = chat_model

    class Plain:
        chat_template = None

    assert user_span(Plain(), "some text") is None
    assert user_span(tokenizer, [{"role": "system", "content": "only a system message"}]) is None
    assert user_span(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]) is None


def test_every_view_ranks_the_user_text_by_default(chat_model):
    """top_k, the JSON's top_tokens and the page rank a free prompt's own words unless asked for the whole
    prompt; the chat template's tokens ('<|im_start|>', 'assistant', the system prompt) stay out."""
    model, tokenizer = chat_model
    explanation = explain(model, tokenizer, "Why is the sky blue on a clear day?", max_new_tokens=3)
    start, end = explanation.source_span
    n = len(explanation.input_ids)
    assert 0 < start < end < n
    ranked = [i for i, _, _ in explanation.top_k(n)]
    assert sorted(ranked) == list(range(start, end))
    assert ranked == [i for i, _, _ in explanation.top_k(n, span=True)]
    assert sorted(i for i, _, _ in explanation.top_k(n, span="all")) == list(range(n))
    data = explanation.as_dict()
    assert [t["index"] for t in data["top_tokens"]] == ranked[:10]
    assert [t["token"] for t in data["top_tokens"]] == [explanation.input_tokens[i] for i in ranked[:10]]
    page = explanation.to_html()
    assert f'"top": {json.dumps(ranked[:10])}' in page
