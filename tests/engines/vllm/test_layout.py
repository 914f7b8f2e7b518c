"""vLLM's CPU KV cache, written by the backend's own cache writer, read back through macs_kernels' layout adapter
(PagedRows on that layout and FLASH_ATTN's: tests/core/test_core.py)."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from macs_kernels.engines.vllm.tracer import key_pages, probe_layout  # noqa: E402


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


# ---- FLASH_ATTN (GPUs): its cache layout read on the CPU, and the backend chosen by name --------------------
def _flash_cache(keys, slots, blocks, block_size, order):
    """vLLM 0.32's FLASH_ATTN cache of one layer, logical (num_blocks, H_kv, block_size, 2 * D) with each slot's
    key then value on the last axis, stored in the physical axis order `order` (v1/kv_cache_layout.py: LBHNC is
    the identity, LBNHC keeps slots outside heads), NaN where no key was written."""
    tokens, kv_heads, dim = keys.shape
    physical = [(blocks, kv_heads, block_size, 2 * dim)[axis] for axis in order]
    cache = torch.full(physical, float("nan")).permute(*[order.index(axis) for axis in range(4)])
    cache[slots // block_size, :, slots % block_size, :dim] = keys
    cache[slots // block_size, :, slots % block_size, dim:] = -keys  # values
    return cache


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["LBHNC", "LBNHC"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_flash_attn_keys_read_in_place_give_the_reference_rows(order, backend):
    from macs_kernels.core.config import MacsConfig
    from macs_kernels.core.plans import PagedRows
    from macs_kernels.engines.vllm.tracer import flash_key_pages
    from macs_kernels.ops import reference
    from macs_kernels.ops.registry import Kernels

    generator = torch.Generator().manual_seed(3)
    kv_heads, dim, block_size, blocks, lengths, n_input = 2, 64, 16, 40, [150, 77], [140, 60]
    per_row = [torch.randn(length, kv_heads, dim, generator=generator) for length in lengths]
    pages = torch.randperm(blocks, generator=generator)
    table = torch.full((2, 10), -1, dtype=torch.int32)
    table[0, :10], table[1, :5] = pages[:10].int(), pages[10:15].int()
    slots = [table[r, torch.arange(length) // block_size].long() * block_size + torch.arange(length) % block_size
             for r, length in enumerate(lengths)]
    cache = _flash_cache(torch.cat(per_row), torch.cat(slots), blocks, block_size, order)
    k_pages = flash_key_pages(cache, dim)
    assert k_pages.shape == (blocks, block_size, kv_heads, dim) and k_pages.stride(-1) == 1
    assert k_pages.data_ptr() == cache.data_ptr()  # a view: FlashAttention's own keys, not a copy
    assert torch.equal(k_pages[slots[0] // block_size, slots[0] % block_size], per_row[0])
    query = torch.randn(5, 6, dim, generator=generator)  # a pass of 5 query rows; rows 4 and 1 are scored
    scorer = PagedRows(Kernels.of("torch", paged=backend), 1, torch.tensor([4, 1]), table, lengths, n_input,
                       block_size, [MacsConfig(), MacsConfig(pooling="mean")])
    scorer.pool(0, query, k_pages, dim ** -0.5)
    for r, (row, pooling) in enumerate(zip([4, 1], ["max", "mean"])):
        want = reference.macs_pool_reference(
            query[row][None, :, None], per_row[r].transpose(0, 1)[None], input_start=torch.tensor([[0]]),
            input_end=torch.tensor([[n_input[r]]]), kv_len=torch.tensor([[lengths[r]]]), scale=dim ** -0.5,
            pooling=pooling, redistribute=True)[0, 0]
        torch.testing.assert_close(scorer.pooled[0, r, :n_input[r]], want.float(), rtol=1e-5, atol=1e-7)


class _Platform:
    def __init__(self, kind):
        self.kind = kind

    def is_cpu(self):
        return self.kind == "cpu"

    def is_cuda(self):
        return self.kind == "cuda"


@pytest.mark.parametrize("kind,name", [("cuda", "FLASH_ATTN"), ("cpu", "CPU_ATTN"), ("rocm", None)])
def test_the_plugin_wraps_the_backend_the_platform_runs_under_its_name(monkeypatch, kind, name):
    import importlib

    import vllm.platforms
    from vllm.v1.attention.backends import registry

    from macs_kernels.engines.vllm.backend import MacsAttention
    from macs_kernels.vllm import plugin

    registered = []
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(kind))
    monkeypatch.setattr(registry, "register_backend", lambda backend, path: registered.append((backend.name, path)))
    plugin.register()
    if name is None:
        assert registered == []
        return
    assert registered == [(name, plugin.BACKENDS[name])]
    module, _, cls = plugin.BACKENDS[name].rpartition(".")
    backend = getattr(importlib.import_module(module), cls)
    assert backend.get_name() == name  # vLLM's name, its metadata builder and cache shape: only the impl differs
    assert issubclass(backend.get_impl_cls(), MacsAttention)
    assert issubclass(backend.get_impl_cls(), backend.__mro__[1].get_impl_cls())  # vLLM's own impl underneath


def test_layer_windows_in_both_backends_conventions():
    """CPU_ATTN keeps the window (keys a query attends, itself included), FLASH_ATTN FlashAttention's
    (window - 1, 0); both read as the same window, no window as None, a non-causal one refused."""
    from types import SimpleNamespace

    from macs_kernels.engines.vllm.tracer import layer_window

    windows = [layer_window(SimpleNamespace(sliding_window=w)) for w in (-1, 40, (-1, -1), (39, 0))]
    assert windows == [None, 40, None, 40]
    with pytest.raises(NotImplementedError, match=r"sliding window \(39, 39\)"):
        layer_window(SimpleNamespace(sliding_window=(39, 39)))
