"""Large and malformed bodies: a body over --max-body-bytes is refused unread (413), whether it declares its
length or arrives in chunks; a long prompt is tokenized off the event loop, so other clients (/health) are
answered meanwhile."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests.helpers import NEEDS_CONTINUOUS_BATCHING

from .conftest import TINY, Server, TokenizerProxy

LIMIT = 4096


@pytest.fixture(scope="module")
def small_server(tiny_model):
    running = Server("--model", str(tiny_model[0]), "--served-name", TINY, "--max-body-bytes", str(LIMIT))
    yield running
    running.terminate()


def _chat(content: str) -> bytes:
    return json.dumps({"model": TINY, "messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()


def _assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert f"accepts up to {LIMIT} bytes" in error["message"] and "--max-body-bytes" in error["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(small_server):
    body = _chat("word " * 1000)
    assert len(body) > LIMIT
    declared = httpx.post(small_server.url + "/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    _assert_too_large(declared)
    assert f"({len(body)} bytes)" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts what arrives
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    chunked = httpx.post(small_server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                         headers={"Content-Type": "application/json"})
    assert "content-length" not in chunked.request.headers
    _assert_too_large(chunked)
    # A body within the limit, declared or chunked, is served as before.
    small = _chat("Say hi.")
    for content in (small, iter([small[:10], small[10:]])):
        answered = httpx.post(small_server.url + "/v1/chat/completions", content=content, timeout=60,
                              headers={"Content-Type": "application/json"})
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["message"]["content"] is not None


class _GatedTokenizer(TokenizerProxy):
    """The server's tokenizer, except that templating any prompt longer than `long` characters first signals
    `inside`, then waits for `release`: the test decides when those tokenizations end."""

    def __init__(self, tokenizer, long: int):
        super().__init__(tokenizer)
        self._long = long
        self.inside, self.release = threading.Event(), threading.Event()

    def apply_chat_template(self, messages, *args, **kwargs):
        if sum(len(m["content"]) for m in messages) > self._long:
            self.inside.set()
            self.release.wait(120)
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)


@NEEDS_CONTINUOUS_BATCHING
def test_health_answers_while_a_long_prompt_is_tokenized(tiny_model):
    """The long request's tokenization is held open until /health has answered: with tokenization on the
    event loop, /health could not answer until the hold timed out, after the long request's own answer."""
    from macs_kernels.api.models import load_model
    from macs_kernels.apps.serve.app import create_app
    from macs_kernels.apps.serve.engine import Engine

    model, tokenizer = load_model(str(tiny_model[0]))
    gated = _GatedTokenizer(tokenizer, long=100_000)
    engine = Engine(model, gated, name=TINY, cache_tokens=4096)
    app = create_app(engine)
    body = _chat("word " * 100_000)  # 500 kB, within the default limit; ~100k tokens, beyond the context

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as client:
            long = asyncio.ensure_future(client.post("/v1/chat/completions", content=body,
                                                     headers={"Content-Type": "application/json"}))
            assert await asyncio.to_thread(gated.inside.wait, 20), "the long request never reached the tokenizer"
            health = await client.get("/health")
            answered_first = not long.done()
            gated.release.set()
            return health, answered_first, await long

    engine.start()
    try:
        health, answered_first, long = asyncio.run(scenario())
    finally:
        gated.release.set()
        engine.stop()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert answered_first, "/health waited for the long request's tokenization"
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text


@NEEDS_CONTINUOUS_BATCHING
def test_long_prompts_being_tokenized_hold_up_no_stream_and_no_short_request(tiny_model):
    """Four long prompts are held in the tokenizer while a short stream and a short request run. With every prompt
    and every streamed token's detokenising in asyncio's default pool (2 threads here, min(32, CPUs + 4) in a
    server), the long prompts took its threads and the short requests waited until they were released."""
    from concurrent.futures import ThreadPoolExecutor

    from macs_kernels.api.models import load_model
    from macs_kernels.apps.serve.app import create_app
    from macs_kernels.apps.serve.engine import Engine
    from macs_kernels.apps.serve.limits import LONG_PROMPT_BYTES

    model, tokenizer = load_model(str(tiny_model[0]))
    held = _GatedTokenizer(tokenizer, long=LONG_PROMPT_BYTES // 2)
    engine = Engine(model, held, name=TINY, cache_tokens=4096)
    app = create_app(engine)
    long_body = _chat("word " * (LONG_PROMPT_BYTES // 4))  # over LONG_PROMPT_BYTES; beyond the context
    assert len(long_body) > LONG_PROMPT_BYTES
    short = {"model": TINY, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

    async def scenario():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=180) as client:
            longs = [asyncio.ensure_future(client.post("/v1/chat/completions", content=long_body,
                                                       headers={"Content-Type": "application/json"}))
                     for _ in range(4)]
            for _ in range(400):  # not asyncio.to_thread: the default pool is what is under test
                if held.inside.is_set():
                    break
                await asyncio.sleep(0.05)
            assert held.inside.is_set(), "no long prompt reached the tokenizer"

            async def stream():
                async with client.stream("POST", "/v1/chat/completions", json=short | {"stream": True}) as response:
                    return response.status_code, [line async for line in response.aiter_lines() if line]

            streamed = await asyncio.wait_for(stream(), 60)
            answered = await asyncio.wait_for(client.post("/v1/chat/completions", json=short), 60)
            still_held = sum(not request.done() for request in longs)
            held.release.set()
            return streamed, answered, still_held, await asyncio.gather(*longs)

    engine.start()
    try:
        (status, lines), answered, still_held, longs = asyncio.run(scenario())
    finally:
        held.release.set()
        engine.stop()
    assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3, lines
    assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert still_held == 4
    for response in longs:
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded", \
            response.text
