"""The triton backend's fused pass: the launches it makes, the key blocks a GPU steps and the combine's chunks, against
the float64 references. (Two passes with fewer launches were slower on an H200 and are gone: ops/triton/split_kv.py.)"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference, registry
from tests.ops.cases import DEVICE, row_ranges
from tests.tolerances import RELATIVE_ERROR, relative_error

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.skipif(registry.why_unavailable("triton", DEVICE) is not None, reason="triton cannot run here"),
]


def test_launches_of_a_fused_decode():
    from macs_kernels.ops.triton import LAUNCHES

    q = torch.randn(2, 8, 64, device=DEVICE)
    k, v = (torch.randn(2, 2, 113, 64, device=DEVICE) for _ in range(2))
    kv_start, input_end, kv_len = row_ranges(113, 2)
    log_c = torch.zeros(2, 113, device=DEVICE)
    before = LAUNCHES.copy()
    ops.decode_attention(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.125, log_c=log_c, input_end=input_end,
                         backend="triton")
    assert dict(LAUNCHES - before) == {"_split_kv_kernel": 1, "_split_kv_combine_kernel": 1, "_pool_kernel": 1}


def test_the_split_plan_puts_at_most_two_programs_on_an_sm(monkeypatch):
    """split_kv_tiles on an H200's 132 SMs: issue 48's shapes (bf16, 32/8 heads) get up to twice the SMs' programs,
    rounded down, whole key blocks a slice. Rounded up, 8 x 32k keys got 320 (2 or 3 an SM), and its fused pass took
    1.31x the time of 256 (ops_issue48_h200_64cce54.csv, triton-waves-of-2)."""
    from macs_kernels.ops.triton import common

    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(common, "multiprocessors", lambda device: 132)
    programs = {}
    for batch, keys, dim in ((1, 4096, 128), (1, 32768, 128), (1, 131072, 128), (8, 32768, 128), (1, 32768, 64),
                             (64, 32768, 128)):
        tiles = common.split_kv_tiles(batch, 8, 4, keys, dim, False, torch.device("cpu"))
        assert tiles.splits * tiles.split_size >= keys > (tiles.splits - 1) * tiles.split_size
        assert tiles.split_size % tiles.block_n == 0
        programs[batch, keys, dim] = batch * 8 * tiles.splits
    assert list(programs.values()) == [256, 256, 264, 256, 256, 512]  # 512 row tiles: one slice each


@pytest.mark.parametrize("keys_a_step", [16, 32])
def test_the_fused_decode_holds_with_the_key_blocks_a_gpu_takes(monkeypatch, keys_a_step):
    """On a GPU the split kernel steps 16 or 32 keys at D = 256, in float32 or with 64 rows (common.split_kv_block; the
    interpreter steps 128): out, lse and the log c update over ragged ranges against float64."""
    from macs_kernels.ops.triton import common, split_kv

    plan = common.split_kv_tiles

    def gpu_keys(*args, **kwargs):
        tiles = plan(*args, **kwargs)
        blocks = common.cdiv(tiles.splits * tiles.split_size, keys_a_step)
        per_split = common.cdiv(blocks, tiles.splits)
        return common.SplitKV(tiles.block_m, keys_a_step, tiles.num_warps, common.cdiv(blocks, per_split),
                              per_split * keys_a_step)

    monkeypatch.setattr(split_kv, "split_kv_tiles", gpu_keys)
    generator = torch.Generator().manual_seed(keys_a_step)
    q = torch.randn(2, 6, 64, generator=generator)
    k, v = torch.randn(2, 2, 2, 301, 64, generator=generator)
    kv_start, input_end, kv_len = torch.tensor([0, 37]), torch.tensor([290, 203]), torch.tensor([301, 219])
    start_log_c = -torch.rand(2, 290, generator=generator)
    log_c = start_log_c.to(DEVICE, copy=True)
    out, lse = ops.decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_start=kv_start.to(DEVICE),
                                    kv_len=kv_len.to(DEVICE), input_end=input_end.to(DEVICE), scale=0.125,
                                    log_c=log_c, backend="triton")
    want_out, want_lse = reference.decode_attention_reference(q, k, v, kv_start=kv_start, kv_len=kv_len, scale=0.125)
    want_log_c = reference.macs_update_reference(q, k, start_log_c.double(), input_start=kv_start,
                                                 input_end=input_end, kv_len=kv_len, scale=0.125)
    assert relative_error(out, want_out) < RELATIVE_ERROR[torch.float32]
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    for b, n in enumerate((290, 166)):
        assert relative_error(log_c[b, :n], want_log_c[b, :n]) < RELATIVE_ERROR[torch.float32], b


@pytest.mark.parametrize("sinks", [False, True])
def test_the_combine_reads_the_slices_a_chunk_at_a_time(monkeypatch, sinks):
    """The combine sums the slices' accumulators SPLITS_CHUNK at a time (common.splits_chunk): 1 to 4 slices a chunk,
    over 5 slices with some empty, give the float64 reference's output, lse and m' (with sinks: the torch backend's in
    float64)."""
    from macs_kernels.ops.triton import split_kv
    from macs_kernels.ops.triton.common import SplitKV

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
        monkeypatch.setattr(split_kv, "splits_chunk", lambda splits, dim, chunk=chunk: chunk)
        pooled = torch.zeros(2, 590, device=DEVICE)
        out, lse = ops.decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pooled=pooled, sinks=head_sinks,
                                        backend="triton", **{key: value.to(DEVICE) if torch.is_tensor(value) else value
                                                             for key, value in ranges.items()})
        assert relative_error(out, want_out) < RELATIVE_ERROR[torch.float32], chunk
        assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32], chunk
        for b, n in enumerate((590, 120)):
            assert relative_error(pooled[b, :n], want_pooled[b, :n]) < RELATIVE_ERROR[torch.float32], (chunk, b)


@pytest.mark.parametrize("keys_a_step", [16, 64])
def test_score_rows_hold_input_i_in_column_i_plus_the_start_mod_16(monkeypatch, keys_a_step):
    """split_kv_pass's scores: row (b, h, r) holds input key s + i's score in column i + s % 16, s its score start, and
    the fused pass's log c update reads them there: starts of every residue mod 16, a window's score start before slot
    0, a verify block whose two rows start apart, in slices that start at a whole key block below their first row's
    start as on a GPU (the tensor-core path, which the interpreter otherwise never takes), against float64."""
    from macs_kernels.ops.triton import common, split_kv

    plan = common.split_kv_tiles

    def gpu_keys(*args, **kwargs):
        tiles = plan(*args, **kwargs)
        per_split = common.cdiv(common.cdiv(tiles.splits * tiles.split_size, keys_a_step), 3)
        return common.SplitKV(16, keys_a_step, 4, 3, per_split * keys_a_step)

    monkeypatch.setattr(split_kv, "split_kv_tiles", gpu_keys)
    monkeypatch.setattr(split_kv, "dot_in_f32", lambda *tensors: False)
    generator = torch.Generator().manual_seed(keys_a_step)
    batch, heads, kv_heads, rows, keys, dim, n_scores = 17, 4, 2, 2, 157, 32, 120
    q = torch.randn(batch, heads, rows, dim, generator=generator)
    k, v = torch.randn(2, batch, kv_heads, keys, dim, generator=generator)
    start = torch.stack([torch.arange(batch), torch.arange(batch) + 5], 1)  # every residue; rows 5 apart
    input_end = start + 100
    score_start = start.clone()
    score_start[-1] = start[-1] - 35  # a window whose first inputs slid out before slot 0: -19, -14
    input_end[-1] = start[-1] + 80  # 115 inputs, within n_scores
    kv_len = input_end + 20
    _, _, _, scores = split_kv.split_kv_pass(q, k, v, start, input_end, kv_len, 0.125, n_scores,
                                             score_start=score_start)
    assert scores.shape == (batch, heads, rows, split_kv.score_columns(n_scores))
    want = torch.einsum("bhrd,bhsd->bhrs", q.double(), k.double().repeat_interleave(heads // kv_heads, 1)) * 0.125
    for b in range(batch):
        for r in range(rows):
            first, end = int(score_start[b, r]), int(input_end[b, r])
            column = first % 16
            attended = torch.arange(first, end) >= start[b, r]
            row = scores[b, :, r, column:column + end - first]
            assert relative_error(row[:, attended], want[b, :, r, int(start[b, r]):end]) < RELATIVE_ERROR[torch.float32]
            # A window's inputs that slid out weigh nothing in the pooling.
            assert torch.equal(row[:, ~attended], torch.full_like(row[:, ~attended], float("-inf"))), (b, r)
    start_log_c = -torch.rand(batch, n_scores, generator=generator)
    log_c = start_log_c.clone()
    ops.decode_attention(q[:, :, 0], k, v, kv_start=start[:, 0], kv_len=kv_len[:, 0], input_end=input_end[:, 0],
                         scale=0.125, log_c=log_c, backend="triton")
    want_log_c = reference.macs_update_reference(q[:, :, 0], k, start_log_c.double(), input_start=start[:, 0],
                                                 input_end=input_end[:, 0], kv_len=kv_len[:, 0], scale=0.125)
    assert relative_error(log_c[:, :100], want_log_c[:, :100]) < RELATIVE_ERROR[torch.float32]


def test_score_columns_no_key_block_reached_weigh_nothing(monkeypatch):
    """The pool reads whole score rows, among them columns that no key block wrote (before a row's start, past its
    inputs): whatever the workspace held there, here 3e38 (whose exp overflows) and NaN, weighs nothing and raises no
    warning (the backend's self-check counts a warning as a failure). log c against float64."""
    import warnings

    from macs_kernels.ops.triton import split_kv

    empty = torch.empty

    def dirty(*size, **kwargs):
        tensor = empty(*size, **kwargs)
        if tensor.is_floating_point():
            tensor.view(-1)[0::2], tensor.view(-1)[1::2] = 3e38, float("nan")
        return tensor

    monkeypatch.setattr(split_kv.torch, "empty", dirty)
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 64, generator=generator)
    k = torch.randn(2, 2, 150, 64, generator=generator)
    start, input_end, kv_len = torch.tensor([5, 21]), torch.tensor([120, 90]), torch.tensor([150, 130])
    start_log_c = -torch.rand(2, 115, generator=generator)
    log_c = start_log_c.to(DEVICE, copy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.macs_update(q.to(DEVICE), k.to(DEVICE), log_c, input_start=start.to(DEVICE), input_end=input_end.to(DEVICE),
                        kv_len=kv_len.to(DEVICE), scale=0.125, backend="triton")
    want = reference.macs_update_reference(q, k, start_log_c.double(), input_start=start, input_end=input_end,
                                           kv_len=kv_len, scale=0.125)
    for b, n in enumerate((115, 69)):
        assert relative_error(log_c[b, :n], want[b, :n]) < RELATIVE_ERROR[torch.float32], b
