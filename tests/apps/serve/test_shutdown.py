"""SIGTERM drains: a stream in flight when the server is told to stop runs to its end, new connections are
refused, and the process then exits cleanly."""
from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from .conftest import TINY, Server

MAX_TOKENS = 300


@pytest.fixture
def own_server(tiny_model):
    running = Server("--model", str(tiny_model[0]), "--served-name", TINY)
    yield running
    running.terminate()


def test_sigterm_lets_the_stream_in_flight_finish(own_server):
    body = {"model": TINY, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "stream": True,
            "attribution": True, "stream_options": {"include_usage": True}}
    events, first_token = [], threading.Event()

    def read():
        with httpx.stream("POST", own_server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if '"step"' in line:
                        first_token.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first_token.wait(60), own_server.log()
    steps_before = sum('"step"' in e for e in events)
    own_server.process.send_signal(signal.SIGTERM)
    reader.join(120)
    # Uvicorn drains, shuts the application down, then re-raises the signal it caught: the process ends by
    # SIGTERM, as the caller asked, after "Application shutdown complete".
    assert own_server.process.wait(120) == -signal.SIGTERM, own_server.log()
    assert "Application shutdown complete" in own_server.log()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    steps = [c["attribution"]["step"] for c in chunks if "step" in c.get("attribution", {})]
    assert steps == list(range(len(steps))) and len(steps) > steps_before
    assert chunks[-1]["usage"]["completion_tokens"] == len(steps) == MAX_TOKENS
    with pytest.raises(httpx.ConnectError):
        httpx.get(own_server.url + "/health", timeout=5)
