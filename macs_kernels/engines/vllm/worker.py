"""The worker side: the worker extension (`LLM(..., worker_extension_cls=WORKER_EXTENSION)`) whose methods
`LLM.collective_rpc` calls to attach the tracer and to read and release a request's rows, and the tracer
that the attention backend of this process feeds."""
from __future__ import annotations

import numpy as np
import torch

from macs_kernels.core import support
from macs_kernels.engines.vllm import graphs
from macs_kernels.engines.vllm import tracer as tracing
from macs_kernels.engines.vllm.engine_config import head_shards, layer_order


def attention_layers(vllm_config) -> dict:
    """The model's attention layers by name, in forward order, after refusing (naming it) what the backend
    cannot follow: speculative decoding, pipeline parallelism, a quantised KV cache, layers that
    are not vLLM's standard decoder attention on the MACS backend, non-causal windows, ALiBi, a KV-cache
    layout it cannot read (vLLM's AMX packing of bfloat16 keys). Sliding
    windows, sinks (gpt-oss) and logit soft caps (Gemma 2) are followed."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionType

    from macs_kernels.engines.vllm.backend import MacsAttention

    if vllm_config.speculative_config is not None:
        support.check("vllm", "exact", "speculative")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError("pipeline parallelism splits the layers over workers; macs_kernels needs every "
                                  "layer's rows in one worker")
    if vllm_config.model_config.is_multimodal_model:
        raise NotImplementedError("vLLM with a multimodal model: macs_kernels' vLLM backend is not checked on image "
                                  "inputs; explain images with transformers (explain(model, processor, prompt, "
                                  "images=...))")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise NotImplementedError(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}: macs_kernels reads "
                                  "the KV cache in the model's dtype only (kv_cache_dtype='auto')")
    layers = get_layers_from_vllm_config(vllm_config, Attention)
    expected = vllm_config.model_config.get_total_num_hidden_layers()
    if len(layers) != expected:
        raise NotImplementedError(
            f"the model has {expected} layers but {len(layers)} of vLLM's standard attention layers: macs_kernels "
            "needs every layer's attention rows"
        )
    for name, layer in layers.items():
        impl = layer.impl
        if not isinstance(impl, MacsAttention):
            raise NotImplementedError(
                f"layer {name} runs {type(impl).__name__}, not a macs_kernels attention backend: is the "
                "vllm.general_plugins entry point installed (pip install -e . in vLLM's environment)?"
            )
        if impl.attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"layer {name} is {impl.attn_type} attention; macs_kernels follows decoders")
        tracing.layer_window(impl)  # refuses a window it cannot follow
        if impl.alibi_slopes is not None:
            raise NotImplementedError(f"layer {name} uses ALiBi; macs_kernels scores softmax rows without biases")
        impl.macs_key_pages(layer, layer.kv_cache)  # refuses a cache layout it cannot read (AMX's bf16 pairs)
    return {name: layers[name] for name in layer_order(vllm_config)}


def decode_rows(entry: dict) -> torch.Tensor:
    """A `macs_rows` entry's rows as (steps, N) float32."""
    shape = (entry["steps"], entry["n_input"])
    return torch.from_numpy(np.frombuffer(entry["log_c"], dtype=np.float32).reshape(shape).copy())


class AttributionWorker:
    """Methods vLLM adds to its worker class; call them with `LLM.collective_rpc("macs_...")`."""

    def macs_attach(self, keep_finished: int = 256) -> str:
        """Start following this worker's passes (once; later calls keep the tracer); returns the backend that
        reads its paged cache (numba's in place, or torch's gather on CPUs; with CUDA graphs, the kernel captured
        at engine start)."""
        active = tracing.ACTIVE
        if active is None or active.runner is not self.model_runner:
            layers = attention_layers(self.vllm_config)
            refusal = graphs.unbuffered(self.vllm_config)
            if refusal is not None:
                raise RuntimeError(refusal)
            active = tracing.VllmTracer(self.model_runner, layers, keep_finished, head_shards(self.vllm_config))
            steps = graphs.ACTIVE
            if steps is not None:
                active.capacity = (steps.max_rows, steps.n_max)
            tracing.ACTIVE = active
        steps = graphs.ACTIVE
        return (active if steps is None else steps.buffers).kernels.paged_backend

    def macs_rows(self, request_ids: list, release: bool = False, start: int = 0, stop: int | None = None) -> dict:
        """Each request's rows [start, stop) (stop: every row so far), by the id it was asked by (external,
        worker-side or its ticket): {"n_input": N, "steps": steps, "log_c": float32 bytes of (steps, N)} or
        {"error": why}."""
        active = tracing.ACTIVE
        if active is None:
            raise RuntimeError("macs_kernels is not attached to this engine: call macs_kernels.vllm.attach(llm)")
        graphs.collect()
        found = {}
        for request_id in request_ids:
            try:
                key = active.worker_id(request_id)
            except KeyError as error:  # an id several held requests were sent with: neither read nor released
                found[request_id] = {"error": f"{type(error).__name__}: {error}"}
                continue
            try:
                log_c, n_input = active.rows(key, start, stop)
                found[request_id] = {"n_input": n_input, "steps": log_c.shape[0], "log_c": log_c.numpy().tobytes()}
            except (KeyError, ValueError, FloatingPointError, RuntimeError) as error:
                found[request_id] = {"error": f"{type(error).__name__}: {error}"}
            if release:
                active.release(key)
        return found

    def macs_keep_more(self, count: int) -> None:
        """Keep `count` more finished requests' rows until released (negative: give them back), for a caller
        that reads a batch of requests only once all have run."""
        active = tracing.ACTIVE
        if active is None:
            raise RuntimeError("macs_kernels is not attached to this engine: call macs_kernels.vllm.attach(llm)")
        active.keep_more(count)

    def macs_release(self, request_ids: list) -> None:
        graphs.collect()
        if tracing.ACTIVE is not None:
            for request_id in request_ids:
                tracing.ACTIVE.release(request_id)
