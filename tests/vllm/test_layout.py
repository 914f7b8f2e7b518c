"""vLLM's CPU KV cache read through macs_kernels' layout adapter, and PagedRows on paged caches, against keys
and rows computed directly."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from macs_kernels.config import MacsConfig  # noqa: E402
from macs_kernels.core import Kernels, PagedRows  # noqa: E402
from macs_kernels.ops import macs_pool  # noqa: E402
from macs_kernels.ops.torch_backend import log_floor  # noqa: E402
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


def _paged(keys_per_row, page_size, pages_total, layout):
    """A paged cache holding each row's keys (H_kv, L, D) in shuffled pages, in `layout`, and its block table."""
    kv_heads, dim = keys_per_row[0].shape[0], keys_per_row[0].shape[2]
    order = torch.randperm(pages_total)
    pages = torch.zeros(pages_total, page_size, kv_heads, dim)
    width = max(-(-k.shape[1] // page_size) for k in keys_per_row)
    table = torch.full((len(keys_per_row), width + 1), -1, dtype=torch.int32)
    used = 0
    for r, keys in enumerate(keys_per_row):
        for j in range(-(-keys.shape[1] // page_size)):
            chunk = keys[:, j * page_size:(j + 1) * page_size].transpose(0, 1)
            pages[order[used], : chunk.shape[0]] = chunk
            table[r, j] = order[used]
            used += 1
    if layout == "vllm_cpu":  # [P, H_kv, page, 2D] with key blocks transposed
        cache = torch.zeros(pages_total, kv_heads, page_size, 2 * dim)
        flat = cache.view(pages_total, kv_heads, 2 * page_size * dim)
        flat[:, :, : page_size * dim] = pages.permute(0, 2, 3, 1).reshape(pages_total, kv_heads, -1)
        return key_pages(cache, True), table
    # FLASH_ATTN's [2, P, page, H_kv, D]: keys are its first half, unit stride in D
    cache = torch.stack([pages, torch.randn_like(pages)])
    return cache[0], table


@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_attn"])
def test_paged_rows_equal_the_dense_op_per_row(layout):
    heads, kv_heads, dim, page_size = 6, 2, 32, 32
    lengths, n_input = [40, 97, 64, 130], [30, 60, 64, 100]
    configs = [MacsConfig(), MacsConfig(pooling="mean", alpha=0.5), MacsConfig(redistribute=False),
               MacsConfig(pooling="min", alpha=1.0)]
    keys = [torch.randn(kv_heads, length, dim) for length in lengths]
    k_pages, table = _paged(keys, page_size, 24, layout)
    query = torch.randn(11, heads, dim)
    rows = torch.tensor([2, 5, 7, 10])
    scorer = PagedRows(Kernels.of("torch"), 2, rows, table, lengths, n_input, page_size, configs)
    layer_queries = [query, query * 0.5]
    for layer, q in enumerate(layer_queries):
        scorer.pool(layer, q, k_pages, 0.3)
    log_c, broken = scorer.finish()
    assert not broken.any()
    for r, (config, length, n) in enumerate(zip(configs, lengths, n_input)):
        expected = torch.zeros(n)
        for q in layer_queries:
            pooled = macs_pool(q[rows[r]][None], keys[r][None], input_start=0, input_end=n, kv_len=length, scale=0.3,
                               pooling=config.pooling, redistribute=config.redistribute, backend="torch")
            expected += log_floor(pooled[0], config.alpha)
        torch.testing.assert_close(log_c[r, :n], expected, rtol=1e-5, atol=1e-5)
        assert (log_c[r, n:] == 0).all()
