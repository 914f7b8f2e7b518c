"""The triton backend's settings: which fused MACS pass it runs.

ops/triton/split_kv.py: "verified", the default, ran on a GPU (split, combine, pool: three launches); "two-launch"
(the head pooling folded into the combine launch) and "one-launch" (combine and pooling after each tile's last
arrival, in the split launch) are selectable until they have. Chosen for the process by MACS_KERNELS_TRITON_SPLIT_KV
(read at the first fused launch) or by set_triton_split_kv_pass.
"""
from __future__ import annotations

import os

TRITON_SPLIT_KV_PASSES = ("verified", "two-launch", "one-launch")
_triton_split_kv_pass: str | None = None


def triton_split_kv_pass() -> str:
    """The pass that the triton backend's decode_attention (with MACS), macs_update and macs_pool(_paged) run."""
    if _triton_split_kv_pass is None:
        set_triton_split_kv_pass(os.environ.get("MACS_KERNELS_TRITON_SPLIT_KV", "verified"))
    return _triton_split_kv_pass


def set_triton_split_kv_pass(name: str) -> None:
    """Run the fused pass `name` (one of TRITON_SPLIT_KV_PASSES) from now on in this process; a CUDA graph keeps the
    kernels it captured."""
    global _triton_split_kv_pass
    if name not in TRITON_SPLIT_KV_PASSES:
        raise ValueError(f"unknown triton split-KV pass {name!r}; choose one of {TRITON_SPLIT_KV_PASSES}")
    _triton_split_kv_pass = name
