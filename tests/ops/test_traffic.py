"""The bytes the triton backend's kernels move, counted access by access in Triton's interpreter
(apps/bench/traffic.py): each op's split pass reads each attended key (and value) row once,
in whole sectors, and nothing outside its arguments; a fused MACS pass writes each input key's score once, in
float32, and reads each back once. (The cuda backend's copies: tests/ops/test_cuda_emulation.py;
the bytes at issue 48's shapes: benchmarks/bench_traffic.py.)"""
from __future__ import annotations

import pytest
import torch

from tests.ops.cases import NEEDS_TRITON_INTERPRETER, key_reading_calls, many_programs

pytest.importorskip("triton")
from macs_kernels.apps.bench.traffic import OUTSIDE, Traffic, triton_traffic  # noqa: E402

pytestmark = NEEDS_TRITON_INTERPRETER


def traffic_of(call) -> Traffic:
    call()  # the first call of the process runs the backend's self-check
    with many_programs(), triton_traffic() as traffic:  # key slices meet: a slice reading past its own shows
        call()
    return traffic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_attended_key_is_read_once_and_each_score_written_and_read_once(dtype):
    for case in key_reading_calls(dtype, "triton"):
        traffic = traffic_of(case.call)
        assert not any(argument == OUTSIDE for _, argument in traffic.counts), \
            f"{case.name}: an access outside every argument of its kernel"
        for argument in case.cache:
            read = traffic.of(argument, "_split_kv_kernel")
            assert (read.read, read.read_distinct, read.read_sectors) == (case.attended,) * 3, \
                f"{case.name}: {argument} read {read} for {case.attended} attended bytes"
        if not case.score_columns:
            continue
        scores = traffic.of("scores")
        expected = case.score_columns * 4
        # No column twice: the inputs' and those beside them in their rows that their key blocks reach (a block's
        # columns start 64-byte aligned and store whole: ops/triton/split_kv.py; where each goes:
        # test_triton_split_kv_pass.py).
        assert scores.written == scores.written_distinct >= expected, f"{case.name}: {scores}"
        # The scores come back once, as the pooling kernel's `values`: whole rows, 16-byte vectors.
        values = traffic.of("values")
        read_back = scores.read_distinct + values.read_distinct
        assert scores.read + values.read == read_back >= expected, f"{case.name}: {read_back} score bytes read back"


def test_the_counts_are_the_accesses_made():
    """A kernel that reads a row twice and writes half of another: the counts say so, sectors included."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_twice(source_ptr, target_ptr):
        columns = tl.arange(0, 16)
        first = tl.load(source_ptr + columns)
        again = tl.load(source_ptr + columns)
        tl.store(target_ptr + columns * 2, first + again, mask=columns < 8)

    source, target = torch.arange(16, dtype=torch.float32), torch.zeros(32)
    with triton_traffic() as traffic:
        copy_twice[(1,)](source, target)
    read, written = traffic.of("source"), traffic.of("target")
    assert (read.read, read.read_distinct, read.read_sectors) == (128, 64, 128)
    # Eight floats two apart: 60 bytes of span, two 32-byte sectors for 32 bytes written.
    assert (written.written, written.written_distinct, written.written_sectors) == (32, 32, 64)
    assert torch.equal(target[:16:2], 2 * source[:8])


def test_each_address_counts_for_the_arguments_whose_elements_it_is():
    """K and V interleaved in one packed cache, and a view inside another argument: an access counts for the
    tensors it is an element of, not for the nearest start."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_rows(k_ptr, v_ptr, out_ptr, stride, N: tl.constexpr, D: tl.constexpr):
        rows, columns = tl.arange(0, N)[:, None], tl.arange(0, D)[None, :]
        tl.store(out_ptr + rows * D + columns, tl.load(k_ptr + rows * stride + columns))

    packed = torch.randn(4, 2, 8)  # (S, 2, D): each key's K row, then its V row
    k, v, out = packed[:, 0], packed[:, 1], torch.zeros(4, 8)
    with triton_traffic() as traffic:
        read_rows[(1,)](k, v, out, 16, N=4, D=8)
    assert (traffic.of("k").read, traffic.of("v").read) == (128, 0) and torch.equal(out, k)

    whole = torch.randn(4, 8)
    with triton_traffic() as traffic:
        read_rows[(1,)](whole, whole[1:3], out, 8, N=4, D=8)
    assert set(traffic.counts) == {("read_rows", "k"), ("read_rows", "k=v"), ("read_rows", "out")}
    assert (traffic.of("k").read, traffic.of("v").read, traffic.of(OUTSIDE).read) == (128, 64, 0)
