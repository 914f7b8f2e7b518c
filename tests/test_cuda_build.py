"""The CUDA sources compile, with no GPU and no CUDA torch: a syntax or template error fails here, not on a GPU.

Every torch-free csrc/<op>/kernel.cu is compiled alone by plain nvcc (no torch include path: this also
proves it torch-free) to cubins for sm_80 and sm_90, under the flags torch's extension build adds, and each
cubin must hold the op's kernels for float, half and bfloat16. The torch-side launchers and bindings are
compiled against the torch headers of the installed (CPU) wheel in a slow test.
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
ARCHES = ("sm_80", "sm_90")
# What torch.utils.cpp_extension passes to nvcc: the kernels must not rely on implicit half conversions.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
]
DTYPES = {"float": "f", "half": "6__half", "bfloat16": "13__nv_bfloat16"}  # as mangled in template arguments
KERNELS = {
    "decode_attention": ("split_kernel", "combine_kernel"),
    "macs_update": ("split_kernel", "combine_kernel"),
    "macs_update_rows": ("generated_mass_kernel", "pool_kernel"),
    "macs_zscore": (),  # log_c is float32 whatever the model's dtype
    "attention_features": ("features_kernel", "features_lse_kernel"),
}


def _nvcc():
    found = shutil.which("nvcc")
    if found is None and os.environ.get("CUDA_HOME"):
        candidate = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    if found is None:
        pytest.skip("nvcc is not installed (not on PATH, nor in $CUDA_HOME/bin): the CUDA sources cannot be compile-checked")
    return found


def _compile(command):
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return result, time.perf_counter() - started


def test_every_op_has_a_torch_free_kernel_a_launcher_and_a_binding():
    assert sorted(p.parent.name for p in CSRC.glob("*/kernel.cu")) == sorted(KERNELS)
    bindings = (CSRC / "bindings.cpp").read_text()
    for op in KERNELS:
        assert (CSRC / op / "kernel.cuh").exists() and (CSRC / op / "launch.cu").exists()
        assert f'm.impl("{op}"' in bindings
    for source in [*CSRC.glob("*/kernel.c*"), *CSRC.glob("*.cuh")]:
        assert not re.search(r'#include\s*[<"](torch|ATen|c10)/', source.read_text()), f"{source} includes torch"


def test_kernels_compile_for_sm80_and_sm90_in_every_dtype(tmp_path):
    nvcc = _nvcc()
    jobs = {
        (op, arch): [nvcc, "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-I", str(CSRC), *TORCH_NVCC_FLAGS,
                     "-o", str(tmp_path / f"{op}_{arch}.cubin"), str(CSRC / op / "kernel.cu")]
        for op in KERNELS for arch in ARCHES
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = dict(zip(jobs, pool.map(_compile, jobs.values())))
    timings = ", ".join(f"{op}/{arch} {seconds:.1f}s" for (op, arch), (_, seconds) in results.items())
    print(f"nvcc times: {timings}")
    for (op, arch), (result, _) in results.items():
        assert result.returncode == 0, f"nvcc {op}/kernel.cu for {arch} failed:\n{result.stderr}"
        cubin = (tmp_path / f"{op}_{arch}.cubin").read_bytes()
        assert b"_ZN4macs" in cubin, f"{op}/{arch}: no macs kernel in the cubin"
        for kernel in KERNELS[op]:
            for dtype, mangled in DTYPES.items():
                symbol = f"{len(kernel)}{kernel}I{mangled}".encode()
                assert symbol in cubin, f"{op}/{arch}: {kernel} is not instantiated for {dtype}"


@pytest.mark.slow
def test_launchers_and_bindings_compile_against_the_torch_headers(tmp_path):
    """One translation unit with every launch.cu and bindings.cpp, compiled (not linked) with nvcc.

    The CPU wheel ships the c10/ATen CUDA headers but not the generated c10/cuda/impl/cuda_cmake_macros.h,
    which only sets export macros for a shared c10_cuda build: an empty stand-in is enough to compile.
    """
    nvcc = _nvcc()
    torch = pytest.importorskip("torch")
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    unity = tmp_path / "all_launchers.cu"
    sources = [*sorted(CSRC.glob("*/launch.cu")), CSRC / "bindings.cpp"]
    unity.write_text("".join(f'#include "{source}"\n' for source in sources))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [str(CSRC), str(tmp_path / "stub"), *include_paths(), sysconfig.get_paths()["include"]]
    command = [nvcc, "-std=c++20", "-O0", "-arch=sm_90", "-c", *TORCH_NVCC_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               *(f"-I{path}" for path in includes), "-o", str(tmp_path / "all_launchers.o"), str(unity)]
    result, seconds = _compile(command)
    print(f"launchers + bindings: {seconds:.1f}s")
    assert result.returncode == 0, f"nvcc failed on the launchers:\n{result.stderr[-6000:]}"
