"""Triton's interpreter runs a launch's programs one after another in grid order; a GPU runs them in any order, and
at once. The triton backend's kernels give the same bits with the programs run reversed and shuffled: no program
waits on, or overwrites, another's results by position in the grid. (The cuda backend's blocks:
tests/ops/test_cuda_emulation.py.) Skips where Triton does not run in its interpreter."""
from __future__ import annotations

import contextlib
import itertools
import random
from unittest import mock

import pytest
import torch

from tests.ops.cases import NEEDS_TRITON_INTERPRETER, every_op_results, many_programs, uninitialized_memory_poisoned

pytest.importorskip("triton")

pytestmark = NEEDS_TRITON_INTERPRETER


@contextlib.contextmanager
def programs_run(order: str, seed: int = 0):
    """Triton's interpreter runs each launch's programs in `order` ("reverse", or "shuffled" anew per launch): the
    program it starts at grid index (x, y, z) gets that index's place in a permutation of the grid."""
    from triton.runtime.interpreter import interpreter_builder

    set_dim, set_index = interpreter_builder.set_grid_dim, interpreter_builder.set_grid_idx
    shuffle = random.Random(seed)
    permutation = []

    def set_grid_dim(nx, ny, nz):
        permutation[:] = itertools.product(range(nx), range(ny), range(nz))
        if order == "reverse":
            permutation.reverse()
        else:
            shuffle.shuffle(permutation)
        set_dim(nx, ny, nz)

    def set_grid_idx(x, y, z):
        _, ny, nz = interpreter_builder.grid_dim
        set_index(*permutation[(x * ny + y) * nz + z])

    with mock.patch.object(interpreter_builder, "set_grid_dim", set_grid_dim), \
            mock.patch.object(interpreter_builder, "set_grid_idx", set_grid_idx):
        yield


# float32 only: which program writes where does not depend on the dtype (the interpreter takes about 10 s a run).
def test_triton_results_do_not_depend_on_the_order_programs_run_in(dtype=torch.float32):
    with many_programs(), uninitialized_memory_poisoned():
        expected = every_op_results(dtype, "triton")
    for order, seed in (("reverse", 0), ("shuffled", 1), ("shuffled", 2)):
        with many_programs(), programs_run(order, seed), uninitialized_memory_poisoned():
            got = every_op_results(dtype, "triton")
        for want, result in zip(expected, got, strict=True):
            assert torch.equal(want, result), f"{order} (seed {seed}) changed a result: programs race"


def test_the_order_is_the_one_asked_for():
    """The permutation reaches the interpreter: a kernel that records its program ids sees them reversed."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(out_ptr, counter_ptr):
        slot = tl.atomic_add(counter_ptr, 1)
        tl.store(out_ptr + slot, tl.program_id(0))

    out, counter = torch.zeros(5, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with programs_run("reverse"):
        record[(5,)](out, counter)
    assert out.tolist() == [4, 3, 2, 1, 0]


def test_a_dependent_launch_waits_before_it_touches_what_the_kernels_before_it_write():
    """On an sm_90 GPU with dependent launches (MACS_KERNELS_TRITON_PDL=1) the combine and the head pooling start while
    the kernels before them run, and what a program reads before its wait (gdc_wait) races with them; the interpreter
    runs each grid after the last has ended, which hides such a read. Under traffic.triton_dependent_accesses every
    access a program makes before its wait is marked: no dependent touches early a byte that a kernel before it writes,
    nor writes early one that kernel reads, in any op that reads the cache (as test_cuda_emulation.py checks the cuda
    kernels). With the waits marking nothing, the fused decode's dependents are found."""
    from macs_kernels.apps.bench.traffic import triton_dependent_accesses
    from tests.ops.cases import key_reading_calls

    calls = key_reading_calls(torch.float32, "triton")
    for call in calls:
        call.call()  # the process's first call runs the backend's self-check
        with triton_dependent_accesses() as recorded:
            call.call()
        assert any(dependent for _, dependent in recorded.launches), (call.name, recorded.launches)
        assert any(early for *_, early, _ in recorded.accesses), call.name
        assert recorded.hazards() == [], call.name
    [fused] = [call for call in calls if call.name == "decode_attention with log_c"]
    with triton_dependent_accesses(waits=False) as recorded:
        fused.call()
    found = recorded.hazards()
    for dependent in ("_split_kv_combine_kernel", "_pool_kernel"):
        assert any(hazard.startswith(dependent + " ") for hazard in found), found
