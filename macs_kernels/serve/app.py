"""The FastAPI application: OpenAI-compatible chat and text completions (streaming or not) on the continuous
batching engine, MACS attribution per request, OpenAI-style error bodies, and the live attribution page."""
from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from importlib import resources

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..alignment import align_context, user_span
from ..explanation import Explanation, _decode_tokens, log_zscores, whole_answer_scores
from ..prompts import QA_TEMPLATE
from ..viz import _unit
from .engine import Engine, Job, RequestRejected, Step
from .schemas import AttributionOptions, ChatCompletionRequest, CompletionRequest

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                503: "service_unavailable", 500: "server_error"}


def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _error(message: str, status: int, **fields) -> JSONResponse:
    return JSONResponse(error_body(message, status, **fields), status_code=status)


def _finite(value):
    """JSON has no -inf or NaN: an underflowed log (attention underflow at alpha = 1) becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


class _Prompt:
    """A request's prompt ids, with the source span (token range) its attribution colours."""

    def __init__(self, ids: list[int], source_span: tuple[int, int] | None = None):
        self.ids, self.source_span = ids, source_span


class _Attribution:
    """Builds a request's attribution payloads from its steps: one per streamed token, and the whole object."""

    def __init__(self, tokenizer, prompt: _Prompt, options: AttributionOptions):
        self.tokenizer, self.prompt = tokenizer, prompt
        config = options.macs_config()
        self.config = config.as_dict() | {"engine": "continuous", "method": options.method}
        self.span = prompt.source_span or (0, len(prompt.ids))
        self.steps: list[Step] = []
        self.at2_scores = None

    def header(self) -> dict:
        return {
            "input_ids": self.prompt.ids, "input_tokens": _decode_tokens(self.tokenizer, self.prompt.ids),
            "source_span": list(self.span), "config": self.config,
        }

    def step(self, step: Step) -> dict:
        """The step's row, with the heat weights Explanation.to_html() colours by (viz._unit over the span)."""
        self.steps.append(step)
        log_c = step.log_c.double()
        start, end = self.span
        # The page's default view: the whole answer so far, as Explanation.scores.
        whole = whole_answer_scores(torch.stack([s.log_c for s in self.steps]))
        payload = {
            "step": len(self.steps) - 1, "token_id": step.token_id, "log_c": step.log_c.tolist(),
            "scores": log_zscores(step.log_c).tolist(), "heat": _unit(log_c[start:end]),
            "whole_scores": whole.tolist(), "heat_mean": _unit(whole[start:end]),
        }
        if step.at2_scores is not None:
            self.at2_scores = step.at2_scores.tolist()
            payload["at2_scores"] = self.at2_scores
        return _finite(payload)

    def explanation(self, text: str) -> dict:
        generated = [s.token_id for s in self.steps]
        n = len(self.prompt.ids)
        explanation = Explanation(
            input_ids=torch.tensor(self.prompt.ids), generated_ids=torch.tensor(generated, dtype=torch.long),
            input_tokens=_decode_tokens(self.tokenizer, self.prompt.ids),
            generated_tokens=_decode_tokens(self.tokenizer, generated),
            step_log_c=torch.stack([s.log_c for s in self.steps]) if self.steps else torch.zeros(0, n),
            config=self.config, text=text, source_span=self.prompt.source_span,
        )
        extra = {} if self.at2_scores is None else {"at2_scores": self.at2_scores}
        return _finite(explanation.as_dict() | extra)


class _Text:
    """Incremental detokenisation: a piece per token, holding back bytes of a character not yet complete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.full()
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def full(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def rest(self) -> str:
        text = self.full()
        piece, self.sent = text[len(self.sent):], text
        return piece


def create_app(engine: Engine) -> FastAPI:
    """The application around a (not yet started) engine; its lifespan starts and drains it."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            # Uvicorn reaches this on SIGTERM only after in-flight responses have finished.
            engine.stop()

    app = FastAPI(title="macs-kernels serve", lifespan=lifespan)
    tokenizer = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            return _error(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", 400,
                          code="invalid_json")
        message = "; ".join(
            (f"{_where(e)}: " if _where(e) else "") + e["msg"].removeprefix("Value error, ") for e in errors
        )
        return _error(message, 400, param=_where(first) or None, code="invalid_value")

    @app.exception_handler(RequestRejected)
    async def _rejected(_request, exc: RequestRejected):
        return _error(str(exc), exc.status, param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.get("/health")
    async def health():
        if not engine.alive():
            return _error("the generation engine is not running", 503, code="engine_unavailable")
        return {"status": "ok", "model": engine.name, "requests": engine.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                             "owned_by": "macs_kernels"}]}

    def check_model(name: str) -> None:
        if name != engine.name:
            raise RequestRejected(f"the model {name!r} does not exist; this server serves {engine.name!r}",
                                  param="model", code="model_not_found", status=404)

    def chat_prompt(body: ChatCompletionRequest, options: AttributionOptions | None) -> _Prompt:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestRejected("this model has no chat template; use /v1/completions", param="messages")
        messages = [m.model_dump() for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if options is None or options.source is None:
            # A free prompt's heatmap is the user's own text, not the template's special tokens.
            return _Prompt(ids, user_span(tokenizer, messages))

        try:
            alignment = align_context(tokenizer, messages, options.source)
        except ValueError as error:
            raise RequestRejected(f"attribution.source: {error}", param="attribution.source") from None
        return _Prompt(ids, alignment.context_tokens)

    def completion_prompt(body: CompletionRequest, options: AttributionOptions | None) -> _Prompt:
        if options is not None and options.source is not None:
            raise RequestRejected("attribution.source is supported on /v1/chat/completions only",
                                  param="attribution.source")
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise RequestRejected("the prompt is empty", param="prompt")
            return _Prompt(list(tokenizer(body.prompt)["input_ids"]))
        return _Prompt(list(body.prompt))

    async def run(body, prompt: _Prompt, options, chat: bool):
        check_model(body.model)
        job: Job = engine.job(prompt.ids, body.max_tokens, options.macs_config() if options else None,
                              prompt_param="messages" if chat else "prompt",
                              at2=options is not None and options.method == "at2")
        attribution = _Attribution(tokenizer, prompt, options) if options else None
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": engine.name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(job, attribution, meta, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = _Text(tokenizer)
        async with contextlib.aclosing(engine.generate(job)) as steps:
            async for step in steps:
                text.add(step.token_id)
                if attribution is not None:
                    attribution.step(step)
        content = text.full()
        reason = _finish_reason(text.ids, engine)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}
                  if chat else {"index": 0, "text": content, "finish_reason": reason, "logprobs": None})
        response = meta | {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                           "usage": _usage(len(prompt.ids), len(text.ids))}
        if attribution is not None:
            response["attribution"] = attribution.explanation(content)
        return JSONResponse(response)

    async def _events(job: Job, attribution, meta: dict, chat: bool, include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason=None, extra=None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
            return "data: " + json.dumps(meta | {"object": kind, "choices": [choice]} | (extra or {})) + "\n\n"

        text = _Text(tokenizer)
        if chat:
            first = {"role": "assistant", "content": ""}
            header = {"attribution": attribution.header()} if attribution else {}
            yield "data: " + json.dumps(meta | {"object": kind, "choices": [
                {"index": 0, "delta": first, "finish_reason": None}]} | header) + "\n\n"
        elif attribution is not None:
            yield chunk("", extra={"attribution": attribution.header()})
        try:
            async with contextlib.aclosing(engine.generate(job)) as steps:
                async for step in steps:
                    piece = text.add(step.token_id)
                    extra = {"attribution": attribution.step(step)} if attribution else None
                    yield chunk(piece, extra=extra)
        except RequestRejected as error:
            yield "data: " + json.dumps(error_body(str(error), error.status, code=error.code)) + "\n\n"
            return
        except Exception as error:  # noqa: BLE001 - the stream has begun: report in-band, then close
            yield "data: " + json.dumps(error_body(f"generation failed: {error}", 500)) + "\n\n"
            return
        rest = text.rest()
        yield chunk(rest or None, reason=_finish_reason(text.ids, engine))
        if include_usage:
            yield "data: " + json.dumps(meta | {"object": kind, "choices": [],
                                                "usage": _usage(len(job.input_ids), len(text.ids))}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        options = body.attribution
        return await run(body, chat_prompt(body, options), options, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        options = body.attribution
        return await run(body, completion_prompt(body, options), options, chat=False)

    static = resources.files(__package__) / "static"
    page = (static / "index.html").read_text().replace("{{QA_TEMPLATE}}", json.dumps(QA_TEMPLATE)).replace(
        "{{MODEL}}", json.dumps(engine.name))

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    assets = {
        "page.js": (static / "page.js", "text/javascript"),
        "page.css": (static / "page.css", "text/css"),
        "heatmap.js": (resources.files("macs_kernels") / "data" / "heatmap.js", "text/javascript"),
    }

    @app.get("/static/{name}")
    async def asset(name: str):
        if name not in assets:
            raise StarletteHTTPException(404, f"no asset {name!r}")
        path, media = assets[name]
        return Response(path.read_text(), media_type=media)

    return app


def _where(error: dict) -> str:
    """The field path of a validation error, as the client wrote it ("attribution.alpha")."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not str(p).startswith("function-"))


def _finish_reason(ids: list[int], engine: Engine) -> str:
    return "stop" if ids and ids[-1] in engine.eos_ids else "length"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
