"""vLLM's internals: the attention backend, its tracer and the worker extension (macs_kernels.vllm is
the public facade over them)."""
