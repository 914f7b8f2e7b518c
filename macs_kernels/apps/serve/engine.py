"""The server's engine: one transformers ContinuousBatchingManager serves every request; requests that ask for
attribution also get their MACS rows, step by step.

Attribution goes through `macs_kernels.engines.continuous.attach_continuous`: MACS inside the continuous-batching
engine, batched with everything else, each request with its own options (efficient attention included);
requests without attribution are skipped by its tracer (no MACS work). A request's stream reads only the rows
of its new tokens: O(1) per token. Each request also samples with its own temperature, top-k, top-p and
random generator (`sampling.RequestSampler`, the manager's one logits processor), or decodes greedily.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator

import torch

from macs_kernels.apps.serve.sampling import RequestSampler, Sampling, SequenceSampler
from macs_kernels.core.config import MacsConfig, option_names


class RequestRejected(ValueError):
    """A request the engine cannot serve, with the HTTP status and OpenAI error code to answer it with."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclasses.dataclass(frozen=True)
class Step:
    """One generated token; log_c (N,) float32 is its MACS row when attribution was asked for; at2_scores (N,)
    float32, on the last token of an AT2 request, each prompt token's AT2 score for the whole response."""

    token_id: int
    log_c: torch.Tensor | None = None
    at2_scores: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    input_ids: list[int]
    max_new_tokens: int
    attribution: MacsConfig | None = None
    at2: bool = False
    sampling: Sampling = Sampling()
    image_inputs: dict | None = None  # the processor's tensors for the prompt's images (pixel_values, ...)


class _Requests:
    """What every engine shares: the model, its tokenizer (a vision-language model's processor's), where
    generation stops, and the checks that make a request's Job before any work."""

    kind = ""  # config.engine of the attributions it makes
    processor = None  # a vision-language model's processor: the engine takes images

    def __init__(self, model, tokenizer, *, name: str, context_tokens: int, default_max_tokens: int):
        from macs_kernels.api.generation import eos_ids, pad_id
        from macs_kernels.engines.generate import check_model

        self.model, self.tokenizer, self.name = model, tokenizer, name
        check_model(model)
        self.eos_ids = eos_ids(model, tokenizer)  # where explain() stops, so answers agree
        self.pad_id = pad_id(model, tokenizer)
        self.context_tokens = context_tokens
        self.default_max_tokens = default_max_tokens
        self.at2_theta = None

    def check_images(self) -> None:
        """Refuse image content on a model that reads text only."""
        if self.processor is None:
            raise RequestRejected(f"image_url content parts need a vision-language model; this server's model "
                                  f"{self.name!r} reads text only", param="messages", code="images_not_supported")

    def job(self, input_ids: list[int], max_tokens: int | None, attribution: MacsConfig | None, *,
            prompt_param: str = "messages", at2: bool = False, sampling: Sampling | None = None,
            image_inputs: dict | None = None) -> Job:
        """The job for a prompt, or RequestRejected when it cannot fit the context and the cache.

        prompt_param: the body field that holds the prompt, named in errors.
        image_inputs: the processor's tensors for the prompt's images (a vision-language model's engine only).
        """
        if image_inputs is not None:
            self.check_images()
        n = len(input_ids)
        if n == 0:
            raise RequestRejected("the prompt encodes to no tokens", param=prompt_param)
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= i < vocab for i in input_ids):
            raise RequestRejected(f"token ids must lie in [0, {vocab})", param=prompt_param)
        if n >= self.context_tokens:
            raise RequestRejected(
                f"the prompt has {n} tokens; this server's context holds {self.context_tokens} (prompt and "
                "completion together)", param=prompt_param, code="context_length_exceeded",
            )
        room = self.context_tokens - n
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise RequestRejected(
                f"max_tokens={max_tokens} does not fit: the prompt has {n} tokens and this server's context "
                f"(model and KV cache) holds {self.context_tokens}, so at most {room} can be generated",
                param="max_tokens", code="context_length_exceeded",
            )
        if at2 and self.at2_theta is None:
            raise RequestRejected(
                "attribution.method='at2' needs AT2 coefficients trained for this server's model; start it with "
                "--at2-coefficients (train them with `macs-kernels at2 train`)", param="attribution.method",
            )
        return Job(list(input_ids), max_tokens, attribution, at2, sampling or Sampling(), image_inputs)


class Engine(_Requests):
    """Owns the model, its continuous-batching manager and the continuous MACS tracer around it.

    cache_tokens: KV-cache capacity in tokens (all requests together); a request's prompt plus its
        max_tokens must fit, and within the model's context.
    page_size, max_batch_tokens: the manager's paging and per-pass token budget.
    at2_coefficients: AT2's (layers, heads) coefficients file for attribution.method='at2'; None takes the
        packaged ones when they were trained for this model (else AT2 requests are refused).
    """

    kind = "continuous"

    def __init__(self, model, tokenizer, *, name: str, cache_tokens: int = 8192, page_size: int = 64,
                 max_batch_tokens: int = 256, default_max_tokens: int = 256, at2_coefficients=None):
        from transformers import GenerationConfig

        from macs_kernels.engines.continuous import batching_config_class

        config_class = batching_config_class()
        check_sizes(cache_tokens=cache_tokens, page_size=page_size, max_batch_tokens=max_batch_tokens,
                    default_max_tokens=default_max_tokens)
        super().__init__(model, tokenizer, name=name, context_tokens=_context(model, cache_tokens),
                         default_max_tokens=default_max_tokens)
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=default_max_tokens, eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        # The MACS tracer runs inside the Python attention function: no flash decode path (block tables), no
        # CUDA graphs or async batching (they replay passes without it).
        self.cb_config = config_class(
            num_blocks=cache_tokens // page_size, page_size=page_size, max_batch_tokens=max_batch_tokens,
            auto_switch_to_flash=False, use_cuda_graph=False, use_async_batching=False,
        )
        self.at2_theta = _at2_theta(model, at2_coefficients)
        self._ids = itertools.count()
        self._stack = contextlib.ExitStack()
        self.manager = None
        self.tracer = None
        self.sampler = RequestSampler()
        self._streams = 0  # generations a client is still reading

    # ---- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        from macs_kernels.engines.continuous import attach_continuous

        # Entered first: managers created inside attach_continuous are traced.
        self.tracer = self._stack.enter_context(attach_continuous(self.model))
        self.manager = self.model.init_continuous_batching(
            generation_config=self.generation_config, continuous_batching_config=self.cb_config,
        )
        self.sampler.install(self.manager)
        self.manager.start()

    def stop(self) -> None:
        """Lets the manager finish what it holds, then releases it (and the tracer, restoring the model)."""
        if self.manager is not None:
            self.manager.stop(block=True)
            self.manager.destroy()
            self.manager = None
        self._stack.close()

    def alive(self) -> bool:
        return (
            self.manager is not None and self.manager.is_running()
            and self.manager.background_thread_status.fatal_error is None
        )

    def load(self) -> dict:
        """{"active": requests the manager is prefilling or decoding, "waiting": queued in it, "streams":
        generations still being read by a request handler}."""
        processor = self.manager.batch_processor if self.manager is not None else None
        scheduler = processor.scheduler if processor is not None else None
        return {
            "active": len(scheduler.active_requests) if scheduler else 0,
            "waiting": len(scheduler.waiting_requests) if scheduler else 0,
            "streams": self._streams,
        }

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, job: Job) -> AsyncIterator[Step]:
        """Steps of `job` as they are made; closing the iterator early cancels the request and frees it."""
        if not self.alive():
            raise RequestRejected("the generation engine is not running", code="engine_unavailable", status=503)
        request_id = f"serve_{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        manager = self.manager
        if job.attribution is not None:
            self.tracer.configure(request_id, at2_features=job.at2, **_request_config(job.attribution))
        else:
            self.tracer.skip(request_id)
        self.sampler.configure(request_id, job.sampling)
        manager.register_result_handler(request_id, outputs.put_nowait)
        manager.add_request(job.input_ids, request_id=request_id, max_new_tokens=job.max_new_tokens,
                            streaming=True, eos_token_id=sorted(self.eos_ids))
        self._streams += 1
        sent, finished = 0, False
        try:
            while not finished:
                output = await outputs.get()
                if output.error is not None:
                    raise RuntimeError(f"generation failed: {output.error}")
                failure = self.sampler.failure(request_id)
                if failure is not None:
                    raise RuntimeError(f"sampling failed: {type(failure).__name__}: {failure}")
                finished = output.is_finished()
                tokens = output.generated_tokens
                if len(tokens) == sent:
                    continue
                rows = at2_scores = None
                if job.attribution is not None:
                    rows, _ = self.tracer.read_rows(request_id, sent, len(tokens))
                if finished and job.at2:
                    # AT2's score of a prompt token: its features weighted by the (layer, head) coefficients.
                    at2_scores = torch.einsum("lh,lhn->n", self.at2_theta, self.tracer.at2_features(request_id))
                for k in range(sent, len(tokens)):
                    last = k == len(tokens) - 1
                    yield Step(tokens[k], None if rows is None else rows[k - sent], at2_scores if last else None)
                sent = len(tokens)
        finally:
            self._streams -= 1
            if not finished:
                manager.cancel_request(request_id)
                with manager.output_router._lock:  # the manager drops a handler only on a finished output
                    manager.output_router.result_handlers.pop(request_id, None)
            self.tracer.release(request_id)
            self.sampler.release(request_id)


class VisionEngine(_Requests):
    """A vision-language model's engine: requests run one at a time, each its own `model.generate` with its
    prompt's images (the processor's pixel_values and grids) in one worker thread, under `attach()` when it asks
    for attribution (as `explain()` and `stream()` run it). Transformers' continuous-batching engine feeds the
    model token ids only, no pixel_values, so it cannot take images. Text requests take the same path.

    cache_tokens: a request's prompt plus its max_tokens must fit in it, and in the model's context.
    """

    kind = "generate"

    def __init__(self, model, processor, *, name: str, cache_tokens: int = 8192, default_max_tokens: int = 256):
        super().__init__(model, processor.tokenizer, name=name, context_tokens=_context(model, cache_tokens),
                         default_max_tokens=default_max_tokens)
        self.processor = processor
        self._worker = None
        self._waiting = self._active = self._streams = 0

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="macs-kernels-vlm")

    def stop(self) -> None:
        """Lets the worker finish the requests it holds, then releases it."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def alive(self) -> bool:
        return self._worker is not None

    def load(self) -> dict:
        """As Engine.load(): "active" is the request generating, "waiting" those queued behind it."""
        return {"active": self._active, "waiting": self._waiting, "streams": self._streams}

    def job(self, input_ids, max_tokens, attribution, *, at2: bool = False, **options) -> Job:
        if at2:
            raise RequestRejected("attribution.method='at2' is not served for a vision-language model; use "
                                  "\"macs\"", param="attribution.method")
        return super().job(input_ids, max_tokens, attribution, **options)

    async def generate(self, job: Job) -> AsyncIterator[Step]:
        """Steps of `job` as they are made; closing the iterator early stops its generation at the next token
        (or drops it from the queue)."""
        if not self.alive():
            raise RequestRejected("the generation engine is not running", code="engine_unavailable", status=503)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def send(item) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody reads on
                cancelled.set()

        self._waiting += 1
        self._streams += 1
        self._worker.submit(self._run, job, send, cancelled)
        try:
            while (item := await outputs.get()) is not _FINISHED:
                if isinstance(item, BaseException):
                    raise RuntimeError(f"generation failed: {type(item).__name__}: {item}")
                yield item
        finally:
            cancelled.set()
            self._streams -= 1

    def _run(self, job: Job, send, cancelled: threading.Event) -> None:
        """In the worker thread: generate `job`, sending each Step, then _FINISHED (or the exception)."""
        from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

        from macs_kernels.engines.generate import attach

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **_):
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool,
                                  device=input_ids.device)

        self._waiting -= 1
        if cancelled.is_set():  # the client left while the request waited
            return
        self._active += 1
        try:
            device = next(self.model.parameters()).device
            kwargs = {"max_new_tokens": job.max_new_tokens, "do_sample": False, "pad_token_id": self.pad_id,
                      "eos_token_id": sorted(self.eos_ids), "stopping_criteria": StoppingCriteriaList([Cancelled()]),
                      "return_dict_in_generate": False}
            if not job.sampling.greedy:
                kwargs["logits_processor"] = LogitsProcessorList([SequenceSampler(job.sampling)])
            kwargs |= {key: value.to(device) for key, value in (job.image_inputs or {}).items()}
            ids = torch.tensor([job.input_ids], device=device)
            with torch.inference_mode(), contextlib.ExitStack() as stack:
                tracer = None if job.attribution is None else stack.enter_context(
                    attach(self.model, **job.attribution.as_dict()))
                self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=_StepSender(send, tracer),
                                    **kwargs)
            send(_FINISHED)
        except BaseException as error:  # noqa: BLE001 - handed to the request's handler
            send(error)
        finally:
            self._active -= 1


_FINISHED = object()


class _StepSender:
    """A generate() streamer that sends each new token as a Step, with its row log c when a tracer scores it."""

    def __init__(self, send, tracer):
        self.send, self.tracer, self.prompt_seen, self.step = send, tracer, False, 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first pushes the prompt
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            log_c = None if self.tracer is None else self.tracer.row_log_c(0, self.step)
            self.send(Step(int(token), log_c))
            self.step += 1

    def end(self) -> None:
        pass


def _context(model, cache_tokens: int) -> int:
    """Tokens a request may hold, prompt and completion: the model's context window (explain()'s rule), at most
    the KV cache."""
    from macs_kernels.api.generation import context_window

    return min(context_window(model) or cache_tokens, cache_tokens)


def check_sizes(*, cache_tokens: int, page_size: int, max_batch_tokens: int, default_max_tokens: int,
                name=str) -> None:
    """The engine's sizes, checked before any model is loaded (`macs-kernels serve` calls this first).

    name: how the errors name a size (the command line names "--cache-tokens" what Engine calls cache_tokens).
    """
    for field, value in (("page_size", page_size), ("max_batch_tokens", max_batch_tokens),
                         ("default_max_tokens", default_max_tokens)):
        if value < 1:
            raise ValueError(f"{name(field)} must be at least 1, got {value}")
    if cache_tokens < page_size or cache_tokens % page_size:
        raise ValueError(f"{name('cache_tokens')} ({cache_tokens}) must be a positive multiple of "
                         f"{name('page_size')} ({page_size})")


def _request_config(config: MacsConfig) -> dict:
    return {k: v for k, v in config.as_dict().items() if k in option_names("rows", "pass")}


def _at2_theta(model, path) -> torch.Tensor | None:
    """The (layers, heads) AT2 coefficients for `model`: from `path` (which must fit the model), else the packaged
    ones when they were trained for it, else None."""
    from macs_kernels.apps.at2.coefficients import DEFAULT_COEFFICIENTS, load_coefficients, model_shape, record_mismatch

    theta, metadata = load_coefficients(path or DEFAULT_COEFFICIENTS)
    mismatch = record_mismatch(metadata, model)
    if tuple(theta.shape) != model_shape(model):
        mismatch = f"theta is {tuple(theta.shape)}, the model has {model_shape(model)} (layers, heads)"
    if mismatch is None:
        return theta.float()
    if path is not None:
        raise ValueError(f"--at2-coefficients {path} were not trained for this model: {mismatch}")
    return None
