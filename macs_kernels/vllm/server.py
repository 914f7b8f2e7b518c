"""`vllm serve MODEL` with MACS attribution on /v1/chat/completions, in `macs-kernels serve`'s request and
response shape (so the live page and its clients work against either):

    VLLM_PLUGINS=macs_kernels vllm serve MODEL --worker-extension-cls macs_kernels.vllm.worker.AttributionWorker

Through vLLM's official extension points only: this `vllm.endpoint_plugins` entry point (opt-in: vLLM loads
endpoint plugins named in VLLM_PLUGINS only) replaces the POST /v1/chat/completions route by one that hands a
request without `"attribution"` to vLLM's own handler untouched. A request with it:

- passes vLLM's own checks first (content type, its request model: vLLM's 400s), then has its options checked
  before any work (HTTP 400 naming an unknown or refused one, `n` other than 1);
- goes to vLLM's handler with the options in `vllm_xargs` (they reach the workers as
  SamplingParams.extra_args["attribution"], as JSON text: vllm_xargs carries flat values only), a ticket of its
  own there (the rows are read by it: clients may send one id with several requests) and with
  `return_token_ids` (the token ids the rows belong to; removed again unless the client asked for them);
- gets macs-kernels serve's fields back: non-streaming, the choice's `attribution` (Explanation.as_dict());
  streaming, the first chunk's `attribution` header (input ids and tokens, source span, config) and on each
  token's chunk that token's row (`step`, `token_id`, `log_c`, `scores`, `heat`, `heat_mean`).

Rows come from the workers through `collective_rpc` (the worker extension), a stream reading only its new
rows per chunk; they are released once sent, and when the client disconnects. GET /v1/attribution/{id}
reads a request's rows until then (404 naming why once they are gone).
"""
from __future__ import annotations

import json
import uuid

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from macs_kernels.api.alignment import align_context, user_span
from macs_kernels.api.generation import decode_tokens
from macs_kernels.apps.serve.app import AttributionPayloads, PromptSpan, error_body, error_field
from macs_kernels.apps.serve.engine import Step
from macs_kernels.apps.serve.schemas import AttributionOptions
from macs_kernels.core import support
from macs_kernels.engines.vllm.engine_config import WORKER_EXTENSION, has_worker_extension, model_dtype
from macs_kernels.engines.vllm.tracer import OPTION, OPTIONS, TICKET, parse_options
from macs_kernels.engines.vllm.worker import decode_rows

ROUTE = "/v1/chat/completions"


class Refused(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def options_of(value) -> AttributionOptions:
    """A request's `attribution` (true or an object) as macs-kernels serve's options, refusing (naming it) an
    unknown option or one vLLM's integration cannot follow."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise Refused("attribution must be true, false or an object of options (alpha, pooling, redistribute, "
                      "attention, method, source)", "attribution")
    try:
        options = AttributionOptions.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        field = error_field(first)
        where = f"attribution.{field}" if field else "attribution"  # a model-level check names no field
        if first["type"] == "extra_forbidden":
            raise Refused(f"unknown attribution option {field!r}: vLLM requests take {OPTIONS + ('method', 'source')}",
                          where) from None
        raise Refused(f"{where}: {first['msg'].removeprefix('Value error, ')}", where) from None
    try:
        support.check_method("vllm", "at2" if options.method == "at2" else "exact")
        if options.fused_decode:
            raise NotImplementedError("attribution.fused_decode: vLLM's own attention computes the outputs")
        parse_options(vllm_options(options))
    except (NotImplementedError, ValueError) as error:
        raise Refused(str(error), "attribution") from None
    return options


def revalidated(body: dict) -> ChatCompletionRequest:
    """vLLM's request model of a body the route changed, its errors in the form FastAPI gives vLLM's handler."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


def vllm_options(options: AttributionOptions) -> dict:
    return {name: getattr(options, name) for name in OPTIONS}


def source_span(tokenizer, messages, options: AttributionOptions):
    """The prompt tokens the heatmap colours, as macs-kernels serve picks them: `source` located at the end of
    the last user message, else the user's own text."""
    if options.source is None:
        try:
            return user_span(tokenizer, messages)
        except (TypeError, ValueError, KeyError):  # content parts, tool messages: the whole prompt
            return None
    try:
        return align_context(tokenizer, messages, options.source).context_tokens
    except ValueError as error:
        raise Refused(f"attribution.source: {error}", "attribution.source") from None


class AttributionEndpoints:
    """The `vllm.endpoint_plugins` entry point (vLLM's EndpointPlugin protocol)."""

    name = "macs_kernels"
    required_tasks = ("generate",)

    def __init__(self):
        self.engine = None
        self.tokenizer = None
        self.backend = None
        self.dtype = None

    # ---- the protocol -----------------------------------------------------------------------------------
    def attach_router(self, app) -> None:
        route = next((route for route in app.routes if isinstance(route, APIRoute) and route.path == ROUTE
                      and "POST" in route.methods), None)
        if route is None:  # a model without chat completions
            return
        original = route.endpoint

        # vLLM's own checks first, as its route runs them: its dependencies (a JSON content type), then the body
        # parsed and validated into its request model (errors: RequestValidationError, which vLLM's handler
        # answers with its 400 and `param`).
        @app.post(ROUTE, dependencies=route.dependencies)
        async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
            return await self.chat_completions(request, raw_request, original)

        @app.get("/v1/attribution/{request_id}")
        async def attribution_rows(request_id: str):
            entry = (await self._rows([request_id]))[request_id]
            if "error" in entry:
                return JSONResponse(error_body(entry["error"], 404, param="request_id"), status_code=404)
            return {"id": request_id, "log_c": decode_rows(entry).tolist()}

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:  # vLLM's render-only server: no engine to attribute
            return
        from transformers import AutoTokenizer

        if not has_worker_extension(engine_client.vllm_config):
            raise RuntimeError(f"macs_kernels' endpoint plugin needs its worker extension: start vllm serve with "
                               f"--worker-extension-cls {WORKER_EXTENSION}")
        self.backend = (await engine_client.collective_rpc("macs_attach"))[0]
        self.dtype = model_dtype(engine_client.vllm_config)
        self.engine = engine_client
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model,
                                                       trust_remote_code=args.trust_remote_code)

    # ---- the route ----------------------------------------------------------------------------------------
    async def chat_completions(self, request, raw_request, original):
        if "attribution" not in (request.model_extra or {}):
            return await original(request, raw_request)
        body = await raw_request.json()  # validated already; read again to be validated with vLLM's extra fields
        asked = body.pop("attribution")
        if asked is None or asked is False:
            return await original(revalidated(body), raw_request)
        try:
            if self.engine is None:
                raise Refused("this server has no engine to attribute with")
            options = options_of(asked)
            if body.get("n", 1) != 1:
                raise Refused("attribution takes n=1 (one sequence per request)", "n")
            span = source_span(self.tokenizer, body.get("messages", []), options)
        except Refused as error:
            return JSONResponse(error_body(str(error), 400, param=error.param), status_code=400)
        client_ids = bool(body.get("return_token_ids"))
        # Clients may send one id (X-Request-Id, request_id) with several requests, as vLLM allows: the workers
        # name this request's rows by a ticket of its own, known up front so that a request whose client leaves
        # before the response still has its rows freed.
        ticket = uuid.uuid4().hex
        xargs = dict(body.get("vllm_xargs") or {})
        xargs |= {OPTION: json.dumps(vllm_options(options)), TICKET: ticket}
        request = revalidated(body | {"vllm_xargs": xargs, "return_token_ids": True})
        response = None
        try:
            response = await original(request, raw_request)
        finally:
            if response is None or getattr(response, "status_code", 200) != 200:  # disconnected, failed
                with anyio.CancelScope(shield=True):
                    await self._release(ticket)
        if response is None or response.status_code != 200:  # None: vLLM's answer to a client that left
            return response
        if hasattr(response, "body_iterator"):
            events = self._stream(response.body_iterator, options, span, client_ids, ticket)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        data = json.loads(response.body)
        choice = data["choices"][0]
        attribution = self._attribution(data["prompt_token_ids"], span, options)
        entry = (await self._rows([ticket], release=True))[ticket]
        if "error" in entry:
            return JSONResponse(error_body(f"attribution failed: {entry['error']}", 500), status_code=500)
        for token_id, row in zip(choice["token_ids"], decode_rows(entry)):
            attribution.record(Step(token_id, row))
        choice["attribution"] = attribution.explanation(choice["message"].get("content") or "")
        if not client_ids:
            data.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
        return JSONResponse(data)

    async def _stream(self, events, options, span, client_ids: bool, ticket: str):
        attribution, cursor = None, 0
        try:
            async for text in events:
                out = []
                for event in text.split("\n\n"):
                    if not event.startswith("data: ") or event == "data: [DONE]":
                        out.append(event)
                        continue
                    chunk = json.loads(event[len("data: "):])
                    if "prompt_token_ids" in chunk and chunk["prompt_token_ids"] is not None:
                        attribution = self._attribution(chunk["prompt_token_ids"], span, options)
                        chunk["attribution"] = attribution.header()
                    choices = chunk.get("choices") or [{}]
                    tokens = choices[0].get("token_ids") or []
                    rows = []
                    if tokens and attribution is not None:
                        entry = (await self._rows([ticket], start=cursor, stop=cursor + len(tokens)))[ticket]
                        if "error" in entry:
                            # How vLLM ends a stream that fails: one error event, then [DONE]; the request is
                            # aborted (below) rather than run on without its rows.
                            out.append("data: " + json.dumps(error_body(f"attribution failed: {entry['error']}",
                                                                        500)))
                            yield "\n\n".join(out + ["data: [DONE]", ""])
                            return
                        rows = [attribution.step(Step(t, row)) for t, row in zip(tokens, decode_rows(entry))]
                        cursor += len(tokens)
                    if not client_ids:
                        chunk.pop("prompt_token_ids", None)
                        for choice in chunk.get("choices") or []:
                            choice.pop("token_ids", None)
                    # vLLM merges the tokens of a stream that fell behind into one chunk; macs-kernels serve
                    # sends one row per chunk: each earlier token gets a chunk of its own (no text), and the
                    # merged chunk (its text, its finish reason) carries the last token's row.
                    for row in rows[:-1]:
                        extra = {key: chunk[key] for key in ("id", "object", "created", "model") if key in chunk}
                        extra["choices"] = [{"index": 0, "delta": {}, "finish_reason": None}]
                        out.append("data: " + json.dumps(extra | {"attribution": row}))
                    if rows:
                        chunk["attribution"] = rows[-1]
                    out.append("data: " + json.dumps(chunk))
                yield "\n\n".join(out)
        finally:
            # Finished, failed or disconnected. A disconnect cancels this generator's scope, which would cancel
            # these awaits too: closing vLLM's stream (which aborts the request) and freeing the rows run
            # shielded.
            with anyio.CancelScope(shield=True):
                if hasattr(events, "aclose"):
                    await events.aclose()
                await self._release(ticket)

    # ---- the workers ---------------------------------------------------------------------------------------
    def _attribution(self, prompt_ids, span, options) -> AttributionPayloads:
        ids = list(prompt_ids)
        attribution = AttributionPayloads(self.tokenizer, PromptSpan(ids, span, decode_tokens(self.tokenizer, ids)),
                                          options)
        attribution.config |= {"engine": "vllm", "backend": self.backend, "dtype": self.dtype}
        return attribution

    async def _rows(self, request_ids, release: bool = False, start: int = 0, stop: int | None = None) -> dict:
        if self.engine is None:
            return {key: {"error": "this server has no engine"} for key in request_ids}
        return (await self.engine.collective_rpc("macs_rows", args=(list(request_ids), release, start, stop)))[0]

    async def _release(self, request_id: str) -> None:
        await self.engine.collective_rpc("macs_release", args=([request_id],))
