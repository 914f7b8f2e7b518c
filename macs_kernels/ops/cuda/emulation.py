"""The cuda backend's kernels on the CPU, for tests on machines without a GPU: with MACS_KERNELS_CUDA_EMULATION=1 in
the environment before macs_kernels is imported, the cuda backend takes CPU tensors and runs csrc/ (the same
kernels, launchers and host policy) compiled by the host's C++ compiler, as TRITON_INTERPRET=1 runs the triton
backend's kernels in Triton's interpreter.

csrc/emulation/cpu.h makes each CUDA thread a fiber and computes the warp-collective instructions (shuffles,
mma.sync, ldmatrix, cp.async) as the PTX ISA defines them; its comment says what it shows and what it cannot. Every
load and store of the compiled code calls the runtime (GCC's thread-sanitizer instrumentation, no sanitizer
runtime), which counts the global-memory accesses of running kernels when asked (count_accesses). The
launchers register the operators `torch.ops.macs_kernels.<op>` for the CPU dispatch key (so every CPU call of an
operator in this process runs them), on an emulated H200 (132 multiprocessors, compute capability 9.0).

Importing this module builds the library once into a cache folder (MACS_KERNELS_EMULATION_BUILD, default
~/.cache/macs_kernels/cuda_emulation; about 30 s on two cores, then only what changed) and loads it: the library is
`library`. It needs a checkout of the sources (csrc/ beside the package), ninja, and the CUDA toolkit's
headers (cuda_fp16.h, cuda_bf16.h; no GPU, driver or CUDA runtime).
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy

NAME = "macs_kernels_cuda_emulation"
# The sources built: the checkout's csrc/, or MACS_KERNELS_EMULATION_SOURCES (a changed copy, for tests of what the
# emulation catches).
SOURCES = Path(os.environ.get("MACS_KERNELS_EMULATION_SOURCES", Path(__file__).resolve().parents[3] / "csrc"))

# `kernel<<<grid, block, shared bytes, stream>>>(arguments)` -> `cuda_emulation::launch(kernel, grid, ...)(...)`.
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)<<<(.+?)>>>")
# `extern __shared__ [__align__(n)] type name[];` -> a pointer to the block's dynamic shared memory.
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];")
# `__shared__ type name[n]...;` -> a static array (one block runs at a time), poisoned at each block's start.
_STATIC_SHARED = re.compile(r"\b__shared__\s+([\w:]+)\s+(\w+)((?:\[[^\]]+\])+);")
# A kernel's `__launch_bounds__(max threads[, ...]) name(...) {` -> the body starts by checking the block's size.
_LAUNCH_BOUNDS = re.compile(r"(__launch_bounds__\(\s*([^,)]+)[^)]*\)[^{;]*\{)")


def rewrite(source: str) -> str:
    """`source` (a file of csrc/) as C++ for the emulation: the CUDA constructs that are not C++ syntax (launches,
    shared memory), and the launch bound that the GPU enforces."""
    source = _LAUNCH.sub(r"::cuda_emulation::launch(\1, \2)", source)
    source = _DYNAMIC_SHARED.sub(
        r"\1* const \2 = reinterpret_cast<\1*>(::cuda_emulation::dynamic_shared_memory());", source)
    source = _STATIC_SHARED.sub(r"static \1 \2\3; ::cuda_emulation::static_shared_memory(\2, sizeof(\2));", source)
    return _LAUNCH_BOUNDS.sub(r"\1 ::cuda_emulation::check_launch_bounds(\2);", source)


def _cuda_headers() -> Path:
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_bf16.h").exists():
            return Path(home) / "include"
    raise RuntimeError("the CUDA toolkit's headers (cuda_bf16.h) were not found: set CUDA_HOME")


def _write_if_changed(path: Path, text: str) -> None:
    # An unchanged file keeps its time stamp, so that ninja rebuilds only what changed.
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def build_folder() -> Path:
    """Where the library is built: one folder per torch and Python version, so that environments do not rebuild over
    each other's library (CI's main environment and the GPU image's stack)."""
    import sys

    import torch

    version = f"torch{torch.__version__}-py{sys.version_info.major}.{sys.version_info.minor}"
    default = Path.home() / ".cache" / "macs_kernels" / "cuda_emulation" / version
    return Path(os.environ.get("MACS_KERNELS_EMULATION_BUILD", default))


def load():
    """Build (where the sources changed) and load the emulated library; returns its Python module."""
    if not (SOURCES / "emulation" / "cpu.h").exists():
        raise RuntimeError(f"the CUDA sources are not at {SOURCES}: the emulation needs a checkout of macs_kernels")
    from torch.utils import cpp_extension

    folder = build_folder()
    sources = folder / "src"
    written = set()
    for path in sorted(SOURCES.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
            # .cu would be handed to nvcc: the emulation compiles every file as C++.
            target = (sources / path.relative_to(SOURCES)).with_suffix(".cpp" if path.suffix == ".cu" else path.suffix)
            text = path.read_text()
            _write_if_changed(target, text if "emulation" in path.relative_to(SOURCES).parts else rewrite(text))
            written.add(target)
    for stale in [path for path in sources.rglob("*") if path.is_file() and path not in written]:
        stale.unlink()  # a file removed from csrc/ must not go on compiling
    # One translation unit per file, named after its folder too: torch's build names objects by file name.
    units = []
    for unit in sorted(sources.glob("*/*.cpp")) + [sources / "bindings.cpp"]:
        relative = unit.relative_to(sources)
        units.append(folder / "units" / ("unit_" + "_".join(relative.parts)))
        _write_if_changed(units[-1], f'#include "{relative.as_posix()}"\n')
    (folder / "objects").mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=NAME,
        sources=[str(unit) for unit in units],
        extra_include_paths=[str(sources / "emulation"), str(sources), str(_cuda_headers())],
        extra_cflags=[
            # CUDA code reads one type through a pointer to another (16-byte loads, packed halves), as nvcc allows.
            # A misaligned access faults on the GPU: here it aborts the process, naming the line.
            "-fsanitize=alignment", "-fno-sanitize-recover=alignment",
            # Every plain load and store calls the runtime (csrc/emulation/runtime.cpp's __tsan_* callbacks), which
            # counts those of running kernels while asked to (count_accesses); no sanitizer runtime is linked.
            "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0",
            "-O2", "-fno-strict-aliasing", "-include", str(sources / "emulation" / "cpu.h"), "-DMACS_CPU_EMULATION",
            # torch's extension flags (csrc/common.cuh): conversions are explicit calls.
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            f"-DPyInit__C=PyInit_{NAME}", "-Wno-attributes",
        ],
        # Its own CUDA runtime (csrc/emulation/runtime.cpp) answers its calls even where torch's CUDA build has loaded
        # the real one globally first (the GPU image's torch on a CPU: "CUDA driver version is insufficient").
        extra_ldflags=["-fsanitize=alignment", "-Wl,-Bsymbolic"],
        build_directory=str(folder / "objects"),
        with_cuda=False,
        is_python_module=True,
        verbose=False,
    )


library = load()
# The runtime's controls (csrc/emulation/runtime.cpp), plain C functions of the same library.
_runtime = ctypes.CDLL(library.__file__)
_runtime.cuda_emulation_take_launches.restype = ctypes.c_char_p
_runtime.cuda_emulation_take_shared_grants.restype = ctypes.c_char_p
_runtime.cuda_emulation_kernel_name.restype = ctypes.c_char_p
_runtime.cuda_emulation_kernel_name.argtypes = [ctypes.c_void_p]
_runtime.cuda_emulation_accesses.restype = ctypes.c_size_t
RUN_ORDERS = ("forward", "reverse", "shuffled")


def set_run_order(order: str, seed: int = 0) -> None:
    """Run each launch's blocks, and each block's threads between two barriers, in `order` (one of RUN_ORDERS;
    "forward", block 0 and thread 0 first, is the default; "shuffled" draws a new order each time from `seed`).
    Results that change with the order reveal a race: threads that no barrier orders, or blocks that write one place
    (a GPU runs them in any order, and at once)."""
    if order not in RUN_ORDERS:
        raise ValueError(f"unknown run order {order!r}; choose one of {RUN_ORDERS}")
    _runtime.cuda_emulation_set_order(RUN_ORDERS.index(order), seed)


# What the launchers' device queries answer: multiprocessors, shared memory for one block (opt-in) and per
# multiprocessor (bytes), compute capability major. The host policy sizes its splits from them; "sm_75" (a T4) has
# no mma.sync.m16n8k16, so the tensor-core kernel is never chosen there; an L40's 99 KB a block (sm_89, as sm_86)
# does not hold the tensor-core kernel's block at D 128 with V.
DEVICES = {
    "H200": (132, 227 * 1024, 228 * 1024, 9),
    "A100": (108, 163 * 1024, 164 * 1024, 8),
    "L40": (142, 99 * 1024, 100 * 1024, 8),
    "T4": (40, 64 * 1024, 64 * 1024, 7),
    "4 SMs": (4, 227 * 1024, 228 * 1024, 9),  # few splits, each of many tiles
}


def set_device(name: str) -> None:
    """Answer the launchers' device queries as `name` (one of DEVICES; "H200" is the default) from now on."""
    if name not in DEVICES:
        raise ValueError(f"unknown emulated device {name!r}; choose one of {tuple(DEVICES)}")
    _runtime.cuda_emulation_set_device(*DEVICES[name])


def set_execute(execute: bool) -> None:
    """Run the kernels of later launches (True, the default), or only check and log each launch (False): a call then
    costs what its host path costs (the public op, the dispatcher, the launcher), as on a GPU up to the driver."""
    _runtime.cuda_emulation_set_execute(int(execute))


class Launch(NamedTuple):
    """A kernel launch as a profiler lists it: the kernel (named as on a GPU), its grid and block sizes, its dynamic
    shared memory in bytes, and whether it was launched as a programmatic dependent of the launch before."""
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    dependent: bool = False


def take_launches() -> list[Launch]:
    """The launches since the last call, oldest first (the latest 4,096)."""
    launches = []
    for line in _runtime.cuda_emulation_take_launches().decode().splitlines():
        name, grid, block, shared_bytes, dependent = line.split("\t")
        launches.append(Launch(name, tuple(map(int, grid.split(","))), tuple(map(int, block.split(","))),
                               int(shared_bytes), dependent == "1"))
    return launches


def take_shared_grants() -> list[tuple[str, int]]:
    """The launchers' grants of dynamic shared memory above 48 KiB to a kernel (cudaFuncSetAttribute) since the last
    call, oldest first (the latest 4,096): (kernel name, bytes)."""
    return [(name, int(size)) for name, size in
            (line.split("\t") for line in _runtime.cuda_emulation_take_shared_grants().decode().splitlines())]


# csrc/emulation/runtime.cpp's records of an access and of a named buffer.
ACCESS = numpy.dtype([("address", numpy.uint64), ("kernel", numpy.uint64), ("buffer", numpy.int32),
                      ("bytes", numpy.uint16), ("written", numpy.uint8), ("before_wait", numpy.uint8)])
_BUFFER = numpy.dtype([("start", numpy.uint64), ("end", numpy.uint64), ("name", numpy.uint64), ("alive", numpy.uint64)])


class Buffer(NamedTuple):
    """A buffer a launcher named while accesses were counted: scratch ("scores", "part_acc", ...) or an output."""
    name: str
    start: int
    end: int


class Accesses(NamedTuple):
    """Global-memory accesses of running kernels, in the order they ran: `records` (ACCESS: address, kernel,
    buffer, bytes, written, and before_wait: made by a thread of the kernel before its wait_for_prior_grid) whose
    `buffer` indexes `buffers` (-1: in none of them), and each kernel's name."""
    records: numpy.ndarray
    buffers: list[Buffer]
    kernels: dict[int, str]


def count_accesses(spans: list[tuple[int, int]] | None) -> None:
    """Record the global-memory accesses of the kernels this thread launches from now on (None: stop): every 16-byte
    asynchronous copy (`cp.async`) that reads global memory, and every plain load and store in one of `spans`
    ([start, end) addresses, at most 64) or in a buffer a launcher names while it lives (csrc/launch_utils.h's
    NamedBuffers). Either way forget what was recorded so far."""
    watched = numpy.asarray(spans if spans is not None else [], dtype=numpy.uint64).reshape(-1, 2)
    if not _runtime.cuda_emulation_count_accesses(watched.ctypes.data_as(ctypes.c_void_p),
                                                  -1 if spans is None else len(watched)):
        raise ValueError(f"at most 64 spans can be watched, got {len(watched)}")


def counted_accesses() -> Accesses:
    """The accesses recorded since counting began (counting goes on)."""
    records, buffers, buffer_count = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
    count = _runtime.cuda_emulation_accesses(ctypes.byref(records), ctypes.byref(buffers), ctypes.byref(buffer_count))
    records = numpy.frombuffer(ctypes.string_at(records, count * ACCESS.itemsize), ACCESS) if count else \
        numpy.empty(0, ACCESS)
    named = numpy.frombuffer(ctypes.string_at(buffers, buffer_count.value * _BUFFER.itemsize), _BUFFER) \
        if buffer_count.value else numpy.empty(0, _BUFFER)
    return Accesses(records.copy(), [Buffer(ctypes.string_at(int(b["name"])).decode(), int(b["start"]), int(b["end"]))
                                     for b in named],
                    {int(kernel): _runtime.cuda_emulation_kernel_name(int(kernel)).decode()
                     for kernel in numpy.unique(records["kernel"])})
