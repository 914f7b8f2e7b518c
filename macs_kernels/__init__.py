"""macs_kernels: token attribution from attention, computed inside a FlashAttention-style inference pass.

The top level imports only torch: transformers, triton and the compiled extension load when first used.
"""
from __future__ import annotations

import importlib

from .config import MacsConfig

__version__ = "0.1.0"

_LAZY = {
    "explain": "macs_kernels.explanation",
    "stream": "macs_kernels.explanation",
    "Explanation": "macs_kernels.explanation",
    "attach": "macs_kernels.tracing",
    "Tracer": "macs_kernels.tracing",
    "qa_prompt": "macs_kernels.prompts",
    "load_model": "macs_kernels.models",
    "trace_tensors": "macs_kernels.interop",
    "TraceTensors": "macs_kernels.interop",
}

__all__ = ["MacsConfig", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'macs_kernels' has no attribute {name!r}")
