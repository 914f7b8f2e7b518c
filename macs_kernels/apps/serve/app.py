"""The FastAPI application: OpenAI-compatible chat and text completions (streaming or not) on the continuous
batching engine, MACS attribution per request, OpenAI-style error bodies, and the live attribution page."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from macs_kernels.api.alignment import align_context, user_span
from macs_kernels.api.explanation import build_explanation, default_span, log_zscores
from macs_kernels.api.generation import decode_tokens
from macs_kernels.api.prompts import QA_TEMPLATE
from macs_kernels.api.viz import _unit
from macs_kernels.apps.serve.engine import Engine, Job, RequestRejected, Step, VisionEngine
from macs_kernels.apps.serve.images import DEFAULT_MAX_IMAGE_PIXELS, decode_image
from macs_kernels.apps.serve.limits import DEFAULT_MAX_BODY_BYTES, LONG_PROMPT_BYTES
from macs_kernels.apps.serve.schemas import AttributionOptions, ChatCompletionRequest, CompletionRequest
from macs_kernels.core import support
from macs_kernels.core.scores import SCORE_DIGITS, RunningWholeAnswer, json_values

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 503: "service_unavailable",
                500: "server_error"}


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


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 before any of it is parsed, whether it
    declares its length or arrives in chunks; a body within the limit is handed on as it came."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, f"{int(declared)} bytes")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, f"more than {self.max_bytes} bytes")
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # after the body: the client's disconnect, which a stream listens for
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        message = (f"the request body is too large ({size}); this server accepts up to {self.max_bytes} bytes "
                   "(macs-kernels serve --max-body-bytes)")
        body = json.dumps(error_body(message, 413, code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class PromptSpan:
    """A request's prompt ids, with the source span (token range) its attribution colours, and its tokens'
    texts when the request is attributed; a prompt with images also has each image's tokens and grid (ImageTokens)
    and the processor's tensors for them."""

    def __init__(self, ids: list[int], source_span: tuple[int, int] | None = None, tokens: list[str] | None = None,
                 images: list | None = None, image_inputs: dict | None = None):
        self.ids, self.source_span, self.tokens = ids, source_span, tokens
        self.images, self.image_inputs = images, image_inputs


class AttributionPayloads:
    """Builds a request's attribution payloads from its steps: one per streamed token, and the whole object.

    With images, the text heat covers the prompt's text tokens (the images' tokens are coloured on their own
    grids, as Explanation.to_html() colours them), and each image gets its scores and heat on its token grid."""

    def __init__(self, tokenizer, prompt: PromptSpan, options: AttributionOptions, engine: str = "continuous"):
        self.tokenizer, self.prompt = tokenizer, prompt
        config = options.macs_config()
        self.config = config.as_dict() | {"engine": engine, "method": options.method}
        self.span = default_span(prompt.source_span, len(prompt.ids))
        in_images = {i for tokens in prompt.images or () for i in tokens.positions}
        self.text_positions = [i for i in range(*self.span) if i not in in_images]
        self.steps: list[Step] = []
        self.whole = RunningWholeAnswer()
        self.at2_scores = None

    def header(self) -> dict:
        header = {
            "input_ids": self.prompt.ids, "input_tokens": self.prompt.tokens,
            "source_span": list(self.span), "config": self.config,
        }
        if self.prompt.images:
            header |= {"text_positions": self.text_positions,
                       "images": [tokens.as_dict() for tokens in self.prompt.images]}
        return header

    def record(self, step: Step) -> None:
        """Keep a step for the whole object (a response that is not streamed needs no per-step payload)."""
        self.steps.append(step)
        if step.at2_scores is not None:
            self.at2_scores = step.at2_scores.tolist()

    def step(self, step: Step) -> dict:
        """The step's row, with the heat weights Explanation.to_html() colours by (viz._unit over the span's
        text; with images, also over each image's tokens, on its grid)."""
        self.record(step)
        log_c = step.log_c.double()
        scores = log_zscores(step.log_c)
        # The page's default view: the whole answer so far, as Explanation.scores.
        whole = self.whole.add(step.log_c)
        payload = {
            "step": len(self.steps) - 1, "token_id": step.token_id, "log_c": step.log_c.tolist(),
            "scores": scores.tolist(), "heat": _unit(log_c[self.text_positions]),
            "whole_scores": whole.tolist(), "heat_mean": _unit(whole[self.text_positions]),
        }
        if self.prompt.images:
            payload["images"] = [{
                "scores": tokens.grid_of(scores).tolist(), "heat": _grid_heat(tokens, log_c),
                "whole_scores": tokens.grid_of(whole).tolist(), "heat_mean": _grid_heat(tokens, whole),
            } for tokens in self.prompt.images]
        if step.at2_scores is not None:
            payload["at2_scores"] = self.at2_scores
        return _finite(payload)

    def explanation(self, text: str) -> dict:
        """Explanation.as_dict() of the steps; with images, each image's entry adds its scores on its grid:
        step_scores (steps, rows, cols) and the whole answer's scores (rows, cols)."""
        generated = [s.token_id for s in self.steps]
        n = len(self.prompt.ids)
        explanation = build_explanation(
            self.tokenizer, self.prompt.ids, generated,
            torch.stack([s.log_c for s in self.steps]) if self.steps else torch.zeros(0, n), self.config, text=text,
            input_tokens=self.prompt.tokens, source_span=self.prompt.source_span, images=self.prompt.images,
        )
        whole = explanation.as_dict()
        if self.prompt.images:
            step_scores, scores = explanation.step_scores, explanation.scores
            whole["images"] = [entry | {
                "step_scores": json_values(torch.stack([tokens.grid_of(row) for row in step_scores])
                                           if len(step_scores) else torch.zeros(0, *tokens.grid), SCORE_DIGITS),
                "scores": json_values(tokens.grid_of(scores), SCORE_DIGITS),
            } for entry, tokens in zip(whole["images"], self.prompt.images)]
        extra = {} if self.at2_scores is None else {"at2_scores": self.at2_scores}
        return _finite(whole | extra)


def _grid_heat(tokens, row: torch.Tensor) -> list:
    """viz._unit weights of an image's tokens in `row`, on the image's token grid."""
    return torch.tensor(_unit(row[list(tokens.positions)]), dtype=torch.float64).reshape(tokens.grid).tolist()


class _Text:
    """Incremental detokenisation at O(new tokens) per token, as vLLM's and TGI's streams do it: a token's piece is
    the text it adds to a short window of the ids before it (decoded alone, a window and the window with the token
    agree on their common start), holding back the bytes of a character not yet complete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        # ids[window:sent_ids] decode to the end of `sent`; ids[sent_ids:] are not in it yet.
        self.window = self.sent_ids = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def rest(self) -> str:
        """The text no token has claimed yet (at the end: the bytes of an unfinished character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self.window:self.sent_ids])
        text = self._decode(self.ids[self.window:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        piece = text[len(before):]
        self.window, self.sent_ids = self.sent_ids, len(self.ids)
        self.sent += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class _StopMatcher:
    """The stop strings found in a text given piece by piece, at O(piece) per piece whatever their length: a
    Knuth-Morris-Pratt automaton per stop string holds the longest prefix of it that ends the text so far."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.tables = [_prefix_table(stop) for stop in stops]
        self.states = [0] * len(stops)
        self.length = 0

    def feed(self, piece: str) -> int | None:
        """Where the first stop string completed within `piece` begins in the whole text, else None."""
        found = None
        for s, (stop, table) in enumerate(zip(self.stops, self.tables)):
            state = self.states[s]
            for i, char in enumerate(piece):
                while state and stop[state] != char:
                    state = table[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    start = self.length + i + 1 - len(stop)
                    found = start if found is None else min(found, start)
                    break
            self.states[s] = state
        self.length += len(piece)
        return found

    def partial(self) -> int:
        """How many characters at the end of the text begin a stop string."""
        return max(self.states, default=0)


def _prefix_table(stop: str) -> list[int]:
    """table[i]: the length of the longest proper prefix of stop[:i + 1] that is also its suffix."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class _Choice:
    """One choice's returned text and tokens as its steps arrive: the text ends before the first stop string
    (OpenAI's rule), and the tokens returned are those whose text begins before it, each with its row; a token
    that holds the answer's last characters and the start of the stop string is returned with its row (its
    piece cut at the stop), the tokens wholly inside or after the stop string are not. While the text could
    still be the start of a stop string, its tokens are held back, so a stream never sends what a stop
    string takes back."""

    def __init__(self, tokenizer, index: int, stops: list[str], attribution: AttributionPayloads | None):
        self.index, self.stops, self.attribution = index, stops, attribution
        self.matcher = _StopMatcher(stops)
        self.text = _Text(tokenizer)
        self.held: collections.deque[tuple[Step, str]] = collections.deque()
        self.content = ""
        self.reason: str | None = None  # "stop" once a stop string ended the choice
        self.generated = 0  # every token generated, the stop string's included (the usage)

    def add(self, step: Step) -> list[tuple[Step, str]]:
        """The steps this one releases, each with its piece of the returned text."""
        self.generated += 1
        piece = self.text.add(step.token_id)
        self.held.append((step, piece))
        if not self.stops:
            return self._release(len(self.text.sent))
        start = self.matcher.feed(piece)
        if start is not None:
            self.reason = "stop"
            return self._release(start, cut=True)
        # Hold back the longest tail of the text that begins a stop string.
        return self._release(len(self.text.sent) - self.matcher.partial())

    def end(self) -> tuple[list[tuple[Step, str]], str]:
        """At the end of generation without a stop string: the steps still held, and the text no token has
        claimed yet (the bytes of an unfinished character)."""
        released = self._release(len(self.text.sent))
        rest = self.text.rest()
        self.content += rest
        return released, rest

    def _release(self, until: int, cut: bool = False) -> list[tuple[Step, str]]:
        """Release the held steps whose text begins before `until` (and, unless cut, ends by it)."""
        released, position = [], len(self.content)
        while self.held:
            step, piece = self.held[0]
            # At a stop, a token that begins at or after it is not returned; else one that ends past `until` waits.
            if position >= until if cut else position + len(piece) > until:
                break
            piece = piece[: max(0, until - position)]
            self.held.popleft()
            released.append((step, piece))
            position += len(piece)
            self.content += piece
        if cut:
            self.held.clear()
        return released


def create_app(engine: Engine | VisionEngine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> FastAPI:
    """The application around a (not yet started) engine; its lifespan starts and drains it. A request body
    over max_body_bytes is refused unread (413); an image over max_image_pixels pixels with a 400."""

    # Prompts of long requests are prepared one at a time in a thread of their own. In asyncio's default pool
    # (min(32, CPUs + 4) threads), which also runs every stream's per-token detokenising, a few dozen long prompts
    # (seconds of tokenizer each) held up the running streams and every short request's prompt behind them. Not shut
    # down with the lifespan: uvicorn ends it after the last response, and an app may be started again.
    long_prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="macs-kernels-long-prompts")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            # Uvicorn reaches this on SIGTERM only after in-flight responses have finished.
            engine.stop()

    app = FastAPI(title="macs-kernels serve", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    tokenizer = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        kind = request.headers.get("content-type")
        if kind is not None and not _is_json(kind):  # FastAPI then validates the raw bytes: say why instead
            return _error(f"the body is sent as {kind!r}; send it as JSON with Content-Type: application/json", 415,
                          code="unsupported_media_type")
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            return _error(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", 400,
                          code="invalid_json")
        message = "; ".join(
            (f"{error_field(e)}: " if error_field(e) else "") + e["msg"].removeprefix("Value error, ") for e in errors
        )
        return _error(message, 400, param=error_field(first) or None, code="invalid_value")

    @app.exception_handler(RequestRejected)
    async def _rejected(_request, exc: RequestRejected):
        return _error(str(exc), exc.status, param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        # FastAPI answers a body that json.loads fails on other than by a JSONDecodeError with "There was an error
        # parsing the body", the failure as the exception's cause: name it.
        unreadable = {UnicodeDecodeError: "it is not UTF-8 text", RecursionError: "it nests too deeply"}
        for kind, why in unreadable.items():
            if exc.status_code == 400 and isinstance(exc.__cause__, kind):
                return _error(f"the body is not valid JSON: {why}", 400, code="invalid_json")
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.get("/health")
    async def health():
        if not engine.alive():
            return _error("the generation engine is not running", 503, code="engine_unavailable")
        return {"status": "ok", "model": engine.name, "requests": engine.load()}

    app.head("/health", include_in_schema=False)(health)  # load balancers' checks send HEAD

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                             "owned_by": "macs_kernels"}]}

    def check_model(name: str) -> None:
        if name != engine.name:
            raise RequestRejected(f"the model {name!r} does not exist; this server serves {engine.name!r}",
                                  param="model", code="model_not_found", status=404)

    def chat_prompt(body: ChatCompletionRequest, options: AttributionOptions | None) -> PromptSpan:
        if any(message.image_urls() for message in body.messages):
            return image_prompt(body, options)
        if not getattr(tokenizer, "chat_template", None):
            raise RequestRejected("this model has no chat template; use /v1/completions", param="messages")
        messages = [m.as_template() for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if options is None or options.source is None:
            # A free prompt's heatmap is the user's own text, not the template's special tokens.
            return PromptSpan(ids, user_span(tokenizer, messages))

        try:
            alignment = align_context(tokenizer, messages, options.source)
        except ValueError as error:
            raise RequestRejected(f"attribution.source: {error}", param="attribution.source") from None
        return PromptSpan(ids, alignment.context_tokens)

    def image_prompt(body: ChatCompletionRequest, options: AttributionOptions | None) -> PromptSpan:
        """A chat prompt with images through the model's processor (its chat template), as explain(model,
        processor, messages, images=...) encodes it: every prompt token is an input, image tokens included."""
        from macs_kernels.api.vision import encode_image_prompts

        engine.check_images()  # before any decoding
        if options is not None and options.source is not None:
            raise RequestRejected("attribution.source takes text prompts: a prompt with images has no source span",
                                  param="attribution.source")
        images = []
        for m, message in enumerate(body.messages):
            for p, url in message.image_urls():
                try:
                    images.append(decode_image(url, max_pixels=max_image_pixels))
                except ValueError as error:
                    raise RequestRejected(f"messages.{m}.content.{p}.image_url: {error}",
                                          param=f"messages.{m}.content.{p}.image_url", code="invalid_image") from None
        messages = [message.as_image_template() for message in body.messages]
        try:
            ids, _, _, image_inputs, layouts = encode_image_prompts(engine.processor, engine.model, messages, images)
        except (ValueError, NotImplementedError) as error:
            raise RequestRejected(f"messages: {error}", param="messages") from None
        return PromptSpan(ids[0].tolist(), images=layouts[0], image_inputs=image_inputs)

    def completion_prompt(body: CompletionRequest, options: AttributionOptions | None) -> PromptSpan:
        if options is not None and options.source is not None:
            raise RequestRejected("attribution.source is supported on /v1/chat/completions only",
                                  param="attribution.source")
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise RequestRejected("the prompt is empty", param="prompt")
            return PromptSpan(list(tokenizer(body.prompt)["input_ids"]))
        return PromptSpan(list(body.prompt))

    async def prepared(request: Request, make_prompt, body, options) -> PromptSpan:
        """The request's prompt, tokenized (and its tokens decoded) in a worker thread: a long prompt takes
        the tokenizer seconds, during which the event loop goes on serving every other client."""

        def work() -> PromptSpan:
            prompt = make_prompt(body, options)
            if options is not None:
                prompt.tokens = decode_tokens(tokenizer, prompt.ids)
            return prompt

        if len(await request.body()) > LONG_PROMPT_BYTES:  # read already: FastAPI parsed it
            return await asyncio.get_running_loop().run_in_executor(long_prompts, work)
        return await asyncio.to_thread(work)

    async def run(request: Request, body, prompt: PromptSpan, options, chat: bool):
        at2 = options is not None and options.method == "at2"
        try:
            for method in [] if options is None else [support.method_of(options.macs_config())] + ["at2"] * at2:
                support.check_method("server", method)
        except NotImplementedError as refused:
            raise RequestRejected(str(refused), param="attribution.attention") from None
        stops = body.stop_strings()
        if at2 and stops:
            raise RequestRejected(support.message("server", "at2", "stop_strings"), param="stop")
        jobs: list[Job] = [
            engine.job(prompt.ids, body.max_tokens, options.macs_config() if options else None,
                       prompt_param="messages" if chat else "prompt", at2=at2, sampling=sampling,
                       image_inputs=prompt.image_inputs)
            for sampling in body.sampling()
        ]
        choices = [_Choice(tokenizer, i, stops, AttributionPayloads(tokenizer, prompt, options, engine.kind)
                           if options else None) for i in range(len(jobs))]
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": engine.name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(jobs, choices, meta, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect(job: Job, choice: _Choice) -> None:
            async for released, _ in _released(job, choice):
                if choice.attribution is not None:
                    for step, _piece in released:
                        choice.attribution.record(step)

        if not await _unless_left(request, _gather(collect(job, choice) for job, choice in zip(jobs, choices))):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it

        def respond() -> JSONResponse:  # the attribution's scores and JSON, in a worker thread: O(steps x N)
            return JSONResponse(meta | {"object": "chat.completion" if chat else "text_completion",
                                        "choices": [_whole(choice, chat) for choice in choices],
                                        "usage": _usage(len(prompt.ids), sum(c.generated for c in choices))})

        return await asyncio.to_thread(respond)

    async def _released(job: Job, choice: _Choice):
        """(steps released with their pieces, the text no token claimed) as the choice's generation goes on;
        the last item ends it. A stop string cancels the generation at once."""
        last = None
        async with contextlib.aclosing(engine.generate(job)) as steps:
            async for step in steps:
                last = step.token_id
                # Detokenising and stop matching in a worker thread: the event loop goes on serving other clients.
                yield await asyncio.to_thread(choice.add, step), ""
                if choice.reason is not None:
                    return
        released, rest = choice.end()
        choice.reason = "stop" if last in engine.eos_ids else "length"
        yield released, rest

    async def _events(jobs: list[Job], choices: list[_Choice], meta: dict, chat: bool, include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        if include_usage:  # OpenAI's shape: every chunk has the field, null until the last
            meta = meta | {"usage": None}

        def chunk(index: int, piece: str | None, reason=None, extra=None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": index, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": reason, "logprobs": None}
            return "data: " + json.dumps(meta | {"object": kind, "choices": [choice]} | (extra or {})) + "\n\n"

        async def one(job: Job, choice: _Choice):
            attribution = choice.attribution
            header = {"attribution": attribution.header()} if attribution else None
            if chat:
                yield "data: " + json.dumps(meta | {"object": kind, "choices": [
                    {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ]} | (header or {})) + "\n\n"
            elif header is not None:
                yield chunk(choice.index, "", extra=header)
            async for released, rest in _released(job, choice):
                for step, piece in released:
                    extra = {"attribution": attribution.step(step)} if attribution else None
                    yield chunk(choice.index, piece, extra=extra)
                if choice.reason is not None:
                    yield chunk(choice.index, rest or None, reason=choice.reason)

        try:
            async for event in _merged([one(job, choice) for job, choice in zip(jobs, choices)]):
                yield event
        except RequestRejected as error:
            yield "data: " + json.dumps(error_body(str(error), error.status, code=error.code)) + "\n\n"
            return
        except Exception as error:  # noqa: BLE001 - the stream has begun: report in-band, then close
            yield "data: " + json.dumps(error_body(f"generation failed: {error}", 500)) + "\n\n"
            return
        if include_usage:
            usage = _usage(len(jobs[0].input_ids), sum(c.generated for c in choices))
            yield "data: " + json.dumps(meta | {"object": kind, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        options = body.attribution
        check_model(body.model)
        return await run(request, body, await prepared(request, chat_prompt, body, options), options, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        options = body.attribution
        check_model(body.model)
        return await run(request, body, await prepared(request, completion_prompt, body, options), options,
                         chat=False)

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


def _is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (application/json or a +json type)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def error_field(error: dict) -> str:
    """The field path of a validation error, as the client wrote it ("attribution.alpha")."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not str(p).startswith("function-"))


def _whole(choice: _Choice, chat: bool) -> dict:
    """A finished choice of a whole (not streamed) response, with its attribution."""
    if chat:
        body = {"index": choice.index, "message": {"role": "assistant", "content": choice.content},
                "finish_reason": choice.reason}
    else:
        body = {"index": choice.index, "text": choice.content, "finish_reason": choice.reason, "logprobs": None}
    if choice.attribution is not None:
        body["attribution"] = choice.attribution.explanation(choice.content)
    return body


async def _unless_left(request: Request, work) -> bool:
    """Run `work` unless the client disconnects first: then it is cancelled (and with it its generations, as a
    stream's are when its client leaves). True when it ran to its end."""
    async def left() -> None:
        # The body has been read: the next message is the disconnect (or the end of the response).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # its failure, raised
    return True


async def _gather(coroutines) -> None:
    """Run the coroutines together; the first failure cancels the others (and so their requests)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


async def _merged(streams):
    """The items of several async iterators as they come; the first failure ends all of them (and is raised),
    as does the consumer leaving early."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            await queue.put((_END, error))
            return
        await queue.put((_END, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
