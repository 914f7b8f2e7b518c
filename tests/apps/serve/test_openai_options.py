"""What OpenAI clients send, through the official client: sampling with a seed, n choices, stop strings, both
token limits and content parts, streaming and not. Every choice's rows equal the teacher-forced eager reference
on its own tokens; the options the server cannot honour are refused with a 400 naming them."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from macs_kernels import explain
from tests.helpers import eager_macs, qa

from .conftest import LOG_C_TOL, rows
from .conftest import TINY as MODEL

openai = pytest.importorskip("openai", reason="the server tests need the official openai client (the test extra)")

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}


def _tokens(choice) -> list[int]:
    return choice.model_extra["attribution"]["generated_ids"]


def assert_rows_equal_the_reference(model, attribution: dict):
    """The choice's step_log_c equals a teacher-forced eager trace of its own prompt and tokens."""
    prompt, generated = torch.tensor(attribution["input_ids"]), torch.tensor(attribution["generated_ids"])
    log_c = rows(attribution["step_log_c"]) if attribution["step_log_c"] else torch.zeros(0, len(prompt))
    reference = eager_macs(model, prompt, generated)[0]
    assert log_c.shape == reference.shape == (len(generated), len(prompt))
    assert (log_c.double() - reference).abs().max() <= LOG_C_TOL


def test_a_seeded_request_draws_the_same_tokens_whatever_else_runs(client, lm):
    """Each choice samples from a generator of its own: the same request with the same seed gets the same tokens
    alone and among other sampling requests; its two choices and another seed draw other tokens."""
    model, _ = lm

    def ask(**fields):
        extra = {"attribution": True} | ({"top_k": fields.pop("top_k")} if "top_k" in fields else {})
        return client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=5, extra_body=extra,
                                              **SAMPLED | fields)

    alone = ask(n=2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(ask, n=2), pool.submit(ask, seed=8, n=3), pool.submit(ask, temperature=0),
                pool.submit(ask, seed=9, top_k=5)]
        among, other_seed = busy[0].result(), busy[1].result()
        for future in busy[2:]:
            future.result()
    assert [_tokens(c) for c in among.choices] == [_tokens(c) for c in alone.choices]
    assert [c.message.content for c in among.choices] == [c.message.content for c in alone.choices]
    assert [c.index for c in alone.choices] == [0, 1]
    assert _tokens(alone.choices[0]) != _tokens(alone.choices[1])
    assert _tokens(other_seed.choices[0]) != _tokens(alone.choices[0])
    assert _tokens(ask().choices[0]) == _tokens(alone.choices[0])  # choice 0 draws with the seed itself
    assert alone.usage.completion_tokens == sum(len(_tokens(c)) for c in alone.choices)
    for choice in alone.choices:
        assert_rows_equal_the_reference(model, choice.model_extra["attribution"])


def test_the_sampling_options_are_applied(client, lm):
    """top_k = 1 leaves the most likely token only, at any temperature: the greedy answer."""
    model, tokenizer = lm
    greedy = explain(model, tokenizer, qa(1), max_new_tokens=4)
    for fields in ({"temperature": 1.5, "seed": 3, "extra_body": {"top_k": 1}}, {"temperature": 0, "seed": 3},
                   {"extra_body": {"top_k": 1}}):
        response = client.chat.completions.create(model=MODEL, messages=qa(1), max_tokens=4, **fields)
        assert response.choices[0].message.content == greedy.text, fields


def test_streamed_choices_equal_the_whole_answers(client):
    """n = 2 streamed: each choice's chunks carry its index, and its text and rows are those of the same request
    answered whole."""
    fields = {"model": MODEL, "messages": qa(2), "max_tokens": 4, "n": 2, "extra_body": {"attribution": True}}
    whole = client.chat.completions.create(**fields, **SAMPLED)
    chunks = list(client.chat.completions.create(**fields, **SAMPLED, stream=True,
                                                 stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.choices[0].delta.content or "" for c in mine) == choice.message.content
        steps = [c.model_extra["attribution"] for c in mine if "step" in (c.model_extra.get("attribution") or {})]
        attribution = choice.model_extra["attribution"]
        assert [s["token_id"] for s in steps] == attribution["generated_ids"]
        assert torch.allclose(rows([s["log_c"] for s in steps]), rows(attribution["step_log_c"]), atol=1e-6)
        assert mine[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # null until the last


def _stop_cases(tokenizer, reference):
    """(stop string, returned text, returned tokens): the text of one generated token (the tokens before it are
    returned), and one that begins inside the token before (that token is returned, its text cut)."""
    ids = reference.generated_ids.tolist()
    text = reference.text
    for k in range(2, len(ids)):
        start = len(tokenizer.decode(ids[:k], skip_special_tokens=True))
        piece, before = (tokenizer.decode(ids[i : i + 1], skip_special_tokens=True) for i in (k, k - 1))
        straddling = text[start - 1 : start + 1]
        if len(piece) >= 2 and len(before) >= 2 and text.index(piece) == start and text.index(straddling) == start - 1:
            return [(piece, text[:start], ids[:k]), (text[start - 1 : start + 1], text[: start - 1], ids[:k])]
    pytest.fail(f"no token of {text!r} suits a stop string")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_and_its_rows(client, lm, stream):
    model, tokenizer = lm
    reference = explain(model, tokenizer, qa(1), max_new_tokens=8)
    for stop, text, tokens in _stop_cases(tokenizer, reference):
        fields = {"model": MODEL, "messages": qa(1), "max_tokens": 8, "stop": [stop, "never in the answer"],
                  "extra_body": {"attribution": True}}
        if stream:
            chunks = list(client.chat.completions.create(**fields, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            steps = [c.model_extra["attribution"] for c in chunks if "step" in (c.model_extra.get("attribution") or {})]
            generated, log_c = [s["token_id"] for s in steps], rows([s["log_c"] for s in steps])
            reason = chunks[-1].choices[0].finish_reason
        else:
            response = client.chat.completions.create(**fields)
            attribution = response.choices[0].model_extra["attribution"]
            content, reason = response.choices[0].message.content, response.choices[0].finish_reason
            generated, log_c = attribution["generated_ids"], rows(attribution["step_log_c"])
            assert attribution["text"] == content
            assert response.usage.completion_tokens > len(tokens)  # the stop string's tokens were generated
        assert (content, reason, generated) == (text, "stop", tokens), stop
        assert torch.allclose(log_c, reference.step_log_c[: len(tokens)], atol=LOG_C_TOL, rtol=0)


def test_text_completions_take_n_seed_and_stop(client, lm):
    model, tokenizer = lm
    prompt = "The capital of France is"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2, stop="never",
                                         extra_body={"attribution": True}, **SAMPLED)
    assert [c.index for c in response.choices] == [0, 1]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    for choice in response.choices:
        assert_rows_equal_the_reference(model, choice.model_extra["attribution"])
        assert tokenizer.decode(choice.model_extra["attribution"]["generated_ids"], skip_special_tokens=True) \
            == choice.text


def test_content_parts_and_token_limits(client, lm):
    model, tokenizer = lm
    question = "Why is the sky blue?"
    reference = explain(model, tokenizer, [{"role": "user", "content": question}], max_new_tokens=3)
    parts = [{"type": "text", "text": "Why is the "}, {"type": "text", "text": "sky blue?"}]
    for limits in ({"max_completion_tokens": 3}, {"max_tokens": 3, "max_completion_tokens": 3}):
        response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                                  **limits)
        assert response.choices[0].message.content == reference.text
        assert response.usage.completion_tokens == len(reference.generated_ids)


def _chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", _chat(logprobs=True), "logprobs", "not supported"),
    ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs", "not supported"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "not supported"),
    ("/v1/chat/completions", _chat(tool_choice="auto"), "tool_choice", "not supported"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object"}), "response_format", "not supported"),
    ("/v1/chat/completions", _chat(presence_penalty=0.5), "presence_penalty", "not supported"),
    ("/v1/chat/completions", _chat(frequency_penalty=1), "frequency_penalty", "not supported"),
    ("/v1/chat/completions", _chat(logit_bias={"1": 5}), "logit_bias", "not supported"),
    ("/v1/chat/completions", _chat(user="me"), "user", "not supported"),
    ("/v1/chat/completions", _chat(stream_options={"include_usage": True}), "stream_options", "stream: true"),
    ("/v1/chat/completions", _chat(stream=True, stream_options={"include_obfuscation": True}),
     "stream_options.include_obfuscation", "False"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     "messages.0.content", "no network"),
    ("/v1/chat/completions", _chat(messages=[{"role": "tool", "content": "x"}]), "messages.0.role", "user"),
    ("/v1/chat/completions", _chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "disagree"),
    ("/v1/chat/completions", _chat(max_completion_tokens=0), "max_completion_tokens", "at least 1"),
    ("/v1/chat/completions", _chat(top_p=0), "top_p", "(0, 1]"),
    ("/v1/chat/completions", _chat(top_k=0), "top_k", "at least 1"),
    ("/v1/chat/completions", _chat(seed=-1), "seed", "[0, 2**63)"),
    ("/v1/chat/completions", _chat(n=129), "n", "[1, 128]"),
    ("/v1/chat/completions", _chat(stop=["a", "b", "c", "d", "e"]), "stop", "up to 4"),
    ("/v1/chat/completions", _chat(stop=""), "stop", "non-empty"),
    ("/v1/chat/completions", _chat(stop="x", attribution={"method": "at2"}), "stop", "AT2"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of", "best_of = n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, "echo", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
])
def test_what_the_server_cannot_honour_is_refused_by_name(server, path, body, param, says):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_the_values_that_ask_for_nothing_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=2, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
        response_format={"type": "text"}, store=False,
    )
    assert response.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=2, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f"}}])
