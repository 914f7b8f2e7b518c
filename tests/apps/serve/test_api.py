"""The server through the official openai client (streaming and not) and raw HTTP: answers and their MACS rows
equal macs_kernels.explain() on the same prompt; bad input gets an OpenAI-style error and the right status."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from macs_kernels import explain
from macs_kernels.api.explanation import whole_answer_scores
from tests.helpers import qa

from .conftest import TINY as MODEL
from .conftest import assert_matches

openai = pytest.importorskip("openai", reason="the server tests need the official openai client (the test extra)")


def test_health_and_models(server, client):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert httpx.head(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_with_attribution_equals_explain(client, lm):
    response = client.chat.completions.create(
        model=MODEL, messages=qa(0), max_tokens=4, extra_body={"attribution": True},
    )
    model, tokenizer = lm
    reference = explain(model, tokenizer, qa(0), max_new_tokens=4)
    attribution = response.choices[0].model_extra["attribution"]
    assert_matches(attribution, reference, response.choices[0].message.content)
    assert attribution["config"]["alpha"] == 0.8 and attribution["config"]["pooling"] == "max"
    assert attribution["config"]["engine"] == "continuous"
    assert response.usage.prompt_tokens == len(reference.input_ids)
    assert response.usage.completion_tokens == len(reference.generated_ids)


def test_top_tokens_are_the_users_own_words(client):
    """A free prompt's top tokens come from the user's text (the source span), not the chat template's tokens;
    they are the best of the response's own scores there."""
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Why is the sky blue on a clear day?"}], max_tokens=3,
        extra_body={"attribution": True},
    )
    attribution = response.choices[0].model_extra["attribution"]
    start, end = attribution["source_span"]
    assert 0 < start < end < len(attribution["input_ids"])
    scores = [float("-inf") if v is None else v for v in attribution["scores"]]
    top = attribution["top_tokens"]
    assert len(top) == min(10, end - start)
    assert all(start <= t["index"] < end and t["token"] == attribution["input_tokens"][t["index"]] for t in top)
    listed = [scores[t["index"]] for t in top]
    assert listed == [float("-inf") if t["score"] is None else t["score"] for t in top]
    assert listed == sorted(listed, reverse=True)
    rest = [scores[i] for i in range(start, end) if i not in {t["index"] for t in top}]
    assert all(score <= listed[-1] for score in rest)


def test_streamed_rows_equal_explain_with_request_options(client, lm):
    options = {"alpha": 0.5, "pooling": "mean", "redistribute": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=qa(1), max_tokens=4, stream=True, extra_body={"attribution": options},
    )
    chunks = list(stream)
    header = chunks[0].model_extra["attribution"]
    steps = [c.model_extra["attribution"] for c in chunks[1:] if c.model_extra.get("attribution")]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    model, tokenizer = lm
    reference = explain(model, tokenizer, qa(1), max_new_tokens=4, **options)
    assert [s["step"] for s in steps] == list(range(len(reference.generated_ids)))
    assert header["config"] | options == header["config"]
    assert_matches(
        {"input_ids": header["input_ids"], "generated_ids": [s["token_id"] for s in steps],
         "generated_tokens": [tokenizer.decode([s["token_id"]]) for s in steps],
         "step_log_c": [s["log_c"] for s in steps], "step_scores": [s["scores"] for s in steps]},
        reference, text,
    )
    # The page's default view: each step carries the whole answer so far, as Explanation.scores would be.
    for k, step in enumerate(steps):
        want = whole_answer_scores(reference.step_log_c[: k + 1])
        got = torch.tensor([float("-inf") if v is None else v for v in step["whole_scores"]])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert chunks[-1].choices[0].finish_reason == reference_finish(reference)


def test_efficient_attention_runs_in_the_batch_and_equals_explain(client, lm):
    """Efficient rows are computed inside the continuous batch, like every other request's."""
    response = client.chat.completions.create(
        model=MODEL, messages=qa(2), max_tokens=3, extra_body={"attribution": {"attention": "efficient"}},
    )
    model, tokenizer = lm
    reference = explain(model, tokenizer, qa(2), max_new_tokens=3, attention="efficient")
    attribution = response.choices[0].model_extra["attribution"]
    assert attribution["config"]["engine"] == "continuous" and attribution["config"]["attention"] == "efficient"
    assert_matches(attribution, reference, response.choices[0].message.content)


def reference_finish(reference) -> str:
    return "stop" if reference.generated_ids[-1].item() == 2 else "length"


def test_completions_with_and_without_attribution(client, lm):
    model, tokenizer = lm
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    reference = explain(model, tokenizer, input_ids=ids, max_new_tokens=3)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert plain.choices[0].text == reference.text
    assert "attribution" not in (plain.choices[0].model_extra or {})
    attributed = client.completions.create(model=MODEL, prompt=ids.tolist(), max_tokens=3,
                                           extra_body={"attribution": True})
    assert_matches(attributed.choices[0].model_extra["attribution"], reference, attributed.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, stream=True))
    assert streamed == reference.text


def test_concurrent_requests_each_get_their_own_answer(server, client, lm):
    """Two clients at once, one with attribution and one without: each answer is the one it gets alone."""
    model, tokenizer = lm
    results = {}

    def ask(i, attribution):
        results[i] = client.chat.completions.create(
            model=MODEL, messages=qa(i), max_tokens=3, extra_body={"attribution": attribution})

    threads = [threading.Thread(target=ask, args=(i, i == 2)) for i in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 2], server.log()
    for i in (0, 2):
        reference = explain(model, tokenizer, qa(i), max_new_tokens=3)
        assert results[i].choices[0].message.content == reference.text
    assert_matches(results[2].choices[0].model_extra["attribution"], explain(model, tokenizer, qa(2), max_new_tokens=3),
                    results[2].choices[0].message.content)


def _chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


LONG = "word " * 5000  # ~5000 tokens: beyond the test server's 4096-token cache


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None,
     "invalid_json"),
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),
    ("/v1/chat/completions", _chat(max_tokens="two"), 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", _chat(max_tokens=4090), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": LONG}]), 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", _chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages", "invalid_value"),
    ("/v1/chat/completions", _chat(stream="yes"), 400, "stream", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution="yes"), 400, "attribution", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"alpha": 1.5}), 400, "attribution", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"alpha": "high"}), 400, "attribution.alpha", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"pooling": "avg"}), 400, "attribution.pooling", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"attention": "linear"}), 400, "attribution.attention",
     "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"redistribute": "no"}), 400, "attribution.redistribute",
     "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"source": "not in the prompt"}), 400, "attribution.source",
     "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"beta": 1}), 400, "attribution.beta", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"attention": "efficient", "fused_decode": True}), 400, "attribution",
     "invalid_value"),
    ("/v1/chat/completions", _chat(temperature=2.5), 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", _chat(n=0), 400, "n", "invalid_value"),
    ("/v1/chat/completions", _chat(frobnicate=1), 400, "frobnicate", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 9], "max_tokens": 1}, 400, "prompt", "invalid_value"),
    # A lone surrogate (valid JSON, not Unicode text): json.dumps writes it as the escape \ud800.
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400, "messages.0.content",
     "invalid_value"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
     400, "messages.0.content", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 1}, 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", _chat(stop=["\ud800"]), 400, "stop", "invalid_value"),
    ("/v1/chat/completions", _chat(attribution={"source": "\ud800"}), 400, "attribution.source", "invalid_value"),
])
def test_bad_input_gets_an_openai_error(server, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, why", [(b'{"model": "m", "messages": "\xff"}', "it is not UTF-8 text"),
                                       (b"[" * 100_000 + b"]" * 100_000, "it nests too deeply")])
def test_a_body_json_cannot_read_is_named(server, body, why):
    """FastAPI answered both "There was an error parsing the body", with no code."""
    response = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"the body is not valid JSON: {why}"


def test_a_lone_surrogate_is_named(server):
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL.encode()
    response = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        "messages.0.content: the text holds a lone surrogate U+D800 at character 1, which is not Unicode text; "
        "send it as a pair or drop it")


def test_at2_without_coefficients_for_the_model_is_refused_naming_the_option(client):
    # The packaged coefficients belong to the default model, not to this server's small random one.
    with pytest.raises(openai.BadRequestError, match="--at2-coefficients") as refused:
        client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=2,
                                       extra_body={"attribution": {"method": "at2"}})
    assert refused.value.body["param"] == "attribution.method"


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=qa(0), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="pooling"):
        client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=2, stream=True,
                                       extra_body={"attribution": {"pooling": "avg"}})
    for options in ({"attention": "norm"}, {"method": "at2", "attention": "norm"}):  # refused before any work
        with pytest.raises(openai.BadRequestError, match="attention='norm' is not supported under") as refused:
            client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=2,
                                           extra_body={"attribution": options})
        assert refused.value.body["param"] == "attribution.attention"


@pytest.mark.parametrize("fields", [{}, {"n": 2, "temperature": 1.0, "stop": "never in it"}], ids=["one", "two"])
def test_a_client_leaving_mid_stream_frees_its_request(server, client, fields):
    body = _chat(max_tokens=400, stream=True, messages=qa(0), attribution=True) | fields
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        tokens = []
        for line in response.iter_lines():
            if line.startswith("data: ") and '"step"' in line:
                tokens.append(line)
            if len(tokens) == 2:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["requests"] == {"active": 0, "waiting": 0, "streams": 0}:
            break
        time.sleep(0.5)
    assert health["requests"] == {"active": 0, "waiting": 0, "streams": 0}
    # ... and the server goes on serving.
    again = client.chat.completions.create(model=MODEL, messages=qa(0), max_tokens=2)
    assert again.choices[0].message.content


def test_the_page_and_to_html_share_one_colouring(server):
    """The live page loads the very script Explanation.to_html() inlines to colour its heatmap."""
    from macs_kernels.api.explanation import Explanation

    script = httpx.get(server.url + "/static/heatmap.js").text
    assert "function macsHeatColour" in script
    log_c = torch.tensor([[0.0, -1.0, -2.0]])
    page = Explanation(
        input_ids=torch.arange(3), generated_ids=torch.tensor([5]), input_tokens=["a", "b", "c"],
        generated_tokens=["x"], step_log_c=log_c, config={},
    ).to_html()
    assert script in page and "macsHeatColour(w)" in page
    assert '<script src="/static/heatmap.js">' in httpx.get(server.url + "/").text
