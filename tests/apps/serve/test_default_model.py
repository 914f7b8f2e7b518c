"""The default model (SmolLM2-135M-Instruct) behind the server: three QA requests at once, batched by the
engine, each with attribution; every answer and its rows equal explain() of that prompt alone."""
from __future__ import annotations

import threading

import pytest

from macs_kernels import explain
from macs_kernels.api.models import DEFAULT_MODEL
from tests.helpers import default_model, qa

from .conftest import Server, assert_matches

openai = pytest.importorskip("openai", reason="the server tests need the official openai client (the test extra)")
pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def client():
    running = Server()
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    running.terminate()


def test_batched_requests_with_attribution_equal_explain(client):
    answers = {}

    def ask(i):
        if i == 1:  # one of them streams
            chunks = list(client.chat.completions.create(
                model=DEFAULT_MODEL, messages=qa(i), max_tokens=MAX_TOKENS, stream=True,
                extra_body={"attribution": True}))
            steps = [c.model_extra["attribution"] for c in chunks[1:] if c.model_extra.get("attribution")]
            answers[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), {
                "input_ids": chunks[0].model_extra["attribution"]["input_ids"],
                "generated_ids": [s["token_id"] for s in steps], "step_log_c": [s["log_c"] for s in steps],
                "step_scores": [s["scores"] for s in steps]})
        else:
            response = client.chat.completions.create(
                model=DEFAULT_MODEL, messages=qa(i), max_tokens=MAX_TOKENS, extra_body={"attribution": True})
            answers[i] = (response.choices[0].message.content, response.choices[0].model_extra["attribution"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    model, tokenizer = default_model()
    for i in range(3):
        text, attribution = answers[i]
        reference = explain(model, tokenizer, qa(i), max_new_tokens=MAX_TOKENS)
        attribution.setdefault("generated_tokens", [tokenizer.decode([t]) for t in attribution["generated_ids"]])
        assert_matches(attribution, reference, text)
