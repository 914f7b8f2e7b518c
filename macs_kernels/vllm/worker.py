"""The worker extension under the name users give vLLM (`--worker-extension-cls
macs_kernels.vllm.worker.AttributionWorker`, `WORKER_EXTENSION`): its code is the engine adapter's."""
from macs_kernels.engines.vllm.worker import AttributionWorker

__all__ = ["AttributionWorker"]
