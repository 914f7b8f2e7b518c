"""What an engine's `VllmConfig` says that the worker extension, its metadata builders and the public facade all
read: the attention layers' order, whether the workers carry the extension, the dtype and the head split."""
from __future__ import annotations

from macs_kernels.core.shards import HeadShards

WORKER_EXTENSION = "macs_kernels.vllm.worker.AttributionWorker"
# vLLM's `additional_config` entry that sizes the CUDA-graph path's buffers (an engine allocates them only if asked).
CONFIG_KEY = "macs_kernels"


def layer_order(vllm_config) -> list[str]:
    """The names of the model's standard attention layers, in forward order."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(get_layers_from_vllm_config(vllm_config, Attention), key=extract_layer_index)


def has_worker_extension(vllm_config) -> bool:
    """Whether vLLM built its workers with this package's worker extension (or a subclass of it)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    name = vllm_config.parallel_config.worker_extension_cls
    if name == WORKER_EXTENSION:
        return True
    try:
        return bool(name) and issubclass(resolve_obj_by_qualname(name), resolve_obj_by_qualname(WORKER_EXTENSION))
    except (ImportError, AttributeError, ValueError, TypeError):  # vLLM itself names what it cannot import
        return False


def model_dtype(vllm_config) -> str:
    """The dtype the engine runs the model in ("bfloat16", "float32"), which the rows are computed in too."""
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def head_shards(vllm_config) -> HeadShards | None:
    """vLLM's tensor-parallel split of the query heads (each rank runs heads / size of them), or None: the core
    reduces each rank's head pooling over the group once per pass."""
    from vllm.distributed.parallel_state import get_tp_group

    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return None
    group, model = get_tp_group(), vllm_config.model_config
    return HeadShards(group.cpu_group, size, group.rank_in_group,
                      model.get_num_attention_heads(vllm_config.parallel_config) * size, model.get_total_num_kv_heads())
