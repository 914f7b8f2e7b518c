"""vLLM with a multimodal model is refused when the attribution backend attaches, before any generation (runs in
vLLM's own environment; skips without vllm)."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")


def test_multimodal_model_refused_naming_the_engine():
    from macs_kernels.engines.vllm.worker import attention_layers

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=True, is_multimodal_model=True),
        speculative_config=None, parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
    )
    with pytest.raises(NotImplementedError, match="vLLM with a multimodal model"):
        attention_layers(config)
