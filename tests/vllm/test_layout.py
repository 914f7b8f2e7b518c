"""vLLM's CPU KV cache, written by the backend's own cache writer, read back through macs_kernels' layout adapter
(PagedRows on that layout and FLASH_ATTN's: tests/test_core.py)."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from macs_kernels.vllm.tracer import key_pages, probe_layout  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size", [32, 64, 128])
def test_keys_written_by_the_backend_read_back_through_key_pages(dtype, head_size):
    blocks, kv_heads, block_size, tokens = 6, 3, 32, 150
    transposed = probe_layout("vec", dtype, block_size, head_size)
    assert transposed  # fp32/fp16 `vec` stores key blocks [D, block_size]
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    keys = torch.randn(tokens, kv_heads, head_size).to(dtype)
    values = torch.randn(tokens, kv_heads, head_size).to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    pages = key_pages(cache, transposed)
    assert pages.shape == (blocks, block_size, kv_heads, head_size)
    assert torch.equal(pages[slots // block_size, slots % block_size], keys)
    # Values stay plain: the second half of each (block, head) row, [block_size, D].
    assert torch.equal(value_cache[slots // block_size, :, slots % block_size], values)


def test_a_packing_the_adapter_cannot_read_is_refused():
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("the AMX packing exists only on CPUs with AMX tiles")
    with pytest.raises(NotImplementedError, match="'amx' packs torch.bfloat16 key blocks"):
        probe_layout("amx", torch.bfloat16, 32, 64)
