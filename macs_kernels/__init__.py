"""macs_kernels: token attribution from attention, computed inside a FlashAttention-style inference pass.

The top level imports only torch: transformers, triton and the compiled extension load when first used.
"""
from __future__ import annotations

import importlib

from macs_kernels.core.config import MacsConfig

__version__ = "0.1.0"

_LAZY = {
    "explain": "macs_kernels.api.explanation",
    "stream": "macs_kernels.api.explanation",
    "Explanation": "macs_kernels.api.explanation",
    "attach": "macs_kernels.engines.generate",
    "Tracer": "macs_kernels.engines.generate",
    "qa_prompt": "macs_kernels.api.prompts",
    "load_model": "macs_kernels.api.models",
    "trace_tensors": "macs_kernels.apps.interop",
    "TraceTensors": "macs_kernels.apps.interop",
    "qa_messages": "macs_kernels.api.prompts",
    "attach_continuous": "macs_kernels.engines.continuous",
    "AT2Attributor": "macs_kernels.apps.at2",
    "default_model_path": "macs_kernels.api.models",
}

__all__ = ["MacsConfig", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'macs_kernels' has no attribute {name!r}")
