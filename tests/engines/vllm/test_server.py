"""vLLM's OpenAI server with the plugin (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs)
returns attributions on /v1/chat/completions in macs-kernels serve's shape, read with the official openai
client; rows equal the teacher-forced eager reference."""
import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from importlib.metadata import entry_points  # noqa: E402

import torch  # noqa: E402

from macs_kernels.vllm import WORKER_EXTENSION  # noqa: E402
from tests.helpers import eager_macs  # noqa: E402

from .conftest import TOLERANCE  # noqa: E402

ROUTE_PATH = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "Which river flows through Paris, and what is the city's oldest bridge?"}]


@contextlib.contextmanager
def vllm_server(model_path: str, log_path, environment: dict | None = None, arguments=()):
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs) with the plugin and the worker
    extension on a free port, its engine core in its own process as `vllm serve` runs it, a 1 GiB KV cache; yields
    its base URL once /health answers. `environment` and `arguments` add to those."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port),
         "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--worker-extension-cls",
         WORKER_EXTENSION, *arguments],
        env=os.environ | {"VLLM_PLUGINS": "macs_kernels", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                          "VLLM_CPU_KVCACHE_SPACE": "1"} | (environment or {}),
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None and time.monotonic() < deadline, open(log_path).read()[-4000:]
                time.sleep(1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    if not any(entry.name == "macs_kernels" for entry in entry_points(group="vllm.endpoint_plugins")):
        pytest.skip("the vllm.endpoint_plugins entry point is not installed: pip install -e . in vLLM's environment")
    path = tmp_path_factory.mktemp("server") / "vllm.log"
    with vllm_server(tiny_path, path) as base:
        yield base, path


@pytest.fixture(scope="module")
def client(server, tiny_path):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none"), tiny_path


def check_rows(model, attribution: dict, generated: list[int]) -> float:
    """max |d log c| of the response's rows against the teacher-forced eager trace of its own tokens."""
    input_ids = torch.tensor(attribution["input_ids"])
    reference, _ = eager_macs(model, input_ids, torch.tensor(generated), **{
        name: attribution["config"][name] for name in ("alpha", "pooling", "redistribute")})
    rows = torch.tensor(attribution["step_log_c"] if "step_log_c" in attribution else attribution["rows"])
    assert rows.shape == reference.shape
    worst = (rows - reference).abs().max().item()
    assert worst <= TOLERANCE
    return worst


def test_a_response_carries_its_attribution(client, tiny_reference):
    openai_client, model = client
    response = openai_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0, extra_body={"attribution": {"alpha": 0.6}})
    attribution = response.choices[0].model_extra["attribution"]  # in its choice, as macs-kernels serve puts it
    assert attribution["generated_ids"] and len(attribution["generated_ids"]) == response.usage.completion_tokens
    assert attribution["config"]["engine"] == "vllm" and attribution["config"]["alpha"] == 0.6
    assert attribution["config"]["dtype"] == "float32"  # what the rows were computed in (the server's --dtype)
    assert attribution["text"] == response.choices[0].message.content
    # The source span is the user's own text (macs-kernels serve's default), inside the templated prompt.
    start, end = attribution["source_span"]
    assert 0 < start < end < len(attribution["input_ids"])
    # Token ids were asked of vLLM for the rows, not by this client: they are not in the response.
    assert "prompt_token_ids" not in response.model_extra or response.model_extra["prompt_token_ids"] is None
    check_rows(tiny_reference, attribution, attribution["generated_ids"])
    # A request without attribution is vLLM's own response.
    plain = openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert "attribution" not in (plain.choices[0].model_extra or {})
    assert plain.choices[0].message.content == response.choices[0].message.content


def test_a_stream_carries_the_header_then_one_row_per_token(client, tiny_reference):
    openai_client, model = client
    stream = openai_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=10, temperature=0, stream=True,
        extra_body={"attribution": {"pooling": "mean"}})
    chunks = [chunk.model_extra.get("attribution") for chunk in stream]
    header, steps = chunks[0], [chunk for chunk in chunks[1:] if chunk is not None]
    assert set(header) == {"input_ids", "input_tokens", "source_span", "config"}
    assert header["config"]["pooling"] == "mean"
    assert [step["step"] for step in steps] == list(range(10))
    assert set(steps[0]) >= {"step", "token_id", "log_c", "scores", "heat", "heat_mean"}
    check_rows(tiny_reference, header | {"rows": [step["log_c"] for step in steps]},
               [step["token_id"] for step in steps])


def test_concurrent_requests_sent_with_one_id_get_their_own_rows(client, tiny_reference):
    """vLLM takes one client id (the X-Request-Id header, or the body's request_id) for several requests at once:
    each response, whole or streamed, carries the rows of its own request, equal to the eager reference of its
    own tokens."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    openai_client, model = client
    questions = ["Name a river.", "Which river flows through Paris, and what is the city's oldest bridge? Answer "
                 "in one long sentence, please, and name the architect too.", "Hello?",
                 "What is the tallest mountain in Europe, and how high is it?"]
    for sent in ({"extra_headers": {"X-Request-Id": "one-id"}}, {"extra_body": {"request_id": "one-id"}}):
        start = threading.Barrier(len(questions))

        def ask(index, sent=sent, start=start):
            options = {"model": model, "messages": [{"role": "user", "content": questions[index]}],
                       "max_tokens": 40, "temperature": 0, "extra_headers": sent.get("extra_headers"),
                       "extra_body": sent.get("extra_body", {}) | {"attribution": True}}
            start.wait()
            if index % 2 == 0:
                response = openai_client.chat.completions.create(**options)
                attribution = response.choices[0].model_extra["attribution"]
                return response.id, attribution, attribution["generated_ids"]
            chunks = list(openai_client.chat.completions.create(**options, stream=True))
            header = chunks[0].model_extra["attribution"]
            steps = [c.model_extra["attribution"] for c in chunks[1:] if c.model_extra.get("attribution")]
            return chunks[0].id, header | {"rows": [s["log_c"] for s in steps]}, [s["token_id"] for s in steps]

        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(ask, range(len(questions))))
        assert {answer[0] for answer in answers} == {"chatcmpl-one-id"}  # vLLM's ids, as the client sent them
        assert len({len(attribution["input_ids"]) for _, attribution, _ in answers}) == len(questions)
        for _, attribution, generated in answers:
            check_rows(tiny_reference, attribution, generated)


def test_an_unknown_or_refused_option_is_a_400_naming_it(client):
    openai_client, model = client
    for options, named in (({"beta": 1}, "'beta'"), ({"attention": "efficient"}, "attention='efficient'"),
                           ({"attention": "norm"}, "attention='norm'"),
                           ({"method": "at2"}, "AT2"), ({"pooling": "median"}, "attribution.pooling"),
                           # a check across the options names the attribution object, not an empty field
                           ({"alpha": 1.5}, "- attribution: alpha must be in")):
        with pytest.raises(openai.BadRequestError, match=named) as error:
            openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3,
                                                  extra_body={"attribution": options})
        assert error.value.status_code == 400


def _metric(base: str, name: str) -> float:
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def test_a_disconnecting_client_frees_its_rows(client, server):
    openai_client, model = client
    base, _ = server
    generated = _metric(base, "vllm:generation_tokens_total")
    stream = openai_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=1900, temperature=0, stream=True, extra_body={"attribution": True})
    for index, chunk in enumerate(stream):  # noqa: B007 - the last chunk read names the request
        if index == 3:
            break
    # Mid-stream the rows are there...
    rows = json.loads(urllib.request.urlopen(f"{base}/v1/attribution/{chunk.id}", timeout=10).read())["log_c"]
    assert len(rows) >= 3
    stream.close()
    # ...and once the client has gone, vLLM aborts the request and its rows are freed.
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{base}/v1/attribution/{chunk.id}", timeout=10)
        except urllib.error.HTTPError as error:
            assert error.code == 404
            assert "released" in json.loads(error.read())["error"]["message"]
            break
        assert time.monotonic() < deadline, "the rows of a disconnected stream were not freed"
        time.sleep(0.5)
    while _metric(base, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "vLLM did not stop the disconnected request"
        time.sleep(0.5)
    assert _metric(base, "vllm:generation_tokens_total") - generated < 1000  # aborted, not run to its 1900 tokens


def test_a_client_that_leaves_before_a_whole_response_frees_its_rows(client, server):
    openai_client, model = client
    base, _ = server
    with pytest.raises(openai.APITimeoutError):
        openai_client.with_options(timeout=2.0, max_retries=0).chat.completions.create(
            model=model, messages=QUESTION, max_tokens=1900, temperature=0, extra_body={"attribution": True},
            extra_headers={"X-Request-Id": "leaves-early"})
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{base}/v1/attribution/chatcmpl-leaves-early", timeout=10)
        except urllib.error.HTTPError as error:
            if "released" in json.loads(error.read())["error"]["message"]:
                break
        assert time.monotonic() < deadline, "the rows of a request whose client left were not freed"
        time.sleep(0.5)


def test_a_chunk_of_several_tokens_becomes_one_row_per_chunk():
    """vLLM merges the tokens of a stream that fell behind into one chunk: each token still gets a chunk with its
    own row, in order, and the text and finish reason stay on the merged chunk."""
    import asyncio

    from macs_kernels.api.models import load_tokenizer
    from macs_kernels.engines.vllm.worker import decode_rows
    from macs_kernels.vllm.server import AttributionEndpoints, options_of

    rows = torch.arange(5 * 4, dtype=torch.float32).view(5, 4).neg()
    asked = []

    class Endpoints(AttributionEndpoints):
        async def _rows(self, request_ids, release=False, start=0, stop=None):
            asked.append((start, stop))
            part = rows[start:stop]
            return {request_ids[0]: {"steps": part.shape[0], "n_input": 4, "log_c": part.numpy().tobytes()}}

        async def _release(self, request_id):
            asked.append("released")

    endpoints = Endpoints()
    endpoints.tokenizer, endpoints.backend = load_tokenizer(), "numba"

    def event(choice, **extra):
        return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}
                                     | extra) + "\n\n"

    async def vllm_stream():
        yield event({"index": 0, "delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[5, 6, 7, 8])
        yield event({"index": 0, "delta": {"content": "a"}, "token_ids": [11]})
        yield event({"index": 0, "delta": {"content": "bcd"}, "token_ids": [12, 13, 14]})
        yield event({"index": 0, "delta": {"content": "e"}, "token_ids": [15], "finish_reason": "length"})
        yield "data: [DONE]\n\n"

    async def run():
        return [piece async for piece in endpoints._stream(vllm_stream(), options_of(True), None, False, "ticket")]

    events = [json.loads(e[6:]) for piece in asyncio.run(run()) for e in piece.split("\n\n") if e.startswith("data: {")]
    assert set(events[0]["attribution"]) == {"input_ids", "input_tokens", "source_span", "config"}
    steps = [e["attribution"] for e in events[1:]]
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4] and [s["token_id"] for s in steps] == [11, 12, 13, 14, 15]
    assert torch.equal(torch.tensor([s["log_c"] for s in steps]), decode_rows(
        {"steps": 5, "n_input": 4, "log_c": rows.numpy().tobytes()}))
    assert [e["choices"][0]["delta"].get("content") for e in events[1:]] == ["a", None, None, "bcd", "e"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e for e in events)
    assert asked == [(0, 1), (1, 4), (4, 5), "released"]


def test_a_stream_whose_rows_fail_sends_one_error_event_then_ends():
    """Rows that fail mid-stream (here: the second chunk's) end the stream as vLLM ends a failing one: the chunks
    before, one error event, `[DONE]`, each event closed by its blank line; vLLM's stream is closed (which aborts
    the request) and the rows are freed."""
    import asyncio

    from macs_kernels.api.models import load_tokenizer
    from macs_kernels.vllm.server import AttributionEndpoints, options_of

    asked, closed = [], []

    class Endpoints(AttributionEndpoints):
        async def _rows(self, request_ids, release=False, start=0, stop=None):
            asked.append(request_ids)
            if start > 0:
                return {request_ids[0]: {"error": "FloatingPointError: the attention held a NaN"}}
            return {request_ids[0]: {"steps": 1, "n_input": 3, "log_c": torch.zeros(1, 3).numpy().tobytes()}}

        async def _release(self, request_id):
            asked.append(("released", request_id))

    endpoints = Endpoints()
    endpoints.tokenizer, endpoints.backend = load_tokenizer(), "numba"

    class VllmStream:
        def __init__(self):
            self.chunks = iter([{"index": 0, "delta": {"role": "assistant", "content": ""}}]
                               + [{"index": 0, "delta": {"content": c}, "token_ids": [20 + i]} for i, c in
                                  enumerate("abcde")])

        def __aiter__(self):
            return self

        async def __anext__(self):
            choice = next(self.chunks, None)
            if choice is None:
                raise StopAsyncIteration
            extra = {"prompt_token_ids": [5, 6, 7]} if "role" in choice["delta"] else {}
            return "data: " + json.dumps({"id": "chatcmpl-1", "choices": [choice]} | extra) + "\n\n"

        async def aclose(self):
            closed.append(True)

    async def run():
        stream = endpoints._stream(VllmStream(), options_of(True), None, False, "ticket-1")
        return "".join([piece async for piece in stream])

    text = asyncio.run(run())
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events), events
    errors = [event for event in events if event.startswith('data: {"error"')]
    assert len(errors) == 1 and "NaN" in json.loads(errors[0][6:])["error"]["message"]
    assert events[-2:] == [errors[0], "data: [DONE]"]
    assert [json.loads(e[6:])["attribution"]["step"] for e in events[1:-2]] == [0]  # the first token's row
    assert closed == [True]
    assert asked == [["ticket-1"], ["ticket-1"], ("released", "ticket-1")]


def _chat_app(plugin: bool, monkeypatch):
    """vLLM's chat completions route and error handlers in an app of their own, with or without the plugin's route
    put in its place as vLLM's server does it (no engine: only requests that fail before one is needed)."""
    from argparse import Namespace

    from fastapi import FastAPI
    from vllm import plugins
    from vllm.entrypoints.openai.chat_completion.api_router import attach_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins

    from macs_kernels.vllm.server import AttributionEndpoints

    app = FastAPI()
    app.state.args = Namespace(log_error_stack=False)
    attach_router(app)
    monkeypatch.setattr(plugins, "load_endpoint_plugins", lambda tasks: [AttributionEndpoints()] if plugin else [])
    attach_endpoint_plugins(app, ("generate",))
    init_exception_handler(app)
    return app


def test_the_route_answers_bad_requests_as_vllm_does(monkeypatch):
    """A body that is not JSON, sent as another content type, or that fails vLLM's request model gets vLLM's own
    400 (message and `param`), with or without `attribution`."""
    from fastapi.testclient import TestClient

    vllm_app, plugin_app = (TestClient(_chat_app(plugin, monkeypatch)) for plugin in (False, True))
    question = {"model": "m", "messages": QUESTION}
    cases = [
        ("text/plain", json.dumps(question | {"attribution": True})),
        ("text/plain", json.dumps(question)),
        ("application/json", '{"model": "m", "messages": [}'),
        ("application/json", json.dumps({"model": "m", "messages": "not a list", "attribution": True})),
        ("application/json", json.dumps(question | {"max_tokens": "many", "attribution": {"alpha": 0.5}})),
        ("application/json", json.dumps(question | {"n": "two"})),
    ]
    for content_type, body in cases:
        answers = [app.post(ROUTE_PATH, content=body, headers={"content-type": content_type})
                   for app in (vllm_app, plugin_app)]
        assert [a.status_code for a in answers] == [400, 400], (body, [a.text for a in answers])
        assert answers[1].json() == answers[0].json(), body
    param = plugin_app.post(ROUTE_PATH, json=question | {"max_tokens": "many", "attribution": True}).json()
    assert param["error"]["param"] == "body.max_tokens"
