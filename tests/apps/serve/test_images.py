"""Images on the server: OpenAI image_url parts (base64 data URLs) on a small random vision-language model. A
request's rows equal explain() with the same image (streamed and not), its image grids are the image tokens'
scores in place, sampled answers equal the teacher-forced eager reference, and every bad image part is a 400
naming the problem before any generation."""
from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from fastapi.testclient import TestClient

from macs_kernels import explain
from macs_kernels.api.vision import encode_image_prompts, image_scores
from macs_kernels.apps.serve.app import create_app
from macs_kernels.apps.serve.engine import Engine, VisionEngine
from tests.api.vision.tiny import eager_vlm_log_c, random_image, tiny_vlm
from tests.helpers import NEEDS_CONTINUOUS_BATCHING

from .conftest import LOG_C_TOL, Server, assert_matches, rows

NAME = "tiny-vlm"
QUESTION = "What is in the image?"


def data_url(image, form: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=form)
    return f"data:image/{form.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_body(url: str, **fields) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {"model": NAME, "max_tokens": 4, "attribution": True, "messages": [{"role": "user", "content": content}]
            } | fields


# explain()'s form of the same message: the processor's chat template with an image part.
REFERENCE_MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def vlm(request, one_torch_thread):
    """(model, processor, a running app's client) of a small random VLM (LLaVA: a 4 x 4 token grid after its
    crop; Gemma 3: 2 x 2 pooled tokens, bidirectional image blocks)."""
    model, processor = tiny_vlm(request.param)
    with TestClient(create_app(VisionEngine(model, processor, name=NAME, cache_tokens=512))) as client:
        yield model, processor, client


def stream_chunks(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def assert_grids(entry_grids, reference, steps):
    """Each (rows, cols) grid equals the image's tokens' scores in place (macs_kernels.api.vision.image_scores)."""
    for step, grid in zip(steps, entry_grids):
        expected = image_scores(reference, step=step)
        assert torch.tensor(grid).shape == expected.shape
        assert torch.allclose(torch.tensor(grid), expected, atol=1e-3, rtol=0)


def test_image_request_equals_explain(vlm):
    model, processor, client = vlm
    image = random_image(16, 24, seed=1)
    response = client.post("/v1/chat/completions", json=image_body(data_url(image)))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    attribution = choice["attribution"]
    reference = explain(model, processor, REFERENCE_MESSAGES, images=[image], max_new_tokens=4, backend="torch")
    assert_matches(attribution, reference, choice["message"]["content"])
    assert attribution["config"]["engine"] == "generate"
    (entry,) = attribution["images"]
    (tokens,) = reference.images
    assert {key: entry[key] for key in ("positions", "grid", "box", "size")} == tokens.as_dict()
    assert torch.tensor(entry["step_scores"]).shape == (len(reference.generated_ids), *tokens.grid)
    assert_grids(entry["step_scores"], reference, range(len(reference.generated_ids)))
    assert_grids([entry["scores"]], reference, [None])


def test_streamed_image_request_equals_explain(vlm):
    model, processor, client = vlm
    image = random_image(20, 20, seed=2)
    chunks = stream_chunks(client, image_body(data_url(image)))
    header = chunks[0]["attribution"]
    steps = [chunk["attribution"] for chunk in chunks[1:] if chunk.get("attribution")]
    reference = explain(model, processor, REFERENCE_MESSAGES, images=[image], max_new_tokens=4, backend="torch")
    (tokens,) = reference.images
    assert header["input_ids"] == reference.input_ids.tolist() and header["images"] == [tokens.as_dict()]
    assert header["text_positions"] == [i for i in range(len(reference.input_ids)) if i not in tokens.positions]
    assert [step["token_id"] for step in steps] == reference.generated_ids.tolist()
    assert torch.allclose(rows([step["log_c"] for step in steps]), reference.step_log_c, atol=LOG_C_TOL, rtol=0)
    assert_grids([step["images"][0]["scores"] for step in steps], reference, range(len(steps)))
    # The whole answer so far, on the grid: after the last token, Explanation.scores.
    assert_grids([steps[-1]["images"][0]["whole_scores"]], reference, [None])
    for step, payload in enumerate(steps):
        heat = torch.tensor(payload["images"][0]["heat"])
        grid = image_scores(reference, step=step)
        assert heat.shape == grid.shape and heat.max() == 1 and heat.min() == 0
        assert int(heat.argmax()) == int(grid.argmax()) and int(heat.argmin()) == int(grid.argmin())
        assert len(payload["heat"]) == len(header["text_positions"])


def test_text_request_on_a_vision_language_model(vlm):
    model, processor, client = vlm
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    response = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 3, "attribution": True,
                                                         "messages": messages})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    reference = explain(model, processor, messages, max_new_tokens=3, backend="torch")
    assert_matches(choice["attribution"], reference, choice["message"]["content"])
    assert "images" not in choice["attribution"]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["requests"] == {"active": 0, "waiting": 0, "streams": 0}


def test_stop_string_cancels_the_generation(vlm):
    """A stop string ends the answer and stops its generate at the next token: the next request is served."""
    model, processor, client = vlm
    # The stop string: a later token that the answer before it does not hold as text, from the first image whose
    # answer has one (the random model's answers differ between transformers versions; some repeat one token).
    for seed in range(6, 16):
        image = random_image(16, 16, seed=seed)
        reference = explain(model, processor, REFERENCE_MESSAGES, images=[image], max_new_tokens=8, backend="torch")
        tokens = reference.generated_tokens
        at = next((i for i in range(1, len(tokens)) if tokens[i].strip() and tokens[i] not in "".join(tokens[:i])),
                  None)
        if at is not None:
            break
    else:
        pytest.fail("no answer to images of seeds 6-15 holds a token that can be its stop string")
    response = client.post("/v1/chat/completions", json=image_body(data_url(image), stop=tokens[at], max_tokens=200))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "".join(tokens[:at])
    assert choice["attribution"]["generated_ids"] == reference.generated_ids[:at].tolist()
    assert response.json()["usage"]["completion_tokens"] < 200


def test_seeded_sampling_equals_teacher_forced(vlm):
    model, processor, client = vlm
    image = random_image(16, 16, seed=3)
    body = image_body(data_url(image), temperature=1.5, seed=7, max_tokens=5)
    answers = [client.post("/v1/chat/completions", json=body).json()["choices"][0]["attribution"] for _ in range(2)]
    assert answers[0]["generated_ids"] == answers[1]["generated_ids"]
    ids, _, _, inputs, _ = encode_image_prompts(processor, model, REFERENCE_MESSAGES, [image])
    reference = eager_vlm_log_c(model, ids[0], inputs, torch.tensor(answers[0]["generated_ids"]))
    assert (rows(answers[0]["step_log_c"]).double() - reference).abs().max() <= LOG_C_TOL


PNG = data_url(random_image(16, 24, seed=1))
_PNG_BYTES = base64.b64decode(PNG.partition(",")[2])
REFUSALS = {
    "remote URL": ("https://example.com/cat.png", "has no network"),
    "not a data URL": ("file:///tmp/cat.png", "must be a data URL"),
    "not an image type": ("data:text/plain;base64,aGVsbG8=", "not an image type"),
    "not base64": ("data:image/png,rawbytes", "not base64-encoded"),
    "bad base64": ("data:image/png;base64,@@@notbase64", "base64 does not decode"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(),
                     "not an image this server can read"),
    "truncated": ("data:image/png;base64," + base64.b64encode(_PNG_BYTES[: len(_PNG_BYTES) // 2]).decode(),
                  "pixels do not decode"),
    "too many pixels": (data_url(random_image(80, 80, seed=4)), "80 x 80 = 6400 pixels; this server takes up to 4096"),
}


@pytest.fixture(scope="module")
def refusing_client(monkeypatch_module):
    """A VLM app whose model must not generate: every request here is refused before work. Its own model (not
    tiny_vlm's cached one): the patch lasts the module, whose other tests generate with the cached model."""
    model, processor = tiny_vlm.__wrapped__("llava")
    monkeypatch_module.setattr(model, "generate", lambda *a, **k: pytest.fail("generate ran"))
    with TestClient(create_app(VisionEngine(model, processor, name=NAME), max_image_pixels=4096)) as client:
        yield client


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def assert_refused(response, *fragments: str):
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(fragment in message for fragment in fragments), message


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_image_urls(refusing_client, case):
    url, message = REFUSALS[case]
    assert_refused(refusing_client.post("/v1/chat/completions", json=image_body(url)), message)


@pytest.mark.parametrize(("content", "role", "message"), [
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "user", "'video_url'"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "user", "'input_audio'"),
    ([{"type": "image_url", "image_url": {"url": PNG, "detail": "high"}}], "user", "detail='high'"),
    ([{"type": "image_url", "image_url": {"url": PNG}}], "assistant", "user messages only"),
    ([{"type": "image_url", "image_url": PNG}], "user", "an image part is"),
], ids=["video", "audio", "detail", "assistant", "url not an object"])
def test_bad_content_parts(refusing_client, content, role, message):
    messages = [{"role": "user", "content": "Hi"}] if role == "assistant" else []
    body = {"model": NAME, "messages": messages + [{"role": role, "content": content}]}
    assert_refused(refusing_client.post("/v1/chat/completions", json=body), message)


def test_image_options_refused(refusing_client):
    assert_refused(refusing_client.post("/v1/chat/completions", json=image_body(
        PNG, attribution={"source": QUESTION})), "attribution.source takes text prompts")
    assert_refused(refusing_client.post("/v1/chat/completions", json=image_body(
        PNG, attribution={"method": "at2"})), "not served for a vision-language model")


@NEEDS_CONTINUOUS_BATCHING
def test_image_to_a_text_model(tiny_model, monkeypatch):
    _, model, tokenizer = tiny_model
    monkeypatch.setattr(
        "macs_kernels.apps.serve.app.decode_image", lambda *a, **k: pytest.fail("the image was decoded")
    )
    client = TestClient(create_app(Engine(model, tokenizer, name=NAME, cache_tokens=1024)))  # never started
    response = client.post("/v1/chat/completions", json=image_body(PNG))
    assert_refused(response, "need a vision-language model", f"{NAME!r} reads text only")
    assert response.json()["error"]["code"] == "images_not_supported"


@pytest.mark.slow
def test_serve_detects_a_vision_language_model_folder(tmp_path):
    """`macs-kernels serve --model FOLDER` of a VLM loads it with its processor and answers an image request as
    explain() does on the same folder's model."""
    model, processor = tiny_vlm("llava")
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    server = Server("--model", str(tmp_path), "--served-name", NAME)
    try:
        import httpx

        image = random_image(24, 16, seed=5)
        answer = httpx.post(server.url + "/v1/chat/completions", json=image_body(data_url(image, "JPEG")),
                            timeout=120).json()
    finally:
        server.terminate()
    from PIL import Image

    decoded = Image.open(io.BytesIO(base64.b64decode(data_url(image, "JPEG").partition(",")[2]))).convert("RGB")
    reference = explain(model, processor, REFERENCE_MESSAGES, images=[decoded], max_new_tokens=4, backend="torch")
    choice = answer["choices"][0]
    assert_matches(choice["attribution"], reference, choice["message"]["content"])
