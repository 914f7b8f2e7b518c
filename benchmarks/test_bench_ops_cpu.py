"""CPU timings of the torch path's ops with pytest-benchmark (the GPU figures come from bench_ops.py's
triton.testing.do_bench). Not part of the test suite (testpaths = tests); run and record with

    python -m pytest benchmarks/test_bench_ops_cpu.py --benchmark-only \
        --benchmark-json benchmarks/results/ops_cpu_pytest_benchmark.json

Same problems and providers as bench_ops.py: B in {1, 8}, H/H_kv in {32/8, 9/3}, D in {64, 128},
S in {1k, 4k} on CPU (16k and 64k take minutes per case there); extra_info holds GB/s against the bytes
that must move (K for macs_update, K and V for decode_attention).
"""
import itertools

import pytest
import torch
from bench_ops import Problem, backend_call

CASES = list(itertools.product(("macs_update", "decode_attention"), (1, 8), ((32, 8), (9, 3)), (64, 128), (1024, 4096)))


@pytest.mark.parametrize(
    "op,batch,heads,dim,keys", [(op, b, h, d, s) for op, b, h, d, s in CASES],
    ids=[f"{op}-B{b}-H{h[0]}x{h[1]}-D{d}-S{s}" for op, b, h, d, s in CASES],
)
def test_torch_path(benchmark, op, batch, heads, dim, keys):
    torch.set_num_threads(1)
    problem = Problem(batch, heads[0], heads[1], dim, keys, torch.float32, torch.device("cpu"))
    run = backend_call("torch")(op, problem)
    benchmark.pedantic(run, rounds=5, iterations=3, warmup_rounds=1)
    benchmark.extra_info["gb_per_s"] = problem.bytes(op) / benchmark.stats.stats.median / 1e9
