"""The emulation of the cuda backend (MACS_KERNELS_CUDA_EMULATION=1, ops/cuda/emulation.py) as a race detector: a
launch's blocks run one after another, and a block's threads as fibers one after another between two barriers, so a
result that changes when they run in another order (reverse, shuffled each time) is a race, in any kernel of csrc/:
threads that no barrier orders, or blocks that write one place. Every op's kernels, with inputs that each split kernel
serves, give the same bits in every order. And the launchers' choice on other GPUs (the emulation answers their
device queries as DEVICES says). Skips without the emulation."""
from __future__ import annotations

import contextlib

import pytest
import torch

from macs_kernels import ops
from tests.ops.cases import (
    CUDA_BACKEND_DEVICE,
    CUDA_SPLIT_KERNEL_CASES,
    CUDA_SPLIT_KERNEL_NAMES,
    CUDA_SPLIT_KERNEL_SHAPES,
    MMA_BLOCKS_BY_REGISTERS,
    MMA_THREADS,
    NEEDS_CUDA_EMULATION,
    RELATIVE_SCORE_PASSES,
    every_op_results,
    key_reading_calls,
    launched_kernels,
    score_bytes,
    uninitialized_memory_poisoned,
)

pytestmark = NEEDS_CUDA_EMULATION


@contextlib.contextmanager
def emulated(device: str):
    """The emulated GPU `device` (emulation.DEVICES), an H200 after."""
    from macs_kernels.ops.cuda import emulation

    emulation.set_device(device)
    try:
        yield
    finally:
        emulation.set_device("H200")


def launches_of(call):
    """The launches of one `call`, after a first one (the first call of the process runs the backend's self-check)."""
    from macs_kernels.ops.cuda import emulation

    call()
    emulation.take_launches()
    call()
    return emulation.take_launches()


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
def test_cuda_results_do_not_depend_on_the_order_blocks_and_threads_run_in(kernel, dtype, dim):
    from macs_kernels.ops.cuda import emulation

    # "4 SMs": few splits of many tiles, so that every kernel's tile loop goes round.
    with emulated("4 SMs"), uninitialized_memory_poisoned():  # the launchers' scratch too
        try:
            launches = launches_of(lambda: every_op_results(dtype, "cuda", dim))
            split = {launch.name for launch in launches if "split_kernel<" in launch.name}
            assert split and all(CUDA_SPLIT_KERNEL_NAMES[kernel] in name for name in split), split
            expected = every_op_results(dtype, "cuda", dim)
            for order, seed in (("reverse", 0), ("shuffled", 1), ("shuffled", 2)):
                emulation.set_run_order(order, seed)
                for want, got in zip(expected, every_op_results(dtype, "cuda", dim), strict=True):
                    assert torch.equal(want, got), f"{order} (seed {seed}) changed a result: a race"
        finally:
            emulation.set_run_order("forward")


@pytest.mark.parametrize("device, expected", [("H200", "mma_split_kernel<"), ("A100", "mma_split_kernel<"),
                                              ("T4", "pipelined_split_kernel<")])
def test_the_tensor_core_kernel_is_chosen_only_from_sm_80(device, expected):
    """mma.sync.m16n8k16 and ldmatrix need sm_80: on a T4 (7.5) the tensor-core kernel's shapes run the pipelined
    kernel (its device code would trap there)."""
    q, k = torch.randn(1, 8, 64).bfloat16(), torch.randn(2, 1, 2, 100, 64).bfloat16()
    with emulated(device):
        launches = launches_of(
            lambda: ops.decode_attention(q, k[0], k[1], kv_len=torch.tensor([100]), scale=0.125, backend="cuda"))
    split = [launch.name for launch in launches if "split_kernel<" in launch.name]
    assert len(split) == 1 and expected in split[0], split


@pytest.mark.parametrize("dim, attention, update", [(128, "pipelined", "mma"), (64, "mma", "mma")])
def test_where_the_tensor_core_block_does_not_fit_the_pipelined_kernel_runs(dim, attention, update):
    """An L40 (sm_89, as sm_86) holds 99 KB of shared memory a block: the tensor-core kernel's block at D 128 with V
    (3 stages of 64 keys of K and V) needs more, so decode_attention runs the pipelined kernel on bf16 there, and
    macs_update (no V) the tensor-core one; both against float64."""
    from macs_kernels.ops import reference
    from tests.tolerances import RELATIVE_ERROR, relative_error

    generator = torch.Generator().manual_seed(dim)
    q = torch.randn(2, 8, dim, generator=generator).bfloat16()
    k, v = torch.randn(2, 2, 2, 700, dim, generator=generator).bfloat16()
    ranges = dict(kv_start=torch.tensor([0, 9]), kv_len=torch.tensor([700, 650]), scale=dim ** -0.5)
    inputs = dict(input_start=ranges["kv_start"], input_end=torch.tensor([690, 600]), kv_len=ranges["kv_len"],
                  scale=dim ** -0.5)
    start_log_c = -torch.rand(2, 690, generator=generator)
    log_c = start_log_c.clone()
    with emulated("L40"):
        attention_launches = launches_of(lambda: ops.decode_attention(q, k, v, backend="cuda", **ranges))
        out, lse = ops.decode_attention(q, k, v, backend="cuda", **ranges)
        update_launches = launches_of(lambda: ops.macs_update(q, k, torch.zeros(2, 690), backend="cuda", **inputs))
        ops.macs_update(q, k, log_c, backend="cuda", **inputs)
    for launches, kernel in ((attention_launches, attention), (update_launches, update)):
        split = [launch.name for launch in launches if "split_kernel<" in launch.name]
        assert len(split) == 1 and CUDA_SPLIT_KERNEL_NAMES[kernel] in split[0], split
    want_out, want_lse = reference.decode_attention_reference(q, k, v, **ranges)
    assert relative_error(out, want_out) < RELATIVE_ERROR[torch.bfloat16]
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    want_log_c = reference.macs_update_reference(q, k, start_log_c.double(), **inputs)
    for b, n in enumerate((690, 591)):
        assert relative_error(log_c[b, :n], want_log_c[b, :n]) < RELATIVE_ERROR[torch.bfloat16]


def test_a_setting_of_the_removed_split_kernel_switch_is_named():
    """MACS_KERNELS_CUDA_SPLIT_KV chose the split kernel until the choice went to the shape: loading the extension
    with it set warns that it is no longer read (csrc/bindings.cpp), once, and loads."""
    import os
    import subprocess
    import sys

    probe = ("import warnings; warnings.simplefilter('always')\n"
             "from macs_kernels.ops.cuda import emulation\n"
             "print('loaded', emulation.library.__name__)")
    for value, warned in (("verified", True), (None, False)):
        environment = {k: v for k, v in os.environ.items() if k != "MACS_KERNELS_CUDA_SPLIT_KV"}
        if value is not None:
            environment["MACS_KERNELS_CUDA_SPLIT_KV"] = value
        run = subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0 and "loaded" in run.stdout, run.stderr[-2000:]
        assert run.stderr.count("MACS_KERNELS_CUDA_SPLIT_KV is no longer read") == int(warned), run.stderr[-2000:]


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
def test_dependent_launches_make_the_combine_and_the_pooling_dependents_and_change_no_result(kernel, dtype, dim):
    """With dependent launches on (ops.cuda.dependent_launches, MACS_KERNELS_CUDA_PDL=1) each op's split pass launches
    its combine, and the head pooling right after it, as programmatic dependents of the kernel before, and nothing
    else: not the split kernel (it follows the caller's own kernels), nor a pooling of given rows (macs_update_rows:
    it follows its own mass kernel). Every launch and result stays as plain launches make them."""
    from macs_kernels.ops.cuda import dependent_launches

    plain = launches_of(lambda: every_op_results(dtype, "cuda", dim))
    expected = every_op_results(dtype, "cuda", dim)
    with dependent_launches():
        dependent = launches_of(lambda: every_op_results(dtype, "cuda", dim))
        got = every_op_results(dtype, "cuda", dim)
    assert [launch.name for launch in dependent] == [launch.name for launch in plain]
    assert not any(launch.dependent for launch in plain)
    wanted = [("combine_kernel<" in launch.name
               or ("pool_kernel<" in launch.name and "combine_kernel<" in before.name))
              for before, launch in zip([plain[0], *plain], plain)]
    assert [launch.dependent for launch in dependent] == wanted
    kinds = {name for launch in dependent if launch.dependent for name in ("combine", "pool") if name in launch.name}
    assert kinds == {"combine", "pool"}, kinds
    for want, result in zip(expected, got, strict=True):
        assert torch.equal(want, result)


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
def test_a_dependent_launch_waits_before_it_touches_what_the_kernels_before_it_write(kernel, dtype, dim):
    """On a GPU a programmatic dependent (the combine after the split kernel, the head pooling after the combine) runs
    its code before wait_for_prior_grid while the kernels before it still run, and a read there of what they write is
    a race that no CPU run of the grids one after another shows. The emulation marks each access made before the wait:
    none of the split passes' dependents touches before its wait a byte the kernels before it write, nor writes one
    they read (traffic.cuda_dependent_hazards; every op that reads the cache, on inputs of each split kernel)."""
    from macs_kernels.apps.bench.traffic import cuda_dependent_hazards
    from macs_kernels.ops.cuda import dependent_launches, emulation

    for call in key_reading_calls(dtype, "cuda", D=dim):
        with dependent_launches():
            call.call()  # the process's first call runs the self-check
            emulation.take_launches()
            emulation.count_accesses([(t.data_ptr(), t.data_ptr() + t.nbytes) for t in call.cache.values()])
            try:
                call.call()
                accesses = emulation.counted_accesses()
            finally:
                emulation.count_accesses(None)
        launches = emulation.take_launches()
        assert any(launch.dependent for launch in launches), (call.name, launches)
        early = accesses.records[accesses.records["before_wait"] == 1]
        assert len(early) < len(accesses.records), call.name  # the dependents' waits were seen
        assert cuda_dependent_hazards(accesses, launches) == [], call.name


def test_launches_without_their_kernels_are_checked_and_logged():
    """set_execute(False) (benchmarks/bench_checks.py's host path to the launch): each launch is checked and logged,
    and no kernel runs."""
    from macs_kernels.ops.cuda import emulation

    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 100, 64)
    ranges = dict(input_start=torch.tensor([0]), input_end=torch.tensor([90]), kv_len=torch.tensor([100]),
                  scale=0.125, backend="cuda")
    ops.macs_pool(q, k, out=torch.zeros(1, 90), **ranges)  # the self-check of the first call of the process
    emulation.take_launches()
    emulation.set_execute(False)
    try:
        untouched = torch.full((1, 90), 7.0)
        ops.macs_pool(q, k, out=untouched, **ranges)
    finally:
        emulation.set_execute(True)
    names = [launch.name for launch in emulation.take_launches()]
    assert bool((untouched == 7.0).all()) and any("split_kernel<" in name for name in names), names
    written = torch.full((1, 90), 7.0)
    ops.macs_pool(q, k, out=written, **ranges)
    assert [launch.name for launch in emulation.take_launches()] == names and not bool((written == 7.0).any())


def test_a_kernels_dynamic_shared_memory_is_granted_once_and_never_lowered():
    """A split kernel whose block takes over 48 KiB of shared memory is granted it by the runtime (cudaFuncSetAttribute)
    once per size it grows to (csrc/common.cuh, allow_dynamic_shared): later launches of that size or a smaller one
    ask nothing (each ask is a driver call), and a smaller one never lowers the grant (one thread lowering it between
    another's grant and launch would fail that launch). macs_pool's tensor-core kernel without V at D 128, one query
    row a block and then four (GQA 4:1): two sizes above 48 KiB of one instantiation."""
    from macs_kernels.ops.cuda import emulation

    generator = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 300, 128, generator=generator).bfloat16()

    def pool(rows):
        q = torch.randn(1, 4, rows, 128, generator=generator).bfloat16()
        ops.macs_pool(q, k, input_start=0, input_end=torch.full((1, rows), 250), kv_len=torch.full((1, rows), 300),
                      scale=128 ** -0.5, out=torch.zeros(1, rows, 250), backend="cuda")

    pool(4)  # the larger block first: its grant, if no earlier launch made it (and the process's self-check)
    emulation.take_launches()
    emulation.take_shared_grants()
    emulation.set_execute(False)  # each launch is still checked against its kernel's grant
    try:
        for rows in (1, 4, 1, 4):
            pool(rows)
    finally:
        emulation.set_execute(True)
    sizes = [launch.shared_bytes for launch in emulation.take_launches() if "mma_split_kernel<" in launch.name]
    assert len(sizes) == 4 and sizes[0] < sizes[1] and min(sizes) > 48 * 1024, sizes
    assert emulation.take_shared_grants() == []


@pytest.mark.parametrize("device", ["H200", "A100"])
@pytest.mark.parametrize("dim, with_v", list(MMA_BLOCKS_BY_REGISTERS))
def test_the_tensor_core_kernel_fills_one_wave_of_the_blocks_a_multiprocessor_holds(device, dim, with_v):
    """mma_policy splits the keys into as many blocks as the GPU holds at once (its shared memory, its threads, the
    registers ptxas gives the instantiation): more would run a nearly empty second wave, fewer would leave
    multiprocessors idle. Issue 48's shape: 32 query heads on 8 KV heads, one query row, enough keys for every split."""
    from macs_kernels.ops.cuda import emulation

    batch, heads, kv_heads, keys = 1, 32, 8, 5300
    multiprocessors, _, shared_per_multiprocessor, _ = emulation.DEVICES[device]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, dim, generator=generator).bfloat16()
    k, v = torch.randn(2, batch, kv_heads, keys, dim, generator=generator).bfloat16()
    kv_len = torch.tensor([keys])

    def call():
        if with_v:
            ops.decode_attention(q, k, v, kv_len=kv_len, scale=dim ** -0.5, backend="cuda")
        else:
            ops.macs_update(q, k, torch.zeros(batch, keys), input_start=0, input_end=kv_len, kv_len=kv_len,
                            scale=dim ** -0.5, backend="cuda")

    with emulated(device):
        [launch] = [launch for launch in launches_of(call) if "mma_split_kernel<" in launch.name]
    assert launch.block == (MMA_THREADS, 1, 1) and f", {dim}, {str(with_v).lower()}>" in launch.name, launch
    resident = min(shared_per_multiprocessor // (launch.shared_bytes + 1024), 2048 // MMA_THREADS,
                   MMA_BLOCKS_BY_REGISTERS[dim, with_v])
    assert launch.grid == (resident * multiprocessors // (batch * kv_heads), kv_heads, batch), (launch, resident)


def _scores_along_the_keys(order: str, batch: int, heads: int, keys: int, dim: int, falling_heads: int = 0):
    """q (B, H, D) and K (B, 1, keys, D) in bf16 whose scores rise along the keys ("rising") or fall, for every head
    but the first `falling_heads`, whose scores go the other way: one direction plus noise, 30 q . k / |q| apart."""
    generator = torch.Generator().manual_seed(dim + heads)
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=generator), dim=0)
    sign = torch.ones(heads)
    sign[:falling_heads] = -1.0
    q = 30 * sign[:, None] * direction + 0.1 * torch.randn(batch, heads, dim, generator=generator)
    along = torch.linspace(-2.0, 2.0, keys) if order == "rising" else torch.linspace(2.0, -2.0, keys)
    k = along[:, None] * direction + 0.05 * torch.randn(batch, 1, keys, dim, generator=generator)
    return q.bfloat16(), k.bfloat16(), generator


@pytest.mark.parametrize("order", ["rising", "falling"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group, falling_heads", [(4, 0), (16, 8)], ids=["gqa4", "gqa16-mixed"])
def test_the_tensor_core_kernel_rescales_whenever_a_later_tile_raises_a_rows_max(order, dim, group, falling_heads):
    """mma_split_kernel rescales a warp's outputs only in tiles where the max of one of its 16 rows rose, and steps the
    generated keys' sums only in tiles holding some. On "4 SMs" each split holds several tiles: scores rising along
    the keys raise a row's max in every tile, falling ones only in the first. At GQA 4:1 12 of the 16 rows pad; at
    16:1 all are heads, rows 0-7 going the other way from rows 8-15. The last 10 and 16 keys are generated, beginning
    inside a warp's 16 keys (their share of a row counts when rising). out, lse, m' and the log c update against
    float64."""
    from macs_kernels.ops import reference
    from tests.tolerances import RELATIVE_ERROR, relative_error

    batch, keys = 2, 2000
    q, k, generator = _scores_along_the_keys(order, batch, group, keys, dim, falling_heads)
    v = torch.randn(batch, 1, keys, dim, generator=generator).bfloat16()
    start, end, length = [0, 3], [1990, 1979], [keys, keys - 5]  # the generated keys: the largest when rising
    ranges = dict(kv_start=start, kv_len=length, scale=dim ** -0.5)
    width = max(e - s for s, e in zip(start, end))
    start_log_c = -torch.rand(batch, width, generator=generator)
    log_c, pooled = start_log_c.clone(), torch.zeros(batch, width)
    with emulated("4 SMs"):
        [launch] = [launch for launch in launches_of(lambda: ops.decode_attention(q, k, v, backend="cuda", **ranges))
                    if "mma_split_kernel<" in launch.name]
        out, lse = ops.decode_attention(q, k, v, pooled=pooled, input_end=end, backend="cuda", **ranges)
        ops.decode_attention(q, k, v, log_c=log_c, input_end=end, backend="cuda", **ranges)
    assert keys / launch.grid[0] >= 3 * 64, f"{launch.grid[0]} splits of {keys} keys: fewer than 3 tiles each"
    want_out, want_lse = reference.decode_attention_reference(q, k, v, **ranges)
    assert relative_error(out, want_out) < RELATIVE_ERROR[torch.bfloat16]
    assert relative_error(lse, want_lse) < RELATIVE_ERROR[torch.float32]
    # m' (fp32 scores): the generated keys' mass spread over the inputs; log c (fp16 relative scores) under the floor.
    inputs = dict(input_start=torch.tensor(start), input_end=torch.tensor(end), kv_len=torch.tensor(length))
    want_pooled = reference.macs_pool_reference(q[:, :, None], k, scale=dim ** -0.5,
                                                **{name: value[:, None] for name, value in inputs.items()})
    want_log_c = reference.macs_update_reference(q, k, start_log_c.double(), scale=dim ** -0.5, **inputs)
    for b in range(batch):
        n = end[b] - start[b]
        assert relative_error(pooled[b, :n], want_pooled[b, 0, :n]) < RELATIVE_ERROR[torch.float32]
        assert relative_error(log_c[b, :n], want_log_c[b, :n]) < RELATIVE_ERROR[torch.bfloat16]


@pytest.mark.parametrize("dim", [64, 128])
def test_the_tensor_core_kernel_takes_each_rows_generated_keys_from_its_own_range(dim):
    """12 query rows of one head (a verify block without GQA) fill 12 of mma's 16 rows: a lane holds rows g and g + 8,
    and rows 8-11 sit only in the second half of the warp's vote on generated keys. Row r attends keys up to 1500 +
    40r (from key 0 in the first item, 11 in the second), the last 10 + r generated: in the last tiles only rows 8-11
    have generated keys, each beginning inside a warp's 16. m' (macs_pool) against float64, on "4 SMs", each split
    several tiles."""
    from macs_kernels.ops import reference
    from tests.tolerances import RELATIVE_ERROR, relative_error

    batch, rows, keys = 2, 12, 1960
    q, k, _ = _scores_along_the_keys("rising", batch, rows, keys, dim)
    q = q[:, None]  # (B, 1, R, D): one head's rows, each rising along the keys
    kv_len = torch.tensor([[1500 + 40 * r for r in range(rows)]] * batch)
    ranges = dict(input_start=torch.tensor([[0] * rows, [11] * rows]), input_end=kv_len - 10 - torch.arange(rows),
                  kv_len=kv_len, scale=dim ** -0.5)
    with emulated("4 SMs"):
        [launch] = [launch for launch in launches_of(lambda: ops.macs_pool(q, k, backend="cuda", **ranges))
                    if "mma_split_kernel<" in launch.name]
        got = ops.macs_pool(q, k, backend="cuda", **ranges)
    assert keys / launch.grid[0] >= 3 * 64, f"{launch.grid[0]} splits of {keys} keys: fewer than 3 tiles each"
    want = reference.macs_pool_reference(q, k, **ranges)
    for b in range(batch):
        for r in range(rows):
            n = int(ranges["input_end"][b, r] - ranges["input_start"][b, r])
            assert relative_error(got[b, r, :n], want[b, r, :n]) < RELATIVE_ERROR[torch.float32], (b, r)


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
def test_only_the_tensor_core_kernels_log_c_update_pools_float16_scores(kernel, dtype, dim):
    """SplitParams::relative_scores: the mma kernel's log c update keeps half the score bytes (fp16 relative to group
    maxima; its bound: test_cuda_ops.py), its m' out keeps float32 scores, as every other split kernel does, on
    16-bit inputs too."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, 2, 2, 130, dim, generator=generator).to(dtype)
    ranges = dict(kv_start=torch.tensor([0, 3]), kv_len=torch.tensor([130, 100]), input_end=torch.tensor([120, 90]),
                  scale=dim ** -0.5, backend="cuda")
    with emulated("H200"):
        pools = {}
        for state in ("log_c", "pooled"):
            launches = launches_of(lambda state=state: ops.decode_attention(q, k, v, **{state: torch.zeros(2, 120)},
                                                                            **ranges))
            [pools[state]] = [launch.name for launch in launches if "pool_kernel<" in launch.name]
            [split] = [launch.name for launch in launches if "split_kernel<" in launch.name]
            assert CUDA_SPLIT_KERNEL_NAMES[kernel] in split, split
    expected = "__half" if kernel == "mma" else "float"
    assert pools == {"log_c": f"void macs::pool_kernel<{expected}, true, 1>(macs::PoolParams<{expected}>)",
                     "pooled": "void macs::pool_kernel<float, true, 1>(macs::PoolParams<float>)"}, pools


# (device, keys, query heads, head slices): 2 items of (keys - 10) inputs at most, one query row each; "4 SMs" keeps
# 8,192 threads resident, an H200 270,336.
HEAD_SLICE_CASES = [("H200", 300, 32, 4), ("H200", 300, 24, 2), ("H200", 300, 12, 1), ("4 SMs", 2100, 32, 2),
                    ("4 SMs", 4200, 32, 1)]


@pytest.mark.parametrize("device, keys, heads, slices", HEAD_SLICE_CASES)
def test_head_pooling_splits_a_keys_heads_over_threads_while_the_grid_is_under_a_wave(device, keys, heads, slices):
    """pool/kernel.cuh's pool_head_slices: while the pool's grid holds fewer threads (one a key) than the GPU keeps
    resident, 2 or 4 threads pool a key's heads, each a slice of at least 8. Every epilogue and source against float64:
    m' from float32 scores, log c from the tensor-core kernel's fp16 relative scores (bf16) and from float32 ones
    (fp32), and from rows; every pooling; inputs of two lengths (the shorter item's tail is zero in m')."""
    from macs_kernels.ops import reference
    from tests.tolerances import RELATIVE_ERROR, relative_error

    generator = torch.Generator().manual_seed(heads)
    start, end, length = torch.tensor([0, 5]), torch.tensor([keys - 10, keys - 60]), torch.tensor([keys, keys - 30])
    width = int((end - start).max())
    inputs = dict(input_start=start, input_end=end, kv_len=length)
    poolings = ("max", "mean", "min") if device == "H200" else ("max",)
    launched = []
    # An op's first call in the process runs its self-check (launches of its own), before the launches are taken.
    q0, k0, v0 = torch.randn(3, 1, 1, 2, 64).unbind()
    ops.decode_attention(q0[0], k0, v0, kv_len=2, input_end=2, log_c=torch.zeros(1, 2), scale=0.125, backend="cuda")
    ops.macs_update_rows(torch.ones(1, 1, 2) / 2, torch.zeros(1, 2), input_start=0, input_end=2, kv_len=2,
                         backend="cuda")
    with emulated(device):
        for dtype, log_c_tolerance in ((torch.bfloat16, RELATIVE_ERROR[torch.float16]),
                                       (torch.float32, RELATIVE_ERROR[torch.float32])):
            q = torch.randn(2, heads, 64, generator=generator).to(dtype)
            k, v = torch.randn(2, 2, 8 if heads > 12 else 4, keys, 64, generator=generator).to(dtype)
            for pooling in poolings:
                options = dict(kv_start=start, kv_len=length, input_end=end, scale=0.125, pooling=pooling,
                               backend="cuda")
                # m' past the shorter item's inputs must be written (zero): it starts as NaN.
                log_c, pooled = -torch.rand(2, width, generator=generator), torch.full((2, width), float("nan"))
                want_log_c = reference.macs_update_reference(q, k, log_c.double(), scale=0.125, pooling=pooling,
                                                             **inputs)
                want_pooled = reference.macs_pool_reference(q[:, :, None], k, scale=0.125, pooling=pooling,
                                                            **{name: value[:, None] for name, value in inputs.items()})
                with launched_kernels() as names:
                    ops.decode_attention(q, k, v, log_c=log_c, **options)
                    ops.decode_attention(q, k, v, pooled=pooled, **options)
                launched += names
                for b in range(2):
                    n = int(end[b] - start[b])
                    error = relative_error(log_c[b, :n], want_log_c[b, :n])
                    assert error < log_c_tolerance, (dtype, pooling, b, error)
                    assert torch.equal(log_c[b, n:].double(), want_log_c[b, n:]), "log c past the inputs changed"
                assert relative_error(pooled, want_pooled[:, 0]) < RELATIVE_ERROR[torch.float32], (dtype, pooling)
        rows = torch.softmax(torch.randn(2, heads, keys, generator=generator), -1)
        row_log_c = torch.zeros(2, width)
        with launched_kernels() as names:
            ops.macs_update_rows(rows, row_log_c, backend="cuda", **inputs)
        launched += names
    want = reference.macs_update_rows_reference(rows, torch.zeros(2, width), **inputs)
    assert relative_error(row_log_c, want) < RELATIVE_ERROR[torch.float32]
    pools = {name for name in launched if "pool_kernel<" in name}
    assert pools == {f"void macs::pool_kernel<{source}, {scores}, {slices}>(macs::PoolParams<{source}>)"
                     for source, scores in (("__half", "true"), ("float", "true"), ("float", "false"))}, pools


@pytest.mark.parametrize("heads, slices", [(32, 4), (24, 2)])
def test_a_keys_head_slices_meet_at_one_barrier_in_any_thread_order(heads, slices):
    """The slices' partial pools pass through shared memory: the same bits whichever threads run first."""
    from macs_kernels.ops.cuda import emulation

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 64, generator=generator).bfloat16()
    k, v = torch.randn(2, 2, 8, 300, 64, generator=generator).bfloat16()
    options = dict(kv_start=[0, 5], kv_len=[300, 270], input_end=[290, 240], scale=0.125, backend="cuda")
    results = {}
    try:
        for order, seed in (("forward", 0), ("reverse", 0), ("shuffled", 1)):
            emulation.set_run_order(order, seed)
            log_c, pooled = torch.zeros(2, 290), torch.zeros(2, 290)
            with launched_kernels() as names:
                ops.decode_attention(q, k, v, log_c=log_c, **options)
                ops.decode_attention(q, k, v, pooled=pooled, **options)
            results[order, seed] = log_c, pooled
    finally:
        emulation.set_run_order("forward")
    assert set(names) >= {
        f"void macs::pool_kernel<__half, true, {slices}>(macs::PoolParams<__half>)",
        f"void macs::pool_kernel<float, true, {slices}>(macs::PoolParams<float>)"}
    want = results["forward", 0]
    for key, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{key} changed a result: a race"


@pytest.mark.parametrize("kernel, dtype, dim", CUDA_SPLIT_KERNEL_CASES)
def test_each_split_kernel_reads_each_attended_key_once_and_each_score_once(kernel, dtype, dim):
    """Every op's split kernel (its accesses counted by the emulation, apps/bench/traffic.py) reads each attended key
    (and value) row once, nothing outside the cache by copy, on "4 SMs" (splits of many tiles) and on an H200 (many
    splits that meet at their edges); a fused MACS pass writes each input key's score once, at its width (float32; the
    tensor-core kernel's log c update: float16 relative to one float32 maximum per 16 keys, each written once, a
    whole group of 16 keys at a time where one holds an input key), and head pooling reads each input key's back once:
    no score of a generated key, which no pooling reads."""
    from macs_kernels.apps.bench.traffic import OUTSIDE, Counts, cuda_traffic

    for device in ("4 SMs", "H200"):
        with emulated(device):
            for case in key_reading_calls(dtype, "cuda", CUDA_BACKEND_DEVICE, dim):
                case.call()  # the first call of the process runs the backend's self-check
                with cuda_traffic(case.cache) as traffic:
                    case.call()
                where = f"{case.name} on {device}"
                split_kernels = {name for name, _ in traffic.counts if "split_kernel<" in name}
                assert split_kernels and all(CUDA_SPLIT_KERNEL_NAMES[kernel] in name for name in split_kernels), \
                    (where, split_kernels)
                assert not traffic.of(OUTSIDE).read, f"{where}: a copy from outside the cache"
                for argument in case.cache:
                    read = sum((traffic.of(argument, name) for name in split_kernels), Counts())
                    assert (read.read, read.read_distinct) == (case.attended, case.attended), \
                        f"{where}: {argument} read {read} for {case.attended} attended bytes"
                if not case.score_columns:
                    continue
                width = score_bytes("cuda", kernel, dtype, case)
                relative = width == 2
                scores = traffic.of("relative_scores" if relative else "scores")
                expected = case.score_columns * width
                written = case.score_groups * RELATIVE_SCORE_PASSES["cuda"][1] * width if relative else expected
                assert (scores.written, scores.written_distinct, scores.read, scores.read_distinct) == \
                    (written, written, expected, expected), f"{where}: {scores} for {expected} bytes of scores"
                maxima = traffic.of("score_maxima")
                assert maxima.written == maxima.written_distinct == maxima.read_distinct > 0 if relative else \
                    maxima == Counts(), f"{where}: score maxima {maxima}"


def test_the_features_lse_pass_reads_each_key_once_per_block_of_rows():
    """attention_features' lse pass (without a given lse) reads a query head's keys once per block of 8 rows, each
    block up to its last row's end, and no other K; it read them once per row (8x the bytes here) before."""
    from macs_kernels.apps.bench.traffic import cuda_traffic

    batch, heads, kv_heads, rows, keys, dim = 1, 6, 2, 13, 300, 64
    q = torch.randn(batch, heads, rows, dim).bfloat16()
    k = torch.randn(batch, kv_heads, keys, dim).bfloat16()
    call = lambda: ops.attention_features(q, k, source_start=10, source_end=280, kv_len=keys, scale=0.125,  # noqa: E731
                                          backend="cuda")
    call()
    with cuda_traffic({"k": k}) as traffic:
        call()
    [lse_pass] = [kernel for kernel, _ in traffic.counts if "features_lse_kernel<" in kernel]
    read = traffic.of("k", lse_pass)
    row_bytes = dim * k.element_size()
    blocks = [keys - rows + min(first + 8, rows) for first in range(0, rows, 8)]  # keys [0, block end)
    assert read.read == heads * sum(blocks) * row_bytes, read
    assert read.read_distinct == k.numel() * k.element_size(), read


# What a GPU's first run of a kernel found or would find, planted in a copy of csrc/: (file, text, replacement, the
# split kernel whose bfloat16 inputs to run [and "misaligned" K/V rows, or "log_c": with a log c update], what the
# emulation must report). "rows": the rows come back wrong; "order": they change with the order blocks and threads
# run in; "error: ...": the launch fails saying so; "abort: ...": -fsanitize's check stops the process saying so;
# "crash": the process faults; "traffic": the rows are right, but the split kernel copies more K/V bytes than the
# keys attended; "hazard": the rows are right, but under dependent launches a kernel touches before its wait what the
# kernels before it write (traffic.cuda_dependent_hazards: a race on a GPU).
MUTATIONS = {
    "cp.async wait one group short": (
        "split_kv_mma/kernel.cuh", "copy_async_wait<kMmaStages - 2>();  // this thread",
        "copy_async_wait<kMmaStages - 1>();  // this thread", "mma", "rows"),
    "no barrier before a tile is restaged": (
        "split_kv/kernel.cuh", "    __syncthreads();  // the previous tile's shared memory is no longer read\n", "",
        "general", "order"),
    "two blocks writing one output row": (
        "split_kv/kernel.cuh",
        "    for (int j = 0; j < W; ++j) p.out[row * p.dim_v + vector * W + j] = from_float<T>(sum[j] * inverse);\n",
        "    for (int j = 0; j < W; ++j) p.out[row * p.dim_v + vector * W + j] = from_float<T>(sum[j] * inverse);\n"
        "    for (int j = 0; j < W; ++j) p.out[(row ^ 1) * p.dim_v + vector * W + j] = "
        "from_float<T>(sum[j] * inverse);\n",
        "pipelined", "order"),
    "16-byte copies from rows not 16-byte aligned": (
        "launch_utils.h", "if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.size(-1) % vec != 0)",
        "if (t.size(-1) % vec != 0)", "pipelined misaligned", "error: misaligned address"),
    "more threads than the kernel's launch bounds": (
        "split_kv_mma/kernel.cu", "kernel<<<grid, kMmaThreads, smem, stream>>>(p);",
        "kernel<<<grid, 2 * kMmaThreads, smem, stream>>>(p);", "mma", "error: too many resources requested"),
    "shared memory sized short": (
        "split_kv_mma/kernel.cuh", "return size_t(ranges + (stages > merge ? stages : merge));",
        "return size_t(ranges + (stages > merge ? stages : merge) / 2);", "mma", "crash"),
    "each slice copying 8 keys past its end": (
        "split_kv_mma/kernel.cuh", "const bool inside = j < stop_offset && j >= first_offset;",
        "const bool inside = j < stop_offset + 8 && begin + j < p.keys && j >= first_offset;", "mma", "traffic"),
    "relative-score rows not padded to whole groups": (
        "split_kv/kernel.cuh", "return ceil_div(keys, kRelativeScoreGroup) * kRelativeScoreGroup;", "return keys;",
        "mma log_c", "abort: store to misaligned address"),
    "a combine that reads the splits before its wait": (
        "split_kv/kernel.cuh", "  wait_for_prior_grid();\n  release_dependent_grid();\n  const int64_t row",
        "  release_dependent_grid();\n  const int64_t row", "mma", "hazard"),
    "a head pooling that reads the combine's stats before its wait": (
        "pool/kernel.cuh", "  wait_for_prior_grid();\n\n  // [heads][2]", "\n  // [heads][2]", "mma log_c", "hazard"),
}

_PROBE = """
import json, sys, torch, warnings
warnings.simplefilter("ignore")
from macs_kernels.apps.bench.traffic import cuda_dependent_hazards, cuda_traffic
from macs_kernels.ops.cuda import dependent_launches, emulation
from macs_kernels.ops.reference import decode_attention_reference
dim = int(sys.argv[1])
emulation.set_device("4 SMs")
generator = torch.Generator().manual_seed(3)
q = torch.randn(2, 8, dim, generator=generator).bfloat16()
# argv[2] "misaligned": every K and V row 2 bytes past a 16-byte boundary, as in a view of a sliced buffer.
offset = int(sys.argv[2] == "misaligned")
k, v = (torch.randn(2 * 2 * 301 * dim + 1, generator=generator).bfloat16()[offset:offset + 2 * 2 * 301 * dim]
        .view(2, 2, 301, dim) for _ in range(2))
kv_len = torch.tensor([301, 250])
# argv[2] "log_c": with a log c update (the tensor-core kernel's relative scores).
input_end, log_c = (torch.tensor([290, 240]), torch.zeros(2, 290)) if sys.argv[2] == "log_c" else (None, None)
want, _ = decode_attention_reference(q, k, v, kv_start=torch.zeros(2, dtype=torch.long), kv_len=kv_len, scale=0.125)
results = {}
for order in emulation.RUN_ORDERS:
    emulation.set_run_order(order, 1)
    try:
        with cuda_traffic({"k": k, "v": v}) as traffic:
            # The operator as the engines call it: the public op would copy misaligned rows.
            out, _ = torch.ops.macs_kernels.decode_attention(q, k, v, torch.zeros(2, dtype=torch.long), kv_len, 0.125,
                                                             log_c, input_end, 0.8, "max", True, None)
    except RuntimeError as error:
        print(json.dumps({"error": str(error)}))
        sys.exit()
    results[order] = out.float()
    if order == "forward":
        copied = traffic.of("k").read + traffic.of("v").read
        split = sorted({name for name, _ in traffic.counts if "split_kernel<" in name})
error = ((results["forward"].double() - want).abs().max() / want.abs().max()).item()
changed = any(not torch.equal(results["forward"], other) for other in results.values())
attended = 2 * int(kv_len.sum()) * 2 * dim * 2  # K and V, 2 KV heads, dim bfloat16 each
# Once more as programmatic dependents, each access before a wait marked.
emulation.set_run_order("forward")
emulation.take_launches()
emulation.count_accesses([])
with dependent_launches():
    torch.ops.macs_kernels.decode_attention(q, k, v, torch.zeros(2, dtype=torch.long), kv_len, 0.125, log_c, input_end,
                                            0.8, "max", True, None)
hazards = cuda_dependent_hazards(emulation.counted_accesses(), emulation.take_launches())
emulation.count_accesses(None)
print(json.dumps({"error": None, "relative_error": error, "order_changed": changed, "copied": copied,
                  "attended": attended, "split": split, "hazards": hazards}))
"""


@pytest.fixture(scope="module")
def mutation_build(tmp_path_factory):
    """One build folder for the mutated copies: each rebuilds only what its change touches."""
    return tmp_path_factory.mktemp("emulation_build")


@pytest.mark.slow  # a build of the changed sources each (20-60 s)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_emulation_catches_what_a_gpu_run_found(mutation, mutation_build, tmp_path):
    import json
    import os
    import shutil
    import subprocess
    import sys

    from macs_kernels.ops.cuda.emulation import SOURCES
    from tests.tolerances import RELATIVE_ERROR

    file, text, replacement, kernel, expected = MUTATIONS[mutation]
    sources = tmp_path / "csrc"
    shutil.copytree(SOURCES, sources)
    original = (sources / file).read_text()
    assert text in original, f"{file} no longer has the line this mutation changes"
    (sources / file).write_text(original.replace(text, replacement))
    environment = os.environ | {"MACS_KERNELS_CUDA_EMULATION": "1", "MACS_KERNELS_EMULATION_SOURCES": str(sources),
                                "MACS_KERNELS_EMULATION_BUILD": str(mutation_build)}
    kernel, layout = (kernel.split() + ["aligned"])[:2]
    [dim] = [dim for dtype, dim in CUDA_SPLIT_KERNEL_SHAPES[kernel] if dtype == torch.bfloat16]
    probe = subprocess.run([sys.executable, "-c", _PROBE, str(dim), layout], env=environment, capture_output=True,
                           text=True, timeout=600)
    if expected == "crash":
        assert probe.returncode < 0, (probe.returncode, probe.stdout[-500:], probe.stderr[-2000:])
        return
    if expected.startswith("abort: "):
        assert probe.returncode != 0 and expected[len("abort: "):] in probe.stderr, probe.stderr[-2000:]
        return
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    if found["error"] is None:
        assert found["split"] and all(CUDA_SPLIT_KERNEL_NAMES[kernel] in name for name in found["split"]), found
    if expected.startswith("error: "):
        assert found["error"] is not None and expected[len("error: "):] in found["error"], found
    elif expected == "order":
        assert found["error"] is None and found["order_changed"], found
    elif expected == "traffic":
        assert found["error"] is None and found["relative_error"] <= RELATIVE_ERROR[torch.bfloat16], found
        assert found["copied"] > found["attended"], found
    elif expected == "hazard":
        assert found["error"] is None and found["relative_error"] <= RELATIVE_ERROR[torch.bfloat16], found
        assert found["hazards"], found
    else:
        assert found["error"] is None and found["relative_error"] > RELATIVE_ERROR[torch.bfloat16], found
