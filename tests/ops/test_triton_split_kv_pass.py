"""The triton backend's selectable fused passes (settings.TRITON_SPLIT_KV_PASSES): the switch, the launches each
pass makes, and the error bound of the "two-launch" pass's float16 relative scores. (Every per-op test of the
fused ops runs under both passes: tests/ops/conftest.py.)"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference, registry
from tests.ops.cases import DEVICE, row_ranges

pytest.importorskip("triton")
from macs_kernels.ops.triton import settings  # noqa: E402 - after the skip: it imports triton

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.skipif(registry.why_unavailable("triton", DEVICE) is not None, reason="triton cannot run here"),
]


def test_unknown_pass_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown triton split-KV pass 'three'.*'verified', 'two-launch'"):
        settings.set_triton_split_kv_pass("three")


def test_the_environment_chooses_the_pass_at_first_use(monkeypatch):
    monkeypatch.setattr(settings, "_triton_split_kv_pass", None)
    monkeypatch.setenv("MACS_KERNELS_TRITON_SPLIT_KV", "two-launch")
    assert settings.triton_split_kv_pass() == "two-launch"
    monkeypatch.setattr(settings, "_triton_split_kv_pass", None)
    monkeypatch.delenv("MACS_KERNELS_TRITON_SPLIT_KV")
    assert settings.triton_split_kv_pass() == "verified"
    monkeypatch.setattr(settings, "_triton_split_kv_pass", None)
    monkeypatch.setenv("MACS_KERNELS_TRITON_SPLIT_KV", "fast")
    with pytest.raises(ValueError, match="unknown triton split-KV pass 'fast'"):
        settings.triton_split_kv_pass()


@pytest.mark.parametrize(("name", "kernels"), [
    ("verified", {"_split_kv_kernel": 1, "_split_kv_combine_kernel": 1, "_pool_kernel": 1}),
    ("two-launch", {"_split_kv_kernel": 1, "_combine_pool_kernel": 1}),
])
def test_launches_of_a_fused_decode(name, kernels):
    from macs_kernels.ops.triton import LAUNCHES

    settings.set_triton_split_kv_pass(name)
    q = torch.randn(2, 8, 64, device=DEVICE)
    k, v = (torch.randn(2, 2, 113, 64, device=DEVICE) for _ in range(2))
    kv_start, input_end, kv_len = row_ranges(113, 2)
    log_c = torch.zeros(2, 113, device=DEVICE)
    before = LAUNCHES.copy()
    ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.125, log_c=log_c, input_end=input_end,
                         backend="triton")
    assert dict(LAUNCHES - before) == kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pooling", ["max", "min"])
def test_float16_relative_scores_keep_log_p_within_2_to_the_minus_11(dtype, pooling):
    """alpha = 1 without redistribution adds log m' itself, the pooled log p: the two-launch pass stores s - m (m the
    running max, at most lse) in float16, so each entry's increment is within 2^-11 of its size (plus float32
    rounding), over scores spread across +-30 where float16 absolute scores would not be."""
    settings.set_triton_split_kv_pass("two-launch")
    q = (torch.randn(1, 8, 64) * 12).to(dtype).to(DEVICE)
    k = torch.randn(1, 2, 300, 64).to(dtype).to(DEVICE)
    input_start, input_end, kv_len = (torch.tensor([value], device=DEVICE) for value in (5, 290, 300))
    log_c = torch.zeros(1, 285, device=DEVICE)
    options = dict(input_start=input_start, input_end=input_end, kv_len=kv_len, scale=0.125, alpha=1.0,
                   pooling=pooling, redistribute=False)
    want = reference.macs_update_reference(q, k, log_c, **options)
    ops.macs_update(q, k, log_c, backend="triton", **options)
    got = log_c.cpu().double()
    assert want.abs().max() > 20  # log p spans a range that float16 absolute scores would round coarsely
    bound = 2.0 ** -11 * want.abs() + 1e-5 * (1 + want.abs())
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
