"""The tensor-core split kernel's tile loop and fragment index math (csrc/split_kv_mma), replayed lane by lane on
the CPU by tests/ops/cuda_mma_model.py, against the float64 references of ops/reference.py: attention output and
lse (decode_attention_reference), every attended key's fp32 score written once and nothing else, and MACS's pooled
row from those scores (macs_pool_reference). GQA 1, 3, 4, 6, 8 and 16, D 64 and 128, ragged per-row ranges, odd sizes,
several splits and query-row chunks; the GPU run is the `kernels` preset of .ci/gpu."""
from __future__ import annotations

import math

import pytest
import torch

from macs_kernels.ops.reference import decode_attention_reference, macs_pool_reference
from tests.ops import cuda_mma_model as model
from tests.tolerances import RELATIVE_ERROR, relative_error

# (heads, kv_heads, rows, keys, dim, splits): GQA 1 (one real vector of 16), 4, 8 (two row chunks) and 16 (no
# padding), ragged ranges that start and end inside tiles, a split with no key of some rows.
CASES = [
    (2, 2, 1, 150, 64, 2),
    (8, 2, 3, 97, 64, 1),
    (8, 1, 3, 131, 64, 3),
    (16, 1, 1, 70, 128, 2),
    # GQA 3 at D 128 (13 padding rows) over 113 keys; GQA 6 x 3 rows = 18 vectors (two row chunks, the second
    # mostly padding).
    (9, 3, 2, 113, 128, 2),
    (12, 2, 3, 77, 64, 2),
]


def _ranges(batch, rows, keys, seed):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 20, (batch, rows), generator=generator)
    end = keys - torch.randint(0, 9, (batch, rows), generator=generator)
    input_end = end - torch.randint(1, 6, (batch, rows), generator=generator)
    return start, input_end, end


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, rows, keys, dim, splits", CASES)
def test_the_tile_loop_matches_the_float64_reference(dtype, heads, kv_heads, rows, keys, dim, splits):
    batch, scale = 2, 1.0 / math.sqrt(dim)
    generator = torch.Generator().manual_seed(heads * 1000 + keys)
    q = torch.randn(batch, heads, rows, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, keys, dim, generator=generator).to(dtype)
    start, input_end, end = _ranges(batch, rows, keys, keys)

    part_stats, part_acc, scores = model.mma_split_pass(q, k, v, start, input_end, end, scale, splits)
    lse, lse2, generated, out = model.combine(part_stats, part_acc)

    group = heads // kv_heads
    for r in range(rows):
        want_out, want_lse = decode_attention_reference(
            q[:, :, r], k, v, kv_start=start[:, r], kv_len=end[:, r], scale=scale)
        # lse and the scores come from fp32 accumulation of exact products: float32's tolerance.
        assert relative_error(lse[:, :, r], want_lse) < RELATIVE_ERROR[torch.float32]
        # The output's weights are rounded to the input dtype before PV, as FlashAttention's are.
        assert relative_error(out[:, :, r], want_out) < RELATIVE_ERROR[dtype]
        for b in range(batch):
            s, e = int(start[b, r]), int(end[b, r])
            written = ~scores[b, :, r].isnan()
            assert written[:, s:e].all() and not written[:, :s].any() and not written[:, e:].any()
            want = torch.einsum("hd,hkd->hk", q[b, :, r].double(),
                                k[b].double().repeat_interleave(group, 0)[:, s:e]) * scale * model.LOG2E
            assert relative_error(scores[b, :, r, s:e], want) < RELATIVE_ERROR[torch.float32]

    # MACS's row from the same fp32 scores, as pool_kernel computes it: p = 2^(score - lse2), plus the generated
    # mass spread over the N inputs, max over heads.
    want_pool = macs_pool_reference(q, k, input_start=start, input_end=input_end, kv_len=end, scale=scale)
    for b in range(batch):
        for r in range(rows):
            s, n = int(start[b, r]), int(input_end[b, r] - start[b, r])
            p = torch.exp2(scores[b, :, r, s:s + n].double() - lse2[b, :, r, None].double())
            pooled = (p + generated[b, :, r, None].double() / n).amax(0)
            assert relative_error(pooled, want_pool[b, r, :n]) < RELATIVE_ERROR[torch.float32]


def test_a_row_with_no_key_in_a_split_leaves_an_empty_state():
    """A split past every key of a row: max -inf and sums 0 (the combine skips it), never NaN."""
    q = torch.randn(1, 4, 2, 64).to(torch.bfloat16)
    k, v = torch.randn(2, 1, 1, 200, 64).to(torch.bfloat16)
    start, input_end, end = torch.tensor([[0, 0]]), torch.tensor([[30, 150]]), torch.tensor([[40, 190]])
    part_stats, part_acc, _ = model.mma_split_pass(q, k, v, start, input_end, end, 0.125, 3)
    assert not part_stats.isnan().any() and not part_acc.isnan().any()
    # Row 0's 40 keys lie in the first of three 64-key-tile splits; the later splits hold none of them.
    assert (part_stats[0, :, 0, 1:, 0] == -math.inf).all() and (part_stats[0, :, 0, 1:, 1] == 0).all()


def test_the_fragment_layouts_are_a_permutation():
    """Each lane register element of A, B and C names a distinct matrix element: the spec side of the model."""
    rows, cols = model._a_coords()
    assert len(set(zip((rows * 16 + cols).flatten().tolist()))) == 256
    ks, ns = model._b_coords()
    assert len(set((ks * 8 + ns).flatten().tolist())) == 128
    rows, cols = model._c_coords()
    assert len(set((rows * 8 + cols).flatten().tolist())) == 128
