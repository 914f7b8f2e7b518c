"""Every cuda split kernel (CUDA_SPLIT_KV_KERNELS: verified, pipelined, mma) against the float64 references on a GPU:
the fused decode (out, lse and MACS's pooled row) in fp32 and bf16, GQA 1, 4 and 8, D 64 and 128, ragged per-row
ranges with generated keys, odd key counts. The `kernels` preset of .ci/gpu runs it, under compute-sanitizer too
(-k mma). Skips without a CUDA device and the built extension."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.ops.test_cuda_ops import _why_skip, split_kernel  # noqa: F401 - the fixture: one run per split kernel
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))]

CASES = list(itertools.product((torch.float32, torch.bfloat16), (1, 4, 8), (64, 128)))


@pytest.mark.usefixtures("split_kernel")
@pytest.mark.parametrize("dtype, group, dim", CASES)
def test_the_fused_decode_matches_float64(dtype, group, dim):
    batch, kv_heads, keys = 3, 2, 1537
    generator = torch.Generator().manual_seed(group * 1000 + dim)
    q = torch.randn(batch, group * kv_heads, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, keys, dim, generator=generator).to(dtype)
    kv_start = torch.tensor([0, 17, 301])
    kv_len = torch.tensor([keys, 1100, 333])
    input_end = kv_len - torch.tensor([5, 64, 1])
    scale = 1.0 / math.sqrt(dim)
    pooled = torch.zeros(batch, int((input_end - kv_start).max()), device="cuda")
    cuda = [t.cuda() for t in (q, k, v)]
    out, lse = ops.decode_attention(*cuda, kv_start=kv_start.cuda(), kv_len=kv_len.cuda(), scale=scale,
                                    pooled=pooled, input_end=input_end.cuda(), backend="cuda")
    want_out, want_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=scale)
    want_pool = reference.macs_pool_reference(q[:, :, None], k, input_start=kv_start[:, None],
                                              input_end=input_end[:, None], kv_len=kv_len[:, None], scale=scale)
    assert relative_error(out, want_out) < RELATIVE_ERROR[dtype]
    # lse and the pooled row come from fp32 scores of the inputs as given: float32's tolerance in every dtype.
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    for b in range(batch):
        n = int(input_end[b] - kv_start[b])
        assert relative_error(pooled[b, :n], want_pool[b, 0, :n]) < RELATIVE_ERROR[torch.float32]
