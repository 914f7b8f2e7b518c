"""The Triton launchers' direct launches (ops/triton/common.py, `launch`) call the kernel Triton's own path would call,
with the same grid and arguments, for every specialisation a call can change; a launch hook still sees every launch.

Run with no GPU through a null driver (macs_kernels.apps.bench.null_driver): the kernels compile for sm_90 and each
launch is recorded instead of run. Real JITFunctions need TRITON_INTERPRET=0, which the test default is not, so the
calls run in one subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import collections, contextlib, importlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
from macs_kernels.apps.bench import null_driver

with null_driver.activate() as null:
    from triton import knobs
    from triton.runtime.jit import JITFunction

    common = importlib.import_module("macs_kernels.ops.triton.common")
    triton_ops = importlib.import_module("macs_kernels.ops.triton")
    jit_runs = collections.Counter()
    jit_run = JITFunction.run

    def counted_run(self, *args, **kwargs):
        jit_runs[self.fn.__name__] += 1
        return jit_run(self, *args, **kwargs)

    JITFunction.run = counted_run

    # A tensor by the input it views (by name: two swapped inputs differ) or as a new buffer, and its layout.
    def described(value, inputs):
        if isinstance(value, torch.Tensor):
            source = next((name for name, tensor in inputs.items() if tensor.data_ptr() == value.data_ptr()), "new")
            return [source, str(value.dtype), list(value.shape), list(value.stride()), value.data_ptr() % 16 == 0]
        return value

    def recorded(case, direct, stream):
        call, inputs = case
        null.stream = stream
        jit_runs.clear()
        null.launches.clear()
        with contextlib.nullcontext() if direct else common.jit_launches():
            call()
        return {"launches": [[name, digest, list(grid), stream, function, list(packed),
                              [described(a, inputs) for a in args]]
                             for name, digest, grid, stream, function, packed, args in null.launches],
                "jit_runs": sum(jit_runs.values())}

    def problem(batch, heads, kv_heads, keys, dim, dtype, index=torch.int64, aligned_q=True):
        torch.manual_seed(0)
        q = torch.randn(batch * heads * dim + 1, dtype=dtype)
        q = (q[:-1] if aligned_q else q[1:]).view(batch, heads, dim)
        k, v = (torch.randn(batch, kv_heads, keys, dim, dtype=dtype) for _ in range(2))
        start = torch.zeros(batch, dtype=index)
        kv_len = torch.full((batch,), keys, dtype=index)
        return dict(q=q, k=k, v=v, start=start, kv_len=kv_len, input_end=(kv_len - 5).to(index),
                    state=torch.zeros(batch, keys), attend=start + 7)

    def fused(batch, heads, kv_heads, keys, dim, dtype, **options):
        t = problem(batch, heads, kv_heads, keys, dim, dtype, **options)
        return lambda: triton_ops.decode_attention(t["q"], t["k"], t["v"], t["start"], t["kv_len"], dim ** -0.5,
                                                   t["state"], t["input_end"], 0.8, "max", True, None), t

    def attention(batch, heads, kv_heads, keys, dim, dtype):
        t = problem(batch, heads, kv_heads, keys, dim, dtype)
        return lambda: triton_ops.decode_attention(t["q"], t["k"], t["v"], t["start"], t["kv_len"], dim ** -0.5,
                                                   None, None, 0.8, "max", True, None), t

    def windowed(batch, heads, kv_heads, keys, dim, dtype):
        t = problem(batch, heads, kv_heads, keys, dim, dtype)
        return lambda: triton_ops.decode_attention(t["q"], t["k"], t["v"], t["attend"], t["kv_len"], dim ** -0.5,
                                                   None, t["input_end"], 0.8, "max", True, t["state"],
                                                   score_start=t["start"], softcap=30.0), t

    cases = {
        "fused bf16 GQA 3:1 D64 113 keys": fused(2, 12, 4, 113, 64, torch.bfloat16),
        "its int32 ranges": fused(2, 12, 4, 113, 64, torch.bfloat16, index=torch.int32),
        "its q 2 bytes off 16": fused(2, 12, 4, 113, 64, torch.bfloat16, aligned_q=False),
        "fused fp32 batch 1 D128 1023 keys": fused(1, 8, 8, 1023, 128, torch.float32),
        "attention fp16 GQA 4:1 D128 1024 keys": attention(1, 32, 8, 1024, 128, torch.float16),
        "window and softcap bf16 D64": windowed(2, 6, 2, 96, 64, torch.bfloat16),
    }
    results = {}
    for name, case in cases.items():
        first = recorded(case, direct=True, stream=3)  # compiles: Triton's path
        results[name] = {"first": first, "direct": recorded(case, direct=True, stream=11),
                         "triton": recorded(case, direct=False, stream=11)}

    # Dependent launches forced on (a GPU of sm_90 and later with MACS_KERNELS_TRITON_PDL=1): each launched kernel's
    # launch_pdl, which its launcher passes the driver.
    split_kv = importlib.import_module("macs_kernels.ops.triton.split_kv")
    pool = importlib.import_module("macs_kernels.ops.triton.pool")
    split_kv.dependent_launch = pool.dependent_launch = lambda device: True
    for name in ("fused bf16 GQA 3:1 D64 113 keys", "attention fp16 GQA 4:1 D128 1024 keys"):
        case = cases[name]
        first = recorded(case, direct=True, stream=3)
        dependent = {"first": first, "direct": recorded(case, direct=True, stream=11),
                     "triton": recorded(case, direct=False, stream=11)}
        # Per compiled kernel: launched as a dependent, and whether its code waits and releases (PTX).
        pdl = {compiled.metadata.hash: [compiled.metadata.launch_pdl, "griddepcontrol.wait" in compiled.asm["ptx"],
                                        "griddepcontrol.launch_dependents" in compiled.asm["ptx"]]
               for _, compiled in common._COMPILED.values()}
        dependent["launch_pdl"] = [[launch[0], *pdl[launch[1]]] for launch in dependent["direct"]["launches"]]
        results["dependent " + name] = dependent
    split_kv.dependent_launch = pool.dependent_launch = common.dependent_launch

    hook_calls = []
    hook = lambda metadata: hook_calls.append(metadata)
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton >= 3.6: a HookChain
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    hooked = recorded(cases["fused bf16 GQA 3:1 D64 113 keys"], direct=True, stream=11)
    results["hooked"] = {"jit_runs": hooked["jit_runs"], "hook_calls": len(hook_calls)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def launches():
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], env=dict(os.environ, TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = ("fused bf16 GQA 3:1 D64 113 keys", "its int32 ranges", "its q 2 bytes off 16",
         "fused fp32 batch 1 D128 1023 keys", "attention fp16 GQA 4:1 D128 1024 keys", "window and softcap bf16 D64")


@pytest.mark.parametrize("case", CASES)
def test_a_direct_launch_calls_the_kernel_tritons_path_calls_with_the_same_arguments(launches, case):
    result = launches[case]
    assert result["direct"]["jit_runs"] == 0, "a repeated call went through JITFunction.run"
    assert result["triton"]["jit_runs"] == len(result["triton"]["launches"]) > 0
    # Grid, stream (the current one: 11, the first call ran on 3), function handle, metadata and arguments.
    assert result["direct"]["launches"] == result["triton"]["launches"]
    assert [launch[3] for launch in result["first"]["launches"]] == [3] * len(result["first"]["launches"])
    assert [launch[:3] + launch[4:] for launch in result["first"]["launches"]] == \
        [launch[:3] + launch[4:] for launch in result["triton"]["launches"]]


@pytest.mark.parametrize("case", ["fused bf16 GQA 3:1 D64 113 keys", "attention fp16 GQA 4:1 D128 1024 keys"])
def test_dependent_launches_make_the_combine_and_the_pooling_dependents_of_the_kernel_before(launches, case):
    """With dependent launches on, the combine and the head pooling launch with launch_pdl and their code waits for
    the kernel before (a launch as a dependent of a kernel compiled without the wait would read early); the split
    kernel, which follows the caller's own kernels, launches plainly and releases its dependent, as the combine does;
    direct launches still call what Triton's path calls, and every kernel is another compile."""
    result = launches["dependent " + case]
    # (launched as a dependent, waits, releases) per kernel.
    expected = {"_split_kv_kernel": [False, False, True], "_split_kv_combine_kernel": [True, True, True],
                "_pool_kernel": [True, True, False]}
    assert result["launch_pdl"] == [[name, *expected[name]] for name, *_ in result["launch_pdl"]]
    assert [name for name, *_ in result["launch_pdl"]] == \
        [launch[0] for launch in launches[case]["direct"]["launches"]]
    assert result["direct"]["jit_runs"] == 0
    assert result["direct"]["launches"] == result["triton"]["launches"]
    digests = {kind: {launch[0]: launch[1] for launch in runs["direct"]["launches"]}
               for kind, runs in (("plain", launches[case]), ("dependent", result))}
    assert digests["plain"].keys() == digests["dependent"].keys()
    assert all(digests["plain"][name] != digests["dependent"][name] for name in digests["plain"])


def test_each_specialisation_gets_its_own_kernel(launches):
    """int32 ranges, an unaligned q and the plain call compile three split kernels: a cache keyed on less than the
    specialisation would have launched the first for all three."""
    kernels = {case: {name: digest for name, digest, *_ in launches[case]["direct"]["launches"]}
               for case in CASES[:3]}
    assert len({kernels[case]["_split_kv_kernel"] for case in CASES[:3]}) == 3
    # The combine reads only the workspace and the outputs: the same kernel for all three.
    assert len({kernels[case]["_split_kv_combine_kernel"] for case in CASES[:3]}) == 1


def test_a_launch_hook_sees_every_launch(launches):
    """With a launch hook installed (a profiler's), every launch takes Triton's path, which calls the hook."""
    assert launches["hooked"] == {"jit_runs": 3, "hook_calls": 3}


def test_the_host_benchmark_times_both_launch_paths_of_each_call(tmp_path):
    """benchmarks/bench_triton_host.py records every call under both launch paths, with its profile and plot."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_triton_host.py"), "--rounds", "2",
                           "--calls", "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    stem = tmp_path / "triton_host_cpu"
    assert all(stem.with_suffix(suffix).stat().st_size > 0 for suffix in (".csv", ".png"))
    rows = [json.loads(line) for line in stem.with_suffix(".json").read_text().splitlines()]
    assert sorted((row["call"], row["launch"]) for row in rows) == sorted(
        (call, launch) for call in ("decode_attention with log c", "decode_attention", "macs_update")
        for launch in ("direct", "JITFunction.run"))
    assert all(0 < row["best_us"] <= row["median_us"] for row in rows)
    assert "_split" in (tmp_path / "triton_host_cpu_profile.txt").read_text()
