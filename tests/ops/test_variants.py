"""The torch, Triton and CUDA kernels of attention variants (ops.Variant: sliding windows over a cache that
dropped the tokens that slid out, logit softcapping, attention sinks) against the float64 reference over every
token's keys."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference, why_unavailable
from macs_kernels.ops.registry import Kernels
from macs_kernels.ops.torch.packed import Segments
from macs_kernels.ops.variant import Variant
from tests.ops.cases import (
    CUDA_BACKEND_DEVICE,
    CUDA_SPLIT_KERNEL_CASES,
    DEVICE,
    assert_split_kernel,
    launched_kernels,
    why_no_cuda_backend,
)
from tests.tolerances import RELATIVE_ERROR, relative_error

HEADS, KV_HEADS, DIM = 4, 2, 16
VARIANTS = {  # name -> (window, softcap, sinks?)
    "window": (5, None, False),
    "window_softcap": (7, 3.0, False),
    "softcap": (None, 2.0, False),
    "sinks": (None, None, True),
    "window_sinks": (3, None, True),
    "all": (6, 4.0, True),
}


def _case(window, sinks, seed, dim=DIM, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    # Two items of 23 tokens; item 1 left-padded by 3; rows: the last query and a verify row before it.
    k = (torch.randn(2, KV_HEADS, 23, dim, generator=generator) * 2).to(dtype)
    v = torch.randn(2, KV_HEADS, 23, dim, generator=generator).to(dtype)
    q = (torch.randn(2, HEADS, 2, dim, generator=generator) * 2 / (dim / DIM) ** 0.5).to(dtype)
    input_start = torch.tensor([[0, 0], [3, 3]])
    input_end = torch.tensor([[11, 11], [9, 9]])
    kv_len = torch.tensor([[22, 23], [22, 23]])
    sink = torch.randn(HEADS, generator=generator) * 2 if sinks else None
    return q, k, v, (input_start, input_end, kv_len), sink


BACKENDS = [pytest.param(name, marks=pytest.mark.skip(reason=why_unavailable(name, DEVICE))
                         if why_unavailable(name, DEVICE) else ()) for name in ("torch", "triton", "cuda")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["max", "mean"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_pool_and_decode_of_a_variant_layer_equal_the_reference(name, pooling, backend):
    _check_variant_layer(name, pooling, backend, DEVICE)


@pytest.mark.skipif(why_no_cuda_backend() is not None, reason=str(why_no_cuda_backend()))
@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_cuda_split_kernel_runs_a_variant_layer(name, kernel, dtype, dim):
    """The cuda backend's split kernels each on inputs it is chosen for (tests/ops/cases.py): the variant arguments
    on each, in 16-bit inputs too (the tensor-core kernel's)."""
    with launched_kernels() as names:
        _check_variant_layer(name, "max", "cuda", CUDA_BACKEND_DEVICE, dim, dtype)
    assert_split_kernel(names, kernel)


def _check_variant_layer(name, pooling, backend, device, dim=DIM, dtype=torch.float32):
    """m' of a verify block and the fused decode's m' and output of its last row, against float64 from the same
    inputs: m' (from float32 scores in every dtype) within 2e-6, the output within 2e-5 in float32 and within its
    dtype's tolerance otherwise."""
    window, softcap, with_sinks = VARIANTS[name]
    kernels = Kernels.of(backend)
    q, k, v, ranges, sinks = _case(window, with_sinks, len(name), dim, dtype)
    q, k, v, sinks = (None if t is None else t.to(device) for t in (q, k, v, sinks))
    ranges = tuple(bound.to(device) for bound in ranges)
    expected, expected_out = reference.variant_pool_reference(
        q, k, v, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25, window=window,
        softcap=softcap, sinks=sinks, pooling=pooling,
    )
    # A sliding-window cache holds only the last tokens: drop the first ones the window no longer needs.
    offset = 23 - window - 1 if window is not None else 0
    variant = Variant(window=window, key_offset=offset, softcap=softcap, sinks=sinks)
    out = torch.empty(2, 2, 11, device=device)
    slots, extra = variant.key_slots(*ranges)
    kernels.pool(q, k[:, :, offset:], out, *slots, 0.25, pooling, True, None, **extra)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=2e-6)
    if window is not None:  # the window bites: the first inputs are seen through the spread only
        assert not torch.allclose(expected, reference.variant_pool_reference(
            q, k, v, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25, softcap=softcap,
            sinks=sinks, pooling=pooling)[0])
    pooled = torch.empty(2, 11, device=device)
    (attend, end, length), extra = variant.key_slots(ranges[0][:, 1], ranges[1][:, 1], ranges[2][:, 1])
    attention, _ = kernels.decode(
        q[:, :, 1], k[:, :, offset:], v[:, :, offset:], attend, length, 0.25, None, end, 0.0, pooling, True, pooled,
        **extra,
    )
    torch.testing.assert_close(pooled.cpu().double(), expected[:, 1], rtol=0, atol=2e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(attention.cpu().double(), expected_out[:, 1], rtol=0, atol=2e-5)
    else:
        assert relative_error(attention, expected_out[:, 1]) < RELATIVE_ERROR[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_given_as_a_column_of_a_wider_tensor_are_read_as_their_values(backend):
    """Sinks of stride 2: Triton's combine read them as if contiguous (other heads' logits and the zeros between,
    a relative error of 0.29 in m' and the output), the cuda kernels refused them."""
    q, k, v, ranges, sinks = _case(None, True, seed=11)
    wide = torch.zeros(2 * HEADS)
    wide[::2] = sinks
    strided = wide[::2]
    assert strided.stride() == (2,) and torch.equal(strided, sinks)
    q, k, v, sinks, strided = (t.to(DEVICE) for t in (q, k, v, sinks, strided))
    ranges = tuple(bound.to(DEVICE) for bound in ranges)
    expected, expected_out = reference.variant_pool_reference(
        q, k, v, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25, sinks=sinks)
    pooled = ops.macs_pool(q, k, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25,
                           sinks=strided, backend=backend)
    torch.testing.assert_close(pooled.cpu().double(), expected, rtol=0, atol=2e-6)
    decoded = torch.zeros(2, 11, device=DEVICE)
    out, _ = ops.decode_attention(q[:, :, 1], k, v, kv_start=ranges[0][:, 1], kv_len=ranges[2][:, 1], scale=0.25,
                                  sinks=strided, pooled=decoded, input_end=ranges[1][:, 1], backend=backend)
    torch.testing.assert_close(decoded.cpu().double(), expected[:, 1], rtol=0, atol=2e-6)
    torch.testing.assert_close(out.cpu().double(), expected_out[:, 1], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_segments_of_a_variant_layer_equal_the_reference(name):
    """Continuous batching's layout: requests back to back, a window layer holding each request's last tokens."""
    window, softcap, with_sinks = VARIANTS[name]
    q, k, v, ranges, sinks = _case(window, with_sinks, seed=7 + len(name))
    n_input = [11, 6]
    expected, expected_out = reference.variant_pool_reference(
        q[:, :, 1:], k, v, input_start=ranges[0][:, 1:], input_end=ranges[1][:, 1:], kv_len=ranges[2][:, 1:],
        scale=0.25, window=window, softcap=softcap, sinks=sinks,
    )
    # Request b's tokens are k[b, :, start:23]; a window layer keeps its last `window + 2` of them.
    starts_in_item = [0, 3]
    kept = [23 - s if window is None else window + 2 for s in starts_in_item]
    pieces_k = [k[b, :, 23 - kept[b]:] for b in range(2)]
    pieces_v = [v[b, :, 23 - kept[b]:] for b in range(2)]
    segments = Segments([0, kept[0]], kept, n_input, [True, True], torch.device("cpu"),
                        offsets=[23 - s - length for s, length in zip(starts_in_item, kept)], window=window)
    query = torch.stack([q[0, :, 1], q[1, :, 1]], dim=1)  # (H, R, D)
    probabilities = segments.probabilities(query, torch.cat(pieces_k, dim=1), 0.25, softcap, sinks)
    outputs = segments.outputs(probabilities, torch.cat(pieces_v, dim=1))
    pooled = segments.spread_inputs(probabilities).amax(dim=1)
    for b in range(2):
        torch.testing.assert_close(pooled[b, : n_input[b]].double(), expected[b, 0, : n_input[b]], rtol=0, atol=2e-6)
        torch.testing.assert_close(outputs[b].double(), expected_out[b, 0], rtol=0, atol=2e-5)


def test_variant_arguments_are_checked():
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        Variant(window=0)
    for softcap in (-1.0, True):  # a bool was taken as a cap of 1.0
        with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
            Variant(softcap=softcap)
    with pytest.raises(ValueError, match="sinks must be a"):
        Variant(sinks=torch.zeros(2, 2))
    assert Variant().plain and not Variant(key_offset=3).plain


def test_public_ops_take_a_variant_on_torch_and_refuse_it_elsewhere():
    from macs_kernels import ops

    q, k, v, ranges, sinks = _case(5, True, seed=3)
    variant = Variant(window=5, key_offset=17, softcap=3.0, sinks=sinks)
    expected, expected_out = reference.variant_pool_reference(
        q, k, v, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25, window=5, softcap=3.0,
        sinks=sinks,
    )
    out = ops.macs_pool(q, k[:, :, 17:], input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25,
                        variant=variant, backend="torch")
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
    pooled = torch.empty(2, 11)
    attention, _ = ops.decode_attention(q[:, :, 1], k[:, :, 17:], v[:, :, 17:], kv_start=ranges[0][:, 1],
                                        kv_len=ranges[2][:, 1], input_end=ranges[1][:, 1], scale=0.25, pooled=pooled,
                                        variant=variant, backend="torch")
    torch.testing.assert_close(attention.double(), expected_out[:, 1], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="before key_offset=19"):
        ops.macs_pool(q, k[:, :, 19:], input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25,
                      variant=Variant(window=5, key_offset=19), backend="torch")
    with pytest.raises(ValueError, match="one logit per query head"):
        ops.macs_pool(q, k, input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25,
                      variant=Variant(sinks=torch.zeros(3)), backend="torch")


def test_the_variant_is_the_ops_own_optional_arguments():
    """window, key_offset, softcap, sinks as arguments of the op equal variant=; a block table makes macs_pool the
    paged op; a variant and its arguments together are refused."""
    from macs_kernels import ops

    q, k, v, ranges, sinks = _case(5, True, seed=5)
    variant = Variant(window=5, key_offset=17, softcap=3.0, sinks=sinks)
    bounds = dict(input_start=ranges[0], input_end=ranges[1], kv_len=ranges[2], scale=0.25, backend="torch")
    expected = ops.macs_pool(q, k[:, :, 17:], variant=variant, **bounds)
    assert torch.equal(ops.macs_pool(q, k[:, :, 17:], **variant.kwargs(), **bounds), expected)
    pooled, given = torch.empty(2, 11), torch.empty(2, 11)
    decode = dict(kv_start=ranges[0][:, 1], kv_len=ranges[2][:, 1], input_end=ranges[1][:, 1], scale=0.25,
                  backend="torch")
    out = ops.decode_attention(q[:, :, 1], k[:, :, 17:], v[:, :, 17:], pooled=pooled, variant=variant, **decode)
    out_given = ops.decode_attention(q[:, :, 1], k[:, :, 17:], v[:, :, 17:], pooled=given, **variant.kwargs(),
                                     **decode)
    assert torch.equal(given, pooled) and all(torch.equal(a, b) for a, b in zip(out, out_given))
    # Every token's keys in pages of 4, in reverse page order: the paged op and macs_pool(block_table=) agree.
    pages = k.transpose(1, 2).reshape(2, 23, KV_HEADS, DIM)
    pages = torch.cat([pages, pages.new_zeros(2, 1, KV_HEADS, DIM)], dim=1).reshape(12, 4, KV_HEADS, DIM)
    table = torch.arange(12).view(2, 6).flip(1)
    pages = pages[table.flatten().argsort()]
    paged = ops.macs_pool_paged(q, pages, table, window=5, softcap=3.0, sinks=sinks, **bounds)
    assert torch.equal(ops.macs_pool(q, pages, block_table=table, window=5, softcap=3.0, sinks=sinks, **bounds),
                       paged)
    assert torch.equal(ops.macs_pool_paged(q, pages, table, variant=Variant(window=5, softcap=3.0, sinks=sinks),
                                           **bounds), paged)
    torch.testing.assert_close(paged, ops.macs_pool(q, k, window=5, softcap=3.0, sinks=sinks, **bounds), rtol=0,
                               atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        ops.macs_pool(q, k, variant=variant, window=5, **bounds)
    with pytest.raises(ValueError, match="key_offset must be 0"):
        ops.macs_pool(q, pages, block_table=table, window=5, key_offset=3, **bounds)
