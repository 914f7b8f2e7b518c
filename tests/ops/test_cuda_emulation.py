"""The emulation of the cuda backend (MACS_KERNELS_CUDA_EMULATION=1, ops/cuda/emulation.py) as a race detector: the
threads of a block run as fibers one after another between two barriers, so a result that changes when they run in
another order (reverse, shuffled each round) is a race that no barrier orders, in any kernel of csrc/. Every op's
kernels, under every split kernel, give the same bits in every order. And the launchers' choice on other GPUs (the
emulation answers their device queries as DEVICES says). Skips without the emulation."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops.cuda import CUDA_SPLIT_KV_KERNELS
from tests.ops.cases import CUDA_BACKEND_DEVICE, why_no_cuda_backend

pytestmark = pytest.mark.skipif(CUDA_BACKEND_DEVICE != "cpu" or why_no_cuda_backend() is not None,
                                reason="needs the cuda backend's CPU emulation (MACS_KERNELS_CUDA_EMULATION=1)")

B, H, H_KV, S, D, R, PAGE = 3, 12, 4, 211, 64, 3, 16  # GQA 3:1, keys over several tiles and splits


def _results(dtype: torch.dtype) -> list[torch.Tensor]:
    """What every cuda op computes from one set of inputs (fresh outputs each call)."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, D, generator=generator).to(dtype)
    block = torch.randn(B, H, R, D, generator=generator).to(dtype)
    k, v = torch.randn(2, B, H_KV, S, D, generator=generator).to(dtype)
    pages_per_item = -(-S // PAGE)
    table = torch.randperm(B * pages_per_item, generator=generator).view(B, pages_per_item).int()
    pages = torch.empty(B * pages_per_item, PAGE, H_KV, D, dtype=dtype)
    for b in range(B):
        for i in range(pages_per_item):
            chunk = k[b, :, i * PAGE:(i + 1) * PAGE].transpose(0, 1)
            pages[table[b, i], :chunk.shape[0]] = chunk
    rows = torch.softmax(torch.randn(B, H, S, generator=generator), -1)
    start, end, length = torch.tensor([0, 7, 50]), torch.tensor([150, 120, 51]), torch.tensor([S, 190, 120])
    width = int((end - start).max())
    ranges = dict(input_start=start, input_end=end, kv_len=length, scale=D ** -0.5)
    results = []

    out = torch.zeros(B, width)
    ops.macs_pool(q, k, out=out, backend="cuda", **ranges)
    block_out = torch.zeros(B, R, width)
    block_length = torch.stack([length - 2, length - 1, length], dim=1)
    ops.macs_pool(block, k, out=block_out, backend="cuda", **(ranges | dict(kv_len=block_length)))
    paged_out = torch.zeros(B, width)
    ops.macs_pool_paged(q, pages, table, out=paged_out, backend="cuda", **ranges)
    log_c = torch.zeros(B, width)
    attention = ops.decode_attention(q, k, v, kv_start=start, kv_len=length, input_end=end, scale=D ** -0.5,
                                     log_c=log_c, backend="cuda")
    row_log_c = torch.zeros(B, width)
    ops.macs_update_rows(rows, row_log_c, input_start=start, input_end=end, kv_len=length, backend="cuda")
    z = ops.macs_zscore(log_c, end - start, backend="cuda")
    features = ops.attention_features(block, k, source_start=start, source_end=end, kv_len=length, kv_start=start,
                                      n_rows=torch.full((B,), R), scale=D ** -0.5, n_max=width, backend="cuda")
    results += [out, block_out, paged_out, *attention, log_c, row_log_c, z, features]
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", CUDA_SPLIT_KV_KERNELS)
def test_cuda_results_do_not_depend_on_the_order_threads_run_in(kernel, dtype):
    from macs_kernels.ops.cuda import cuda_split_kv_kernel, emulation, set_cuda_split_kv_kernel

    previous = cuda_split_kv_kernel()
    set_cuda_split_kv_kernel(kernel)
    emulation.set_device("4 SMs")  # few splits of many tiles: every kernel's tile loop goes round
    try:
        expected = _results(dtype)
        for order, seed in (("reverse", 0), ("shuffled", 1), ("shuffled", 2)):
            emulation.set_thread_order(order, seed)
            for want, got in zip(expected, _results(dtype)):
                assert torch.equal(want, got), f"{order} (seed {seed}) changed a result: a race"
    finally:
        emulation.set_thread_order("forward")
        emulation.set_device("H200")
        set_cuda_split_kv_kernel(previous)


@pytest.mark.parametrize("device, expected", [("H200", "mma_split_kernel<"), ("A100", "mma_split_kernel<"),
                                              ("T4", "pipelined_split_kernel<")])
def test_the_tensor_core_kernel_is_chosen_only_from_sm_80(device, expected):
    """mma.sync.m16n8k16 and ldmatrix need sm_80: on a T4 (7.5) "mma" runs the pipelined kernel (its device code would
    trap there)."""
    from macs_kernels.ops.cuda import cuda_split_kv_kernel, emulation, set_cuda_split_kv_kernel

    previous = cuda_split_kv_kernel()
    set_cuda_split_kv_kernel("mma")
    emulation.set_device(device)
    try:
        emulation.take_launches()
        q, k = torch.randn(1, 8, 64).bfloat16(), torch.randn(2, 1, 2, 100, 64).bfloat16()
        ops.decode_attention(q, k[0], k[1], kv_len=torch.tensor([100]), scale=0.125, backend="cuda")
        split = [name for name in emulation.take_launches() if "split_kernel<" in name]
    finally:
        emulation.set_device("H200")
        set_cuda_split_kv_kernel(previous)
    assert len(split) == 1 and expected in split[0], split
