"""The CUDA sources compile, with no GPU and no CUDA torch: a syntax or template error fails here, not on a GPU.

Every torch-free csrc/<piece>/kernel.cu is compiled alone by plain nvcc (no torch include path: this also
proves it torch-free), host code included, for sm_80 and sm_90 under the flags torch's extension build
adds; each architecture's cubin must hold the piece's kernels for float, half and bfloat16, and no other
piece's kernels (the split-KV pass and head pooling have one copy, which the ops compose). Each op's
launcher csrc/<op>/launch.cu registers the CUDA kernel of the operator Python defines; the launchers are
compiled against the torch headers of the installed (CPU) wheel in a slow test. setup.py links the extension
against the shared C++ runtime even with a toolchain that only has the static one.

The pipelined split kernel (csrc/split_kv_pipelined) is held to the evidence that needs no GPU: no spills or local
memory, registers within its budget, and in its SASS the asynchronous 16-byte copies (LDGSTS) into shared memory and
the 16-byte shared-memory reads (LDS.128) it was written for. benchmarks/results/cuda_split_kv_resources.md records
these figures. The tensor-core split kernel (csrc/split_kv_mma, which 16-bit inputs at D 64 and 128 run) is held to
the same: no local memory, and in its SASS the m16n8k16 tensor-core MMAs (HMMA.16816.F32, with .BF16 for bfloat16),
the LDGSTS copies and the transposing ldmatrix (LDSM.16.MT88.4) that loads V's fragments. Its values are checked on
the CPU by the emulation (MACS_KERNELS_CUDA_EMULATION=1, ops/cuda/emulation.py), which runs the same source.
"""
import concurrent.futures
import importlib.util
import itertools
import os
import re
import subprocess
import sysconfig
import time
from collections import Counter

import pytest

from macs_kernels.apps.bench.sass import (
    CSRC,
    GRID_RELEASE,
    GRID_WAIT,
    MANGLED_DTYPES,
    TORCH_NVCC_FLAGS,
    blocks_per_multiprocessor,
    cuobjdump,
    divisions,
    instructions,
    key_loop,
    loads_in_flight,
    loops,
    nvcc,
    opcode,
    sass_by_function,
)
from tests.ops.cases import MMA_BLOCKS_BY_REGISTERS, MMA_THREADS

ARCHES = ("sm_80", "sm_90")
DTYPES = MANGLED_DTYPES
# The operators macs_kernels/ops defines; each has csrc/<op>/launch.cu registering its CUDA kernel.
OPS = (
    "attention_features", "decode_attention", "macs_pool", "macs_pool_paged", "macs_update", "macs_update_rows",
    "macs_zscore",
)
# csrc/<piece>/kernel.cu -> the kernels only it holds; True: instantiated for every dtype, or the dtypes it is.
PIECES = {
    "split_kv": {"split_kernel": True, "combine_kernel": True},
    "split_kv_pipelined": {"pipelined_split_kernel": True},
    "split_kv_mma": {"mma_split_kernel": ("half", "bfloat16")},  # tensor cores take fp16 and bf16
    "pool": {"pool_kernel": True},
    "macs_update_rows": {"generated_mass_kernel": True},
    "macs_zscore": {"zscore_kernel": False},  # log_c is float32 whatever the model's dtype
    "attention_features": {"features_kernel": True, "features_lse_kernel": True},
}
# pipelined_split_kernel's __launch_bounds__(256, 2) (kPipelinedMaxRegisters): two 256-thread blocks, or four of
# 128 threads, per multiprocessor; its launch policy counts on it.
PIPELINED_MAX_REGISTERS = 128
PTXAS_ENTRY = re.compile(
    r"Compiling entry function '(\w+)' for '(sm_\d+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)
REGISTRATION = re.compile(r'TORCH_LIBRARY_IMPL\(macs_kernels, CUDA, m\) \{ m\.impl\("(\w+)", &macs::(\w+)\); \}')


def _nvcc():
    found = nvcc()
    if found is None:
        pytest.skip("nvcc is not installed (not on PATH, nor in $CUDA_HOME/bin): the CUDA sources cannot be "
                    "compile-checked")
    return found


def _compile(command):
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return result, time.perf_counter() - started


def _kernels_in(cubin: bytes, names) -> set:
    return {name for name in names if f"_ZN4macs{len(name)}{name}I".encode() in cubin}


def test_each_op_is_registered_once_by_its_own_launcher_and_kernels_are_torch_free():
    assert sorted(p.parent.name for p in CSRC.glob("*/launch.cu")) == sorted(OPS)
    assert sorted(p.parent.name for p in CSRC.glob("*/kernel.cu")) == sorted(PIECES)
    for op in OPS:
        registrations = REGISTRATION.findall((CSRC / op / "launch.cu").read_text())
        assert registrations == [(op, f"{op}_cuda")], f"{op}/launch.cu must register {op}_cuda for {op} only"
    for source in CSRC.rglob("*"):
        if source.is_file():
            text = source.read_text()
            assert not re.search(r"TORCH_LIBRARY\(|\bm\.def\(", text), f"{source}: schemas are defined in Python only"
            # The torch side: the launchers, and the emulation's stand-ins for c10's CUDA headers.
            if source.name not in ("launch.cu", "launch_utils.h") and "emulation" not in source.parts:
                assert not re.search(r'#include\s*[<"](torch|ATen|c10)/', text), f"{source} includes torch"
    assert "m.impl" not in (CSRC / "bindings.cpp").read_text()


@pytest.fixture(scope="module")
def compiled_pieces(tmp_path_factory):
    """Every piece's kernel.cu compiled for sm_80 and sm_90 with ptxas's resource report: (folder, {piece: result})."""
    nvcc = _nvcc()
    folder = tmp_path_factory.mktemp("pieces")
    gencode = [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in ARCHES]
    jobs = {
        piece: [nvcc, "-std=c++17", "-O3", "-c", *gencode, "-Xptxas=-v", "--keep", f"--keep-dir={folder / piece}",
                "-I", str(CSRC), *TORCH_NVCC_FLAGS, "-o", str(folder / piece / "kernel.o"),
                str(CSRC / piece / "kernel.cu")]
        for piece in PIECES
    }
    for piece in PIECES:
        (folder / piece).mkdir()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = dict(zip(jobs, pool.map(_compile, jobs.values())))
    print("nvcc times: " + ", ".join(f"{piece} {seconds:.1f}s" for piece, (_, seconds) in results.items()))
    for piece, (result, _) in results.items():
        assert result.returncode == 0, f"nvcc {piece}/kernel.cu failed:\n{result.stderr}"
    return folder, {piece: result for piece, (result, _) in results.items()}


def test_kernels_compile_for_sm80_and_sm90_in_every_dtype_with_one_copy_each(compiled_pieces):
    folder, _ = compiled_pieces
    every_kernel = {kernel for kernels in PIECES.values() for kernel in kernels}
    for piece in PIECES:
        for arch in ARCHES:
            cubin = (folder / piece / f"kernel.compute_{arch[3:]}.cubin").read_bytes()
            assert _kernels_in(cubin, every_kernel) == set(PIECES[piece]), f"{piece}/{arch}: wrong kernels"
            for kernel, every_dtype in PIECES[piece].items():
                dtypes = DTYPES if every_dtype is True else (every_dtype or ())
                for dtype in dtypes:
                    mangled = DTYPES[dtype]
                    symbol = f"{len(kernel)}{kernel}I{mangled}".encode()
                    assert symbol in cubin, f"{piece}/{arch}: {kernel} is not instantiated for {dtype}"


def test_pipelined_split_kernel_copies_16_bytes_asynchronously_without_spills(compiled_pieces):
    folder, results = compiled_pieces
    entries = PTXAS_ENTRY.findall(results["split_kv_pipelined"].stderr)
    kernels = {(name, arch) for name, arch, *_ in entries if "pipelined_split_kernel" in name}
    assert len(kernels) == 2 * len(DTYPES) * len(ARCHES), f"one kernel per dtype, with and without V: {kernels}"
    for name, arch, stack, spill_stores, spill_loads, registers in entries:
        assert (int(stack), int(spill_stores), int(spill_loads)) == (0, 0, 0), f"{name} {arch}: local memory"
        assert int(registers) <= PIPELINED_MAX_REGISTERS, f"{name} {arch}: {registers} registers"
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    for arch in ARCHES:
        sass = sass_by_function(folder / "split_kv_pipelined" / f"kernel.compute_{arch[3:]}.cubin")
        assert {name for name, _ in kernels} <= set(sass), f"{arch}: kernels missing from the SASS"
        for name, code in sass.items():
            assert re.search(r"\bLDGSTS\.E\.BYPASS(\.\w+)*\.128\b", code), f"{name} {arch}: no 16-byte cp.async"
            assert re.search(r"\bLDGDEPBAR\b", code) and re.search(r"\bDEPBAR\.LE\b", code), f"{name} {arch}: no wait"
            assert re.search(r"\bLDS\.128\b", code), f"{name} {arch}: no 16-byte shared-memory reads"
            assert not re.search(r"\b(LDL|STL)\b", code), f"{name} {arch}: local memory"
            # K and V reach the kernel only through the asynchronous copies: no plain 16-byte global loads.
            assert not re.search(r"\bLDG\.E\.(\w+\.)*128\b", code), f"{name} {arch}: plain 16-byte loads of K/V"
            # Its tile loop divides by no runtime value (csrc/common.cuh, FastDivisor): a signed 32-bit division is
            # about 20 instructions (IABS, I2F, MUFU.RCP, ...), once per stored score and per paged copy before.
            assert divisions(key_loop(code)) == 0, f"{name} {arch}: a division in the key loop"
            # With V (no paged cache: the launcher takes none with V) each pass of its copy loops steps pointers: a
            # key lookup and a paged-or-contiguous branch a copy took 87-90 instructions a pass of K and V, 19-20 now.
            if "Lb1E" in name:
                tiles = key_loop(code)
                copying = [body for body in loops(code) if body != tiles
                           and any(opcode(instruction).startswith("LDGSTS") for instruction in body)]
                assert copying and max(map(len, copying)) <= 32, f"{name} {arch}: {sorted(map(len, copying))}"


def _mma_instantiation(name: str) -> tuple[int, bool]:
    """(D, with V) of a mangled mma_split_kernel<T, D, WITH_V>."""
    return int(re.search(r"Li(\d+)E", name).group(1)), name.endswith("Lb1EEEvNS_11SplitParamsIT_EE")


def test_mma_split_kernel_runs_on_tensor_cores_from_asynchronous_copies_without_spills(compiled_pieces):
    folder, results = compiled_pieces
    entries = PTXAS_ENTRY.findall(results["split_kv_mma"].stderr)
    kernels = {(name, arch) for name, arch, *_ in entries if "mma_split_kernel" in name}
    # fp16 and bf16, D 64 and 128, with and without V, per architecture.
    assert len(kernels) == 2 * 2 * 2 * len(ARCHES), f"one kernel per dtype, D and V: {kernels}"
    for name, arch, stack, spill_stores, spill_loads, registers in entries:
        assert (int(stack), int(spill_stores), int(spill_loads)) == (0, 0, 0), f"{name} {arch}: local memory"
        # Exactly the policy's count: more registers would leave blocks of its wave waiting for a second one, fewer
        # would leave multiprocessors idle.
        blocks = MMA_BLOCKS_BY_REGISTERS[_mma_instantiation(name)]
        resident = blocks_per_multiprocessor(int(arch[3:]), int(registers), MMA_THREADS)
        assert resident == blocks, f"{name} {arch}: {registers} registers"
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    for arch in ARCHES:
        sass = sass_by_function(folder / "split_kv_mma" / f"kernel.compute_{arch[3:]}.cubin")
        assert {name for name, _ in kernels} == set(sass), f"{arch}: kernels missing from the SASS"
        for name, code in sass.items():
            dim, with_v = _mma_instantiation(name)
            # QK^T: two n8 tiles per k16 step of D; PV: one MMA per n8 tile of D_v.
            expected = 2 * dim // 16 + (dim // 8 if with_v else 0)
            mma = r"\bHMMA\.16816\.F32\.BF16\b" if "bfloat16" in name else r"\bHMMA\.16816\.F32(?!\.BF16)\b"
            assert len(re.findall(mma, code)) == expected, f"{name} {arch}: tensor-core MMAs"
            assert re.search(r"\bLDGSTS\.E\.BYPASS(\.\w+)*\.128\b", code), f"{name} {arch}: no 16-byte cp.async"
            assert bool(re.search(r"\bLDSM\.16\.MT88\.4\b", code)) == with_v, f"{name} {arch}: V by ldmatrix.trans"
            assert not re.search(r"\b(LDL|STL)\b", code), f"{name} {arch}: local memory"
            assert not re.search(r"\bLDG\.E\.(\w+\.)*128\b", code), f"{name} {arch}: plain 16-byte loads of K/V"
            # As the pipelined kernel's: no division in the key loop (each thread's score rows are set before it).
            assert divisions(key_loop(code)) == 0, f"{name} {arch}: a division in the key loop"


def test_mma_key_loop_copies_a_tile_and_reads_its_fragments_in_straight_line_code(compiled_pieces):
    """Per tile the mma kernel's threads each issue D / 16 copies of K (and of V) unrolled, one pointer step apart
    where the cache is contiguous (without V a second unrolled path looks keys up in a paged cache's block table:
    the launcher takes no paged cache with V), read K's B fragments
    by ldmatrix (one LDSM.16.M88.4 per k-step: both n8 tiles), take exponentials on the SFU without exp2f's subnormal
    fix-up (a compare with -126 and two predicated multiplies each), and vote once whether any row of the warp has a
    generated key among its 16 and, with V, once whether any output needs rescaling. Before, the copies were a loop
    with a key lookup per copy, K's fragments 2 D / 8 32-bit shared loads, and neither vote: about twice the
    instructions a tile on a path a GPU takes at the pace of two warps per scheduler."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    folder, _ = compiled_pieces
    for arch in ARCHES:
        for name, code in sass_by_function(folder / "split_kv_mma" / f"kernel.compute_{arch[3:]}.cubin").items():
            dim, with_v = _mma_instantiation(name)
            body = key_loop(code)
            executed = [opcode(instruction) for instruction in body if not instruction.startswith("@!PT")]
            assert not [inner for inner in loops(code) if inner != body and set(inner) < set(body)], \
                f"{name} {arch}: a loop inside the key loop"
            copies = sum(operation.startswith("LDGSTS") for operation in executed)
            assert copies == 2 * (dim // 16), f"{name} {arch}: {copies} copies unrolled"
            assert executed.count("LDSM.16.M88.4") == dim // 16, f"{name} {arch}: K's fragments by ldmatrix"
            assert not [operation for operation in executed if operation.split(".")[0] == "LDS"], \
                f"{name} {arch}: 32-bit shared loads in the key loop"
            assert not [instruction for instruction in body if "-126" in instruction], \
                f"{name} {arch}: exp2f's subnormal fix-up"
            votes = sum(operation.startswith("VOTE.ANY") for operation in executed)
            assert votes == (2 if with_v else 1), f"{name} {arch}: {votes} votes"
            # A lane's relative scores of its two rows: one 8-byte store each (csrc/split_kv/kernel.cuh's
            # relative_score_slot), where 8 2-byte stores wrote each row's sector in pieces; 4-byte ones: float32
            # scores (m'), 4 a row, and the relative scores' maxima, 1 a row.
            stores = Counter(operation for operation in executed if operation.startswith("STG"))
            assert (stores["STG.E.64"], stores["STG.E.U16"], stores["STG.E"]) == (2, 0, 10), f"{name} {arch}: {stores}"


def test_loads_in_flight_stop_at_the_first_instruction_that_reads_a_loaded_register():
    independent = ["LDG.E R4, desc[UR4][R10.64]", "LDG.E.64 R6, desc[UR4][R12.64]", "IADD3 R10, P0, R10, 0x4, RZ",
                   "@!P1 LDG.E.U16 R9, desc[UR4][R10.64]"]
    assert loads_in_flight(independent) == 3
    assert loads_in_flight([*independent, "FADD R3, R7, R2", "LDG.E R11, desc[UR4][R14.64]"]) == 3  # R7: the .64's
    assert loads_in_flight([independent[0], "LDG.E R5, desc[UR4][R4.64]"]) == 1  # an address from a load
    assert loads_in_flight([independent[0], "STG.E desc[UR4][R2.64], R4", independent[1]]) == 1  # a stored load
    assert loads_in_flight([independent[0], "MOV R4, R2", independent[1]]) == 2  # R4 written, not read


def _loading_loops(compiled_pieces, piece: str, kernel: str) -> dict[tuple[str, str], list[str]]:
    """(arch, function) -> the loop with the most global loads, of each instantiation of `kernel` in `piece`."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    folder, _ = compiled_pieces
    return {(arch, name): max(loops(code), key=lambda body: sum(opcode(i).startswith("LDG") for i in body))
            for arch in ARCHES
            for name, code in sass_by_function(folder / piece / f"kernel.compute_{arch[3:]}.cubin").items()
            if kernel in name}


def test_pool_kernel_loads_a_chunk_of_heads_before_using_any(compiled_pieces):
    """The head pooling after a split pass is bound by memory latency: in its loop over heads each thread issues a
    chunk of 8 heads' loads (16 with fp16 relative scores: their maxima too) before an instruction reads one, with 1,
    2 or 4 threads a key. Before, each load was read before the next was issued (1 or 2 in flight): 32 DRAM round
    trips a key at 32 heads; pooled first load first, ptxas used some heads between the loads (1 to 9 of 16)."""
    loops_by_kernel = _loading_loops(compiled_pieces, "pool", "pool_kernel")
    for arch in ARCHES:
        kernels = [name for kernel_arch, name in loops_by_kernel if kernel_arch == arch]
        assert len(kernels) == 3 * (len(DTYPES) + 2), f"{arch}: rows in each dtype, float32 and fp16 relative " \
                                                      "scores, each with 1, 2 and 4 threads a key"
    for (arch, name), head_loop in loops_by_kernel.items():
        expected = 16 if "I6__halfLb1E" in name else 8
        assert loads_in_flight(head_loop) == expected, f"{name} {arch}: {loads_in_flight(head_loop)} in flight"


def test_combine_kernel_loads_a_chunk_of_splits_before_using_any(compiled_pieces):
    """The combine pass reads partials another kernel wrote (L2 round trips): each thread issues a chunk of 16 splits'
    partial outputs (policy.cuh's kCombineChunk) before an instruction reads one, their weights taken from shared
    memory (read from global memory beside them, ptxas loaded one accumulator only after its weight's test: a second
    round trip a chunk); its first chunk goes out with the splits' states, before any is used (a shared round trip),
    in both instantiations: 4 columns a thread (16-byte loads) and 1, with no local memory. Before, a thread summed
    every split of its column, the first chunk after the states' merge."""
    loops_by_kernel = _loading_loops(compiled_pieces, "split_kv", "combine_kernel")
    for arch in ARCHES:
        assert len([name for kernel_arch, name in loops_by_kernel if kernel_arch == arch]) == 2 * len(DTYPES), arch
    folder, results = compiled_pieces
    # Its chunk stays in registers (the launch bounds in csrc/split_kv/kernel.cuh say why it can).
    for name, arch, stack, spill_stores, spill_loads, _ in PTXAS_ENTRY.findall(results["split_kv"].stderr):
        if "combine_kernel" in name:
            assert (int(stack), int(spill_stores), int(spill_loads)) == (0, 0, 0), f"{name} {arch}: local memory"
    for (arch, name), split_loop in loops_by_kernel.items():
        assert loads_in_flight(split_loop) == 16, f"{name} {arch}: {loads_in_flight(split_loop)} in flight"
        code = instructions(sass_by_function(folder / "split_kv" / f"kernel.compute_{arch[3:]}.cubin")[name])
        assert loads_in_flight(code) == 16 + 1, f"{name} {arch}: {loads_in_flight(code)} in flight from the start"
        if "Li4E" in name:
            assert sum(opcode(instruction) == "LDG.E.128" for instruction in split_loop) == 16, name


def test_dependent_kernels_wait_for_the_split_pass_before_reading_what_it_wrote(compiled_pieces):
    """With MACS_KERNELS_CUDA_PDL=1 the combine and the head pooling launch as programmatic dependents of the kernel
    before them (common.cuh's launch_kernel), so they may start before it ends. On sm_90: every split kernel releases
    its dependent as it starts; the combine waits before its first load and then releases its own; the pooling loads
    its ranges (an int32 and an int64 path each: start, input_end, kv_len, a window's column start, input_end again
    there) and log c, all written before the split pass began, then waits before the stats, scores and maxima. sm_80
    has neither instruction (a launch there is never dependent)."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    folder, _ = compiled_pieces
    kernels = {"split_kv": ("split_kernel", "combine_kernel"), "split_kv_pipelined": ("pipelined_split_kernel",),
               "split_kv_mma": ("mma_split_kernel",), "pool": ("pool_kernel",)}
    seen = Counter()
    for (piece, names), arch in itertools.product(kernels.items(), ARCHES):
        for function, sass in sass_by_function(folder / piece / f"kernel.compute_{arch[3:]}.cubin").items():
            (kernel,) = [name for name in names if name in function]
            seen[kernel, arch] += 1
            code = [opcode(instruction) for instruction in instructions(sass)]
            if arch == "sm_80":
                assert GRID_WAIT not in code and GRID_RELEASE not in code, function
                continue
            loads = [n for n, name in enumerate(code) if name.startswith("LDG")]
            assert code.count(GRID_WAIT) == (kernel in ("combine_kernel", "pool_kernel")), function
            assert code.count(GRID_RELEASE) == (kernel != "pool_kernel"), function
            if kernel.endswith("split_kernel"):
                assert code.index(GRID_RELEASE) < loads[0], function
            if kernel == "combine_kernel":
                assert code.index(GRID_WAIT) < code.index(GRID_RELEASE) < loads[0], function
            if kernel == "pool_kernel":
                early = Counter(code[n] for n in loads if n < code.index(GRID_WAIT))
                assert early == {"LDG.E.64": 5, "LDG.E": 5 + 1}, (function, early)
    assert all(seen[kernel, arch] for names in kernels.values() for kernel in names for arch in ARCHES), seen


@pytest.mark.slow
def test_launchers_and_registrations_compile_against_the_torch_headers(tmp_path):
    """One translation unit with every launch.cu (TORCH_LIBRARY_IMPL registrations included) and bindings.cpp,
    compiled (not linked) with nvcc.

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


def _setup_module():
    """setup.py's helpers, without running setup() (it runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("macs_kernels_setup", CSRC.parent / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler_finding(folder, libraries):
    """A compiler whose -print-file-name resolves only `libraries`, printing a bare name otherwise as gcc does."""
    script = folder / "fake-g++"
    found = "".join(f"  -print-file-name={name}) echo {folder}/{name} ;;\n" for name in libraries)
    bare = '  -print-file-name=*) echo "${1#-print-file-name=}" ;;\n'
    script.write_text(f'#!/bin/sh\ncase "$1" in\n{found}{bare}esac\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "libraries, link_args",
    [
        (["libstdc++.so", "libstdc++.so.6", "libstdc++.a"], []),  # a usual toolchain: its default link is shared
        (["libstdc++.so.6", "libstdc++.a"], ["-l:libstdc++.so.6"]),  # the H200 image's /opt/gcc
        (["libstdc++.a"], None),  # only the static runtime: the extension is not built
        ([], []),  # not a libstdc++ toolchain: left to the compiler
    ],
)
def test_the_extension_links_the_shared_cpp_runtime(tmp_path, libraries, link_args):
    setup_module = _setup_module()
    assert setup_module.shared_libstdcxx_link_args(_compiler_finding(tmp_path, libraries)) == link_args
    assert setup_module.shared_libstdcxx_link_args(str(tmp_path / "no-such-compiler")) == []
