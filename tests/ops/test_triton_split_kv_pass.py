"""The triton backend's selectable fused passes (settings.TRITON_SPLIT_KV_PASSES): the switch, the launches each
pass makes, the error bound of the float16 relative scores ("two-launch", "one-launch"), and the one-launch pass's
workspace (arrival counters and pooled rows left as found). (Every per-op test of the fused ops runs under every
pass: tests/ops/conftest.py.)"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import registry
from tests.ops.cases import DEVICE, assert_relative_score_bound, row_ranges

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
    ("one-launch", {"_one_launch_kernel": 1}),
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


@pytest.mark.parametrize("name", ["two-launch", "one-launch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pooling", ["max", "min"])
def test_float16_relative_scores_keep_log_p_within_2_to_the_minus_11(dtype, pooling, name):
    settings.set_triton_split_kv_pass(name)
    assert_relative_score_bound(dtype, pooling, "triton")


@pytest.mark.parametrize("pooling", ["max", "min", "mean"])
def test_one_launch_leaves_its_workspace_as_found_and_agrees_with_verified(pooling):
    """The one-launch pass's arrival counters go back to 0 and its pooled rows to the pooling's identity after each
    launch, so calls of other shapes that follow (more rows, other widths, a given lse) see a clean workspace; a verify
    block of 8 rows at GQA 9:1 (72 rows: one query row's heads in two row tiles, pooled by two programs) equals the
    verified pass's m' and log c, call after call."""
    from macs_kernels.ops.triton import split_kv

    def calls():
        results = []
        generator = torch.Generator().manual_seed(3)
        q = torch.randn(2, 18, 8, 32, generator=generator).to(DEVICE)
        k = torch.randn(2, 2, 150, 32, generator=generator).to(DEVICE)
        ranges = dict(input_start=torch.tensor([[0] * 8, [3] * 8], device=DEVICE),
                      input_end=torch.tensor([[130 + r for r in range(8)], [120] * 8], device=DEVICE),
                      kv_len=torch.tensor([[138 + r for r in range(8)], [128 + r for r in range(8)]], device=DEVICE))
        out = torch.full((2, 8, 140), 7.0, device=DEVICE)
        ops.macs_pool(q, k, out=out, scale=0.2, pooling=pooling, backend="triton", **ranges)
        results.append(out)
        q1 = q[:, :, 0].contiguous()
        lse = torch.logsumexp(torch.einsum("bhd,bhsd->bhs", q1, k.repeat_interleave(9, 1)[:, :, :140]) * 0.2, -1)
        for given in (None, lse):
            log_c = torch.full((2, 130), -0.5, device=DEVICE)
            # Contiguous ranges: the triton launchers read all three with input_start's strides.
            ops.macs_update(q1, k, log_c, input_start=ranges["input_start"][:, 0].contiguous(),
                            input_end=ranges["input_end"][:, 0].contiguous(),
                            kv_len=torch.full((2,), 140, device=DEVICE), scale=0.2, pooling=pooling, lse=given,
                            backend="triton")
            results.append(log_c)
        return results

    settings.set_triton_split_kv_pass("verified")
    want = calls()
    settings.set_triton_split_kv_pass("one-launch")
    for _ in range(2):
        got = calls()
        for value, expected in zip(got, want):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        identity = float("inf") if pooling == "min" else 0.0
        for (_, _, kind), (counters, pooled) in split_kv._WORKSPACES.items():
            if kind == identity:
                assert int(counters.abs().sum()) == 0
                assert bool((pooled == identity).all())


@pytest.mark.parametrize("name", ["two-launch", "one-launch"])
@pytest.mark.parametrize("keys_a_step", [16, 32])
def test_relative_scores_hold_with_the_key_blocks_a_gpu_takes(monkeypatch, keys_a_step, name):
    """On a GPU the split kernels step 16 or 32 keys at D = 256 or 64 rows (common.split_kv_block; the interpreter
    steps 128): the relative scores' block maxima (one per BLOCK_N keys, read back at key // BLOCK_N) keep the bound."""
    from macs_kernels.ops.triton import common, split_kv

    plan = common.split_kv_tiles

    def gpu_keys(*args, **kwargs):
        tiles = plan(*args, **kwargs)
        blocks = common.cdiv(tiles.splits * tiles.split_size, keys_a_step)
        per_split = common.cdiv(blocks, tiles.splits)
        return common.SplitKV(tiles.block_m, keys_a_step, tiles.num_warps, common.cdiv(blocks, per_split),
                              per_split * keys_a_step)

    monkeypatch.setattr(split_kv, "split_kv_tiles", gpu_keys)
    settings.set_triton_split_kv_pass(name)
    assert_relative_score_bound(torch.bfloat16, "max", "triton")


@pytest.mark.parametrize("name", ["verified", "two-launch"])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_combine_reads_the_slices_a_chunk_at_a_time(monkeypatch, sinks, name):
    """The combine merges the slices SPLITS_CHUNK at a time (common.splits_chunk): the output's accumulators, and in the
    two-launch pass the pooling's (heads, slices) partials. 1 to 4 slices a chunk, over 5 slices with some empty, give
    the float64 reference's output, lse and m' (with sinks: the torch backend's in float64)."""
    from macs_kernels.ops import reference
    from macs_kernels.ops.triton import split_kv
    from macs_kernels.ops.triton.common import SplitKV
    from tests.tolerances import RELATIVE_ERROR, relative_error

    settings.set_triton_split_kv_pass(name)
    monkeypatch.setattr(split_kv, "split_kv_tiles", lambda *args, **kwargs: SplitKV(16, 128, 4, 5, 128))
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 64, generator=generator)
    k, v = torch.randn(2, 2, 2, 600, 64, generator=generator)
    # The second item's slices 0 and 1 attend nothing.
    kv_start, input_end, kv_len = torch.tensor([0, 300]), torch.tensor([590, 420]), torch.tensor([600, 431])
    # Two heads' sinks above every score of theirs: the merge's rescale by the sink takes effect.
    head_sinks = torch.randn(4, generator=generator) + torch.tensor([6.0, 0.0, 6.0, 0.0]) if sinks else None
    ranges = dict(kv_start=kv_start, kv_len=kv_len, input_end=input_end, scale=0.125)
    if sinks:
        want_pooled = torch.zeros(2, 590)
        want_out, want_lse = ops.decode_attention(q.double(), k.double(), v.double(), pooled=want_pooled,
                                                  sinks=head_sinks.double(), backend="torch", **ranges)
    else:
        want_out, want_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len,
                                                                  scale=0.125)
        want_pooled = reference.macs_pool_reference(q[:, :, None], k, input_start=kv_start[:, None],
                                                    input_end=input_end[:, None], kv_len=kv_len[:, None],
                                                    scale=0.125)[:, 0]
    for chunk in (1, 2, 4):
        monkeypatch.setattr(split_kv, "splits_chunk", lambda splits, width, chunk=chunk: chunk)
        pooled = torch.zeros(2, 590, device=DEVICE)
        out, lse = ops.decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pooled=pooled, sinks=head_sinks,
                                        backend="triton", **{key: value.to(DEVICE) if torch.is_tensor(value) else value
                                                             for key, value in ranges.items()})
        assert relative_error(out, want_out) < RELATIVE_ERROR[torch.float32], chunk
        assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32], chunk
        for b, n in enumerate((590, 120)):
            assert relative_error(pooled[b, :n], want_pooled[b, :n]) < RELATIVE_ERROR[torch.float32], (chunk, b)
