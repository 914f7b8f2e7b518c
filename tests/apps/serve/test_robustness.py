"""No single request harms the others: a sampling failure ends only its own request, stop matching and
detokenising leave the event loop free, a non-streamed request whose client left is cancelled, and a body of the
wrong content type is named. In process (httpx's ASGI transport, or the ASGI call itself), on the tiny model."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import pytest

from macs_kernels.apps.serve.app import _Choice, _StopMatcher, create_app
from macs_kernels.apps.serve.engine import Engine, Step
from macs_kernels.apps.serve.sampling import Sampling
from macs_kernels.apps.serve.schemas import MAX_STOP, MAX_STOP_CHARS
from tests.helpers import continuous_batching_refusal

from .conftest import TINY, TokenizerProxy

TIMEOUT = 120  # a guard against a hang, never an assertion on speed


class _GatedTokenizer(TokenizerProxy):
    """The server's tokenizer, except that once armed its next decode signals `inside`, then waits for `release`
    and signals `returned`: the test decides when that detokenisation ends."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.armed, self.inside, self.release, self.returned = (threading.Event() for _ in range(4))

    def decode(self, *args, **kwargs):
        if self.armed.is_set() and not self.inside.is_set():
            self.inside.set()
            self.release.wait(20)
            self.returned.set()
        return self._tokenizer.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_model):
    if continuous_batching_refusal() is not None:
        pytest.skip(continuous_batching_refusal())
    """(engine, app, gated tokenizer) on a copy of the tiny model; the engine runs for the whole module."""
    from macs_kernels.api.models import load_model

    model, tokenizer = load_model(str(tiny_model[0]))
    gated = _GatedTokenizer(tokenizer)
    engine = Engine(model, gated, name=TINY, cache_tokens=4096)
    engine.start()
    yield engine, create_app(engine), gated
    engine.stop()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=TIMEOUT)


def _completion(**fields) -> dict:
    return {"model": TINY, "prompt": "Once upon a time", "max_tokens": 3} | fields


def test_an_overflowing_temperature_is_refused_and_the_next_request_is_served(served):
    _, app, _ = served

    async def scenario():
        async with _client(app) as client:
            bad = await client.post("/v1/completions", json=_completion(temperature=1e-300))
            good = await client.post("/v1/completions", json=_completion(temperature=0.7, seed=1))
            return bad, good

    bad, good = asyncio.run(scenario())
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "temperature" and "0 (greedy) or in [0.001, 2]" in error["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3, good.text


def test_a_failing_draw_ends_its_own_request_and_the_engine_serves_on(served):
    """A draw that raises inside the manager's logits processor (the temperature check bypassed) fails its own
    request only: a stream beside it runs to its end, and the engine takes the next request."""
    engine, _, _ = served
    prompt = engine.tokenizer("Once upon a time")["input_ids"]

    async def tokens(sampling: Sampling, max_tokens: int) -> list[int]:
        job = engine.job(prompt, max_tokens, None, sampling=sampling)
        async with contextlib.aclosing(engine.generate(job)) as steps:
            return [step.token_id async for step in steps]

    async def scenario():
        neighbour = asyncio.ensure_future(tokens(Sampling(), 40))
        failing = asyncio.ensure_future(tokens(Sampling(temperature=1e-300), 40))
        done = await asyncio.wait_for(asyncio.gather(neighbour, failing, return_exceptions=True), TIMEOUT)
        after = await asyncio.wait_for(tokens(Sampling(temperature=0.7, seed=3), 4), TIMEOUT)
        return done, after

    (neighbour, failing), after = asyncio.run(scenario())
    assert isinstance(failing, RuntimeError) and "sampling failed" in str(failing), failing
    assert isinstance(neighbour, list) and len(neighbour) == 40, neighbour
    assert len(after) == 4 and engine.alive()


@pytest.mark.parametrize("stop, what", [
    (["x" * (MAX_STOP_CHARS + 1)], f"up to {MAX_STOP_CHARS}"),
    (["a"] * (MAX_STOP + 1), f"up to {MAX_STOP} non-empty strings"),
])
def test_stop_strings_are_bounded_in_count_and_length(served, stop, what):
    _, app, _ = served

    async def scenario():
        async with _client(app) as client:
            return await client.post("/v1/completions", json=_completion(stop=stop))

    refused = asyncio.run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop", refused.text
    assert what in refused.json()["error"]["message"]


def test_health_answers_while_a_token_is_matched_against_long_stops(served):
    """The request's detokenising and stop matching are held open until /health has answered: on the event
    loop, /health could be answered only after that work returned."""
    _, app, gated = served
    stops = [chr(ord("a") + k) * MAX_STOP_CHARS for k in range(MAX_STOP)]

    async def scenario():
        async with _client(app) as client:
            gated.armed.set()
            long = asyncio.ensure_future(client.post("/v1/completions", json=_completion(stop=stops)))
            assert await asyncio.to_thread(gated.inside.wait, 20), "the request never reached the detokeniser"
            health = await client.get("/health")
            answered_first = not gated.returned.is_set()
            gated.release.set()
            return health, answered_first, await long

    try:
        health, answered_first, long = asyncio.run(scenario())
    finally:
        gated.release.set()
        gated.armed.clear()
    assert health.status_code == 200 and answered_first, "/health waited for the stop matching"
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 3, long.text


def _naive_stop(text: str, stops: list[str]) -> tuple[int | None, int]:
    """(where the first stop string begins, how many final characters begin one): the rule written directly."""
    found = [p for p in (text.find(stop) for stop in stops) if p >= 0]
    tail = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return (min(found) if found else None), tail


@pytest.mark.parametrize("pieces, stops", [
    (["ab", "aba", "bab", "c"], ["ababc", "bb"]),
    (["aa", "a", "aab"], ["aaab", "aab"]),
    (["xyz", "", "xy", "zx"], ["zxyzx"]),
    (["hello", " wor", "ld"], ["lo w", "o", "world"]),
])
def test_the_stop_matcher_agrees_with_the_rule_written_directly(pieces, stops):
    matcher, text = _StopMatcher(stops), ""
    for piece in pieces:
        found = matcher.feed(piece)
        text += piece
        naive_found, naive_tail = _naive_stop(text, stops)
        assert found == naive_found
        if found is not None:
            break
        assert matcher.partial() == naive_tail


def test_a_long_stop_string_still_cuts_the_text_where_it_begins():
    pieces = ["ab"] * 600 + ["c"]

    class Pieces:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(pieces[i] for i in ids)

    choice = _Choice(Pieces(), 0, ["b" + "ab" * 499 + "c"], None)
    released = []
    for token in range(len(pieces)):
        released += choice.add(Step(token))
        if choice.reason:
            break
    assert choice.reason == "stop" and choice.content == "ab" * 100 + "a"


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(served, monkeypatch):
    """The client disconnects after the first token of a long completion: the handler returns without running
    the generation to its end, and frees it."""
    engine, app, _ = served
    max_tokens, generated, first = 1000, [], asyncio.Event()
    original = engine.generate

    async def counted(job):
        async with contextlib.aclosing(original(job)) as steps:
            async for step in steps:
                generated.append(step.token_id)
                first.set()
                yield step

    monkeypatch.setattr(engine, "generate", counted)
    body = json.dumps(_completion(max_tokens=max_tokens)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("serve", 80)}

    async def scenario():
        left, body_sent, sent = asyncio.Event(), [], []

        async def receive():
            if not body_sent:
                body_sent.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        call = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(first.wait(), TIMEOUT)
        left.set()
        await asyncio.wait_for(call, TIMEOUT)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 499
    assert 0 < len(generated) < max_tokens
    assert engine.load()["streams"] == 0


def test_a_json_body_sent_as_text_is_named_by_its_content_type(served):
    _, app, _ = served

    async def scenario():
        async with _client(app) as client:
            return await client.post("/v1/completions", content=json.dumps(_completion()).encode(),
                                     headers={"Content-Type": "text/plain"})

    refused = asyncio.run(scenario())
    assert refused.status_code == 415, refused.text
    message = refused.json()["error"]["message"]
    assert "'text/plain'" in message and "Content-Type: application/json" in message


class _CountingTokenizer:
    """The default model's tokenizer, counting the ids each decode is handed."""

    def __init__(self):
        from macs_kernels.api.models import load_tokenizer

        self.tokenizer, self.decoded = load_tokenizer(), []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("text", [
    "Paris is the capital of France.  Its oldest bridge is the Pont Neuf.",
    "naïve café: 東京 and 北京, emoji 🎉🚀 done",
    "<|im_end|> special tokens are skipped<|im_start|>",
    "   leading spaces\n\nand blank lines\tand tabs",
])
def test_streamed_text_is_the_whole_decode_at_a_bounded_cost_per_token(text):
    """A choice's pieces, token by token, join into exactly the decode of all its ids (characters split across
    tokens held back until complete), and each token decodes a window of a few ids, not the whole answer: a long
    answer costs O(new tokens) per token (issue 50)."""
    from macs_kernels.apps.serve.app import _Text

    counting = _CountingTokenizer()
    ids = counting.tokenizer(text * 20, add_special_tokens=False).input_ids
    streamed = _Text(counting)
    pieces = [streamed.add(token) for token in ids]
    pieces.append(streamed.rest())
    assert "".join(pieces) == counting.tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.decoded) <= 8 < len(ids)
