"""Every Triton kernel compiles for sm_80 and sm_90 with no GPU present, with the code the design asks for.

triton.compile needs real JITFunctions, which TRITON_INTERPRET=1 (the test default) replaces by
interpreted ones, so the compiles run in one subprocess with TRITON_INTERPRET=0.
The arguments get the specialisations the launcher's JIT would give them on a GPU: pointers and strides
divisible by 16 (a contiguous cache with D = 64 or 128). Each kernel compiles a second time with the signature
inductor gives a user-defined kernel inside torch.compile (`torch/_inductor/codegen/triton_utils.signature_of`):
Python floats as fp64 on devices that have fp64, which broke the first GPU compile of the decode step (issue 47).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # triton.compile for sm_80 and sm_90

from macs_kernels.apps.bench.sass import (
    GRID_RELEASE,
    GRID_WAIT,
    SHARED_PER_BLOCK,
    SPLIT_INDEX,
    cuobjdump,
    instructions,
    key_loop,
    loops,
    opcode,
    resources,
    sass_by_function,
    wide_compares,
)
from macs_kernels.apps.bench.sass import (
    features_variant as _features,
)
from macs_kernels.apps.bench.sass import (
    split_kv_variant as _split_kv,
)

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (80, 90)

# The pooling's ranges: the attended keys, the inputs and where a window's inputs start.
POOL_RANGES = {"start_ptr": "i64", "end_ptr": "i64", "kv_len_ptr": "i64", "column_start_ptr": "i64"}


def _with_pointers(variant, **pointers):
    """A variant with some of its pointers' element types changed."""
    module, kernel, types, constexprs, options = variant
    return module, kernel, dict(types, **pointers), constexprs, options


# name -> (module, kernel, pointer element types, constexprs, options)
VARIANTS = {
    "decode_bf16_gqa4_d128": _split_kv("bf16", D=128, GROUP=4, rows=16, WITH_V=True),
    "decode_bf16_gqa4_d64": _split_kv("bf16", D=64, GROUP=4, rows=16, WITH_V=True),
    "decode_bf16_gqa4_d128_dv64": _split_kv("bf16", D=128, GROUP=4, rows=16, WITH_V=True, D_V=64),
    # The same decode step's attention alone (decode_attention without MACS).
    "attention_bf16_gqa4_d128": _split_kv("bf16", D=128, GROUP=4, rows=16, WITH_V=True, WITH_SCORES=False),
    "attention_bf16_gqa4_d64": _split_kv("bf16", D=64, GROUP=4, rows=16, WITH_V=True, WITH_SCORES=False),
    "update_fp16_gqa3_d64": _split_kv("fp16", D=64, GROUP=3, rows=16),
    # macs_pool of a verify block: 9 query heads per KV head x 5 rows = 45 rows in a 64-row tile.
    "pool_block_bf16_gqa9_d64": _split_kv("bf16", D=64, GROUP=9, rows=45),
    # macs_pool_paged: keys gathered through the block table, transformers' page size and flash_attn's.
    "pool_paged_bf16_gqa3_d64_page16": _split_kv("bf16", D=64, GROUP=3, rows=16, PAGE_SIZE=16),
    "pool_paged_fp16_gqa9_d128_page256": _split_kv("fp16", D=128, GROUP=9, rows=45, PAGE_SIZE=256),
    # vLLM's FLASH_ATTN cache (macs_kernels.engines.vllm.flash): 16-slot blocks, a Llama-style GQA 4:1 at D = 128.
    "pool_paged_bf16_gqa4_d128_page16": _split_kv("bf16", D=128, GROUP=4, rows=16, PAGE_SIZE=16),
    # FlashAttention's and vLLM's int32 lengths, read as they are (ops take int32 and int64 ranges).
    "decode_bf16_gqa4_d128_int32_ranges": _with_pointers(
        _split_kv("bf16", D=128, GROUP=4, rows=16, WITH_V=True), **dict.fromkeys(SPLIT_INDEX, "i32")),
    # int32 lengths beside the int64 zeros of a default start: one kernel per mix of widths.
    "decode_bf16_gqa4_d128_mixed_ranges": _with_pointers(
        _split_kv("bf16", D=128, GROUP=4, rows=16, WITH_V=True), input_end_ptr="i32", kv_len_ptr="i32"),
    "decode_fp32_mha_d128": _split_kv("fp32", D=128, GROUP=1, rows=16, WITH_V=True, WITH_SCORES=False,
                                      DOT_F32=True),
    # Attention variants (ops.Variant): Gemma 2's softcap in the split pass, gpt-oss's sinks in the combine.
    "pool_softcap_bf16_gqa2_d256": _split_kv("bf16", D=256, GROUP=2, rows=16, SOFTCAP=True),
    # A sliding window: score columns from the window's inputs' start.
    "pool_window_bf16_gqa4_d128": _split_kv("bf16", D=128, GROUP=4, rows=16, WINDOWED=True),
    "decode_softcap_fp16_gqa4_d128": _split_kv("fp16", D=128, GROUP=4, rows=16, WITH_V=True, SOFTCAP=True),
    # The paged op of a variant layer (a window is a runtime start, sinks are the combine's): Gemma 2's GQA 2:1 at
    # D = 256 in vLLM's 16-slot blocks, and GQA 4:1 at D = 128 in flash_attn's 256-slot pages.
    "pool_paged_softcap_bf16_gqa2_d256_page16": _split_kv("bf16", D=256, GROUP=2, rows=16, PAGE_SIZE=16,
                                                          SOFTCAP=True),
    "pool_paged_softcap_fp16_gqa4_d128_page256": _split_kv("fp16", D=128, GROUP=4, rows=16, PAGE_SIZE=256,
                                                           SOFTCAP=True),
    "combine_bf16": (
        "split_kv", "_split_kv_combine_kernel", {"out_ptr": "bf16"},
        dict(D=128, BLOCK_D=128, SPLITS_PAD=64, SPLITS_CHUNK=64, WITH_V=True, HAS_SINKS=False, PDL=False),
        dict(num_warps=4),
    ),
    "combine_sinks_bf16": (
        "split_kv", "_split_kv_combine_kernel", {"out_ptr": "bf16", "sinks_ptr": "bf16"},
        dict(D=64, BLOCK_D=64, SPLITS_PAD=64, SPLITS_CHUNK=64, WITH_V=True, HAS_SINKS=True, PDL=False),
        dict(num_warps=4),
    ),
    # One KV head's batch-1 decode on an H200: 264 slices (512 padded) at Gemma 3's D = 256, their accumulators read
    # 32 slices at a time.
    "combine_bf16_d256_512_slices": (
        "split_kv", "_split_kv_combine_kernel", {"out_ptr": "bf16"},
        dict(D=256, BLOCK_D=256, SPLITS_PAD=512, SPLITS_CHUNK=32, WITH_V=True, HAS_SINKS=False, PDL=False),
        dict(num_warps=4),
    ),
    "combine_sinks_pool": (
        "split_kv", "_split_kv_combine_kernel", {},
        dict(D=64, BLOCK_D=64, SPLITS_PAD=16, SPLITS_CHUNK=16, WITH_V=False, HAS_SINKS=True, PDL=False),
        dict(num_warps=4),
    ),
    "pool_scores_max": (
        "pool", "_pool_kernel", POOL_RANGES,
        dict(H_PAD=32, BLOCK_I=128, FROM_SCORES=True, REDISTRIBUTE=True, POOLING="max", INTO_LOG_C=True,
             WINDOWED=False, PDL=False),
        dict(num_warps=4),
    ),
    "pool_scores_out_min": (
        "pool", "_pool_kernel", POOL_RANGES,
        dict(H_PAD=16, BLOCK_I=256, FROM_SCORES=True, REDISTRIBUTE=True, POOLING="min", INTO_LOG_C=False,
             WINDOWED=True, PDL=False),
        dict(num_warps=4),
    ),
    "pool_scores_int32_ranges": (
        "pool", "_pool_kernel", dict.fromkeys(POOL_RANGES, "i32"),
        dict(H_PAD=32, BLOCK_I=128, FROM_SCORES=True, REDISTRIBUTE=True, POOLING="max", INTO_LOG_C=True,
             WINDOWED=False, PDL=False),
        dict(num_warps=4),
    ),
    "pool_rows_bf16_mean": (
        "pool", "_pool_kernel", {"values_ptr": "bf16", **POOL_RANGES},
        dict(H_PAD=16, BLOCK_I=256, FROM_SCORES=False, REDISTRIBUTE=False, POOLING="mean", INTO_LOG_C=True,
             WINDOWED=False, PDL=False),
        dict(num_warps=4),
    ),
    "generated_mass_bf16": (
        "pool", "_generated_mass_kernel",
        {"rows_ptr": "bf16", "input_end_ptr": "i64", "kv_len_ptr": "i64"}, dict(BLOCK_S=512), dict(num_warps=4),
    ),
    "zscore": (
        "macs_zscore", "_macs_zscore_kernel", {"n_ptr": "i64"}, dict(BLOCK=1024), dict(num_warps=4),
    ),
    "features_bf16_d64": _features("_features_kernel", "bf16", D=64, rows=64),
    "lse_fp16_d64": _features("_features_lse_kernel", "fp16", D=64, rows=64),
    # Attention variants: Gemma 2's softcap (D = 256), gpt-oss's sinks with a softcap in the lse pass.
    "features_softcap_bf16_d256": _features("_features_kernel", "bf16", D=256, rows=64, SOFTCAP=True),
    "lse_softcap_sinks_bf16_d64": _features("_features_lse_kernel", "bf16", D=64, rows=64, SOFTCAP=True,
                                            HAS_SINKS=True),
    # float32 (products on CUDA cores) at each head dimension.
    **{f"{kernel}_fp32_d{dim}": _features(f"_{kernel}_kernel", "fp32", D=dim, rows=64)
       for kernel in ("features", "features_lse") for dim in (64, 128, 256)},
}

# The decode step's tiles as the launcher sizes them by rows per KV head, head dimension and dtype
# (ops.triton.common.split_kv_block): 16, 32 and 64 rows (a GQA 8:1 verify block of 8 rows fills 64) at D = 64, 128
# and 256 (Gemma's), on tensor cores and on CUDA cores (float32). Their scalars are those of the split variants above,
# which compile with inductor's signature too.
VARIANTS.update({
    f"tiles_{dtype}_d{dim}_rows{rows}": _split_kv(dtype, D=dim, GROUP=4, rows=rows, WITH_V=True,
                                                  DOT_F32=dtype == "fp32")
    for dtype in ("bf16", "fp32") for dim in (64, 128, 256) for rows in (16, 32, 64)
})
# The fused decode's kernels launched as programmatic dependents (common.dependent_launch), for sm_90 only: the grid
# dependency control they use (griddepcontrol) starts there. The split kernel itself launches plainly.
def _dependent(variant, launched_as_dependent=True):
    module, kernel, types, constexprs, options = variant
    return module, kernel, types, dict(constexprs, PDL=True), dict(options, launch_pdl=launched_as_dependent)


VARIANTS.update({
    "pdl_decode_bf16_gqa4_d128": _dependent(VARIANTS["decode_bf16_gqa4_d128"], launched_as_dependent=False),
    **{f"pdl_{name}": _dependent(VARIANTS[name])
       for name in ("combine_bf16", "pool_scores_max", "pool_scores_out_min")},
})
ARCHES = {name: [90] if name.startswith("pdl_") else list(TARGETS) for name in VARIANTS}
COMPILES = [(name, arch) for name in sorted(VARIANTS) for arch in ARCHES[name]]
_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from macs_kernels.apps.bench.sass import compile_triton
variants = json.loads(sys.argv[2])
results = {}
for (name, variant), floats in (
        [(item, "fp32") for item in variants.items()]
        + [(item, "fp64") for item in variants.items() if not item[0].startswith("tiles_")]):
    if floats == "fp64":
        name = "inductor_" + name
    for arch in json.loads(sys.argv[3])[name] if floats == "fp32" else [90]:
        compiled = compile_triton(*variant, arch, floats)
        cubin = f"{sys.argv[4]}/{name}@sm_{arch}.cubin"
        with open(cubin, "wb") as file:
            file.write(compiled.asm["cubin"])
        results[f"{name}@sm_{arch}"] = {
            "ptx": compiled.asm["ptx"], "cubin_bytes": len(compiled.asm["cubin"]), "cubin": cubin,
            "shared": compiled.metadata.shared,
        }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="0")
    cubins = tmp_path_factory.mktemp("cubins")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(ROOT), json.dumps(VARIANTS), json.dumps(ARCHES), str(cubins)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("variant", "arch"), COMPILES)
def test_kernel_compiles(compiled, variant, arch):
    result = compiled[f"{variant}@sm_{arch}"]
    assert result["cubin_bytes"] > 0
    assert f".target sm_{arch}" in result["ptx"]
    assert result["shared"] <= 160 * 1024  # fits sm_80's shared memory with room to spare


@pytest.mark.parametrize("variant", sorted(name for name in VARIANTS if not name.startswith("tiles_")))
def test_kernel_compiles_with_inductors_signature(compiled, variant, arch=90):
    """With fp64 float scalars every kernel still compiles, and its loops stay in fp32: the PTX of the plain
    signature and inductor's differ only by the conversions at entry (no fp64 arithmetic past them)."""
    ptx = compiled[f"inductor_{variant}@sm_{arch}"]["ptx"]
    assert compiled[f"inductor_{variant}@sm_{arch}"]["cubin_bytes"] > 0
    assert not re.search(r"\b(fma|mul|add|max|min|sub|div)\.(rn\.)?f64\b", ptx)


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", [
    "decode_bf16_gqa4_d128", "update_fp16_gqa3_d64", "pool_block_bf16_gqa9_d64", "pool_paged_bf16_gqa3_d64_page16",
    "pool_paged_fp16_gqa9_d128_page256", "pool_paged_bf16_gqa4_d128_page16", "pool_softcap_bf16_gqa2_d256",
    "decode_softcap_fp16_gqa4_d128", "pool_paged_softcap_bf16_gqa2_d256_page16",
    "pool_paged_softcap_fp16_gqa4_d128_page256",
])
def test_split_pass_uses_tensor_cores_and_16_byte_loads(compiled, variant, arch):
    """The GQA group's scores come from one tensor-core product per K tile, fed by 128-bit loads."""
    ptx = compiled[f"{variant}@sm_{arch}"]["ptx"]
    assert re.search(r"\b(mma\.sync\.aligned\.m16n8k16|wgmma\.mma_async)", ptx)
    # K (and V) tiles are staged through shared memory by asynchronous 16-byte copies.
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", ["features_bf16_d64", "lse_fp16_d64", "features_softcap_bf16_d256",
                                     "lse_softcap_sinks_bf16_d64"])
def test_half_precision_feature_scores_use_tensor_cores(compiled, variant, arch):
    assert re.search(r"\b(mma\.sync\.aligned\.m16n8k16|wgmma\.mma_async)", compiled[f"{variant}@sm_{arch}"]["ptx"])


@pytest.mark.parametrize(("variant", "arch"), COMPILES)
def test_kernel_fits_shared_memory_without_spilling(compiled, variant, arch):
    """Every kernel keeps its values in registers and its stages in the shared memory a block gets, with the tiles its
    launcher picks: the split kernels' (ops.triton.common.split_kv_block) and AT2's feature kernels' (features_block)
    by rows, head dimension and dtype. With one tile policy for all (64 keys, 4 warps) a 64-row split tile spilled
    48-840 bytes a thread on tensor cores, float32's CUDA-core products up to 24 KiB, and at D = 256 the stages took up
    to 240 KiB (no GPU launches that) or, at 16 rows, 140 KiB (not on sm_86/89); the feature kernels' 64 x 64 float32
    tiles spilled 9.7-11 KiB at D = 128."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the resources")
    result = compiled[f"{variant}@sm_{arch}"]
    (used,) = resources(Path(result["cubin"])).values()
    assert used.stack == 0 and used.local == 0, f"{used.stack} bytes of stack a thread: registers spill"
    assert result["shared"] <= SHARED_PER_BLOCK[arch], f"{result['shared']} bytes of shared memory"


def _key_loop(cubin: str) -> list[str]:
    (sass,) = sass_by_function(Path(cubin)).values()
    return key_loop(sass)


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("dim", [64, 128])
def test_fused_key_loop_is_the_attention_loop_and_the_score_stores(compiled, dim, arch):
    """The fused pass's key loop (decode with MACS, bf16, GQA 4:1) adds the score stores to the attention
    loop and little else: its masks compare int32 offsets against per-row bounds set before the loop, where they once
    compared int64 keys (two instructions each, three bounds per element). Then the loop ran 1.24-1.34x the attention
    loop's instructions under Triton 3.6, as the fused pass ran 1.17-1.31x attention's time on an H200 (issue 48).
    Storing a float at a time (a row's columns were not 16-byte aligned, and their mask was the inputs' alone), 8 stores
    a thread at D 128, it ran 1.12-1.20x; with 16-byte stores, 1.03-1.07x (Triton 3.6; 1.04-1.13x under 3.9).
    benchmarks/results/triton_sass_*.json has the counts."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    attention, fused = (_key_loop(compiled[f"{name}_bf16_gqa4_d{dim}@sm_{arch}"]["cubin"])
                        for name in ("attention", "decode"))
    wide = wide_compares(fused), wide_compares(attention)
    assert wide[0] == wide[1], f"the score path adds 64-bit compares: {wide[0]} against attention's {wide[1]}"
    # A key block's scores leave as 16-byte vectors: four floats a store.
    constexprs, options = VARIANTS[f"decode_bf16_gqa4_d{dim}"][3:]
    stores = [opcode(instruction) for instruction in fused if opcode(instruction).startswith("STG")]
    assert stores == ["STG.E.128"] * (constexprs["BLOCK_M"] * constexprs["BLOCK_N"] // (4 * 32 * options["num_warps"]))
    lengths = len(fused), len(attention)
    assert lengths[0] <= 1.15 * lengths[1], f"{lengths[0]} instructions against attention's {lengths[1]}"


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("name", ["attention", "decode"])
@pytest.mark.parametrize("dim", [64, 128])
def test_key_loop_takes_the_tiles_exponentials_without_a_subnormal_fix_up(compiled, name, dim, arch):
    """The split kernel's softmax weights come from ex2.approx.ftz (common.fast_exp): around tl.exp's ex2.approx.f32
    ptxas puts a fix-up for results below 2^-126 (a compare with -126, two predicated multiplies) in each call, 10 a
    key tile at D 128 on sm_90, 7% of the attention loop's instructions. Only the running max's rescale keeps tl.exp
    (on fast_exp too, two tiles spilled): its two fix-ups, which also show that the count reads this SASS."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    result = compiled[f"{name}_bf16_gqa4_d{dim}@sm_{arch}"]
    assert "ex2.approx.ftz.f32" in result["ptx"]
    loop = _key_loop(result["cubin"])
    exponentials = sum(opcode(instruction) == "MUFU.EX2" for instruction in loop)
    fix_ups = sum("-126" in instruction for instruction in loop)
    assert 0 < fix_ups <= 2 < exponentials, f"{fix_ups} subnormal fix-ups for {exponentials} exponentials"


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", ["combine_bf16", "combine_sinks_bf16"])
def test_combine_issues_every_load_before_its_first_reduction(compiled, variant, arch):
    """The combine reads what the split kernel just wrote: each load is an L2 round trip. Its slices' maxima, sums,
    sink and first chunk of accumulators (the only one here) are all loaded before the block-wide max's barrier;
    loaded where they were used, the sums waited for the maxima's reduction, the generated sums for the sums', the
    sink and accumulators for those: 4 round trips. (ptxas may still start the max's shuffles, which wait for the
    maxima, before issuing the last accumulators: 6-30 of 35 loads in flight at D 128 under Triton 3.6 and 3.9,
    2 round trips.)"""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    (sass,) = sass_by_function(Path(compiled[f"{variant}@sm_{arch}"]["cubin"])).values()
    code = instructions(sass)
    first_barrier = next(n for n, instruction in enumerate(code) if opcode(instruction).startswith("BAR"))
    late = [instruction for instruction in code[first_barrier:] if opcode(instruction).startswith("LDG")]
    assert not late, f"{len(late)} loads after the first barrier: {late[:3]}"


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", ["pool_scores_max", "pool_scores_int32_ranges"])
def test_pool_reads_scores_as_vectors_and_log_c_beside_them(compiled, variant, arch):
    """The pool of the split pass's scores reads each head's tile as 16-byte vectors (a row's columns are 64-byte
    aligned, and the mask whole over every 16 columns: 8 loads a thread for 32 heads x 128 inputs, where the inputs'
    own mask took 32 loads of a float), and log c, the lse and the generated mass before its first barrier: one round
    trip. log c loaded where it was added waited for the pooling's reductions (a second round trip)."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    (sass,) = sass_by_function(Path(compiled[f"{variant}@sm_{arch}"]["cubin"])).values()
    code = [opcode(instruction) for instruction in instructions(sass)]
    constexprs, options = VARIANTS[variant][3:]
    tile_loads = constexprs["H_PAD"] * constexprs["BLOCK_I"] // (4 * 32 * options["num_warps"])
    assert code.count("LDG.E.128") == tile_loads
    first_barrier = next(n for n, name in enumerate(code) if name.startswith("BAR"))
    assert not [name for name in code[first_barrier:] if name.startswith("LDG")]


@pytest.mark.parametrize("variant", ["decode_bf16_gqa4_d128", "pdl_decode_bf16_gqa4_d128", "combine_bf16",
                                     "pdl_combine_bf16", "pool_scores_max", "pdl_pool_scores_max",
                                     "pool_scores_out_min", "pdl_pool_scores_out_min"])
def test_dependent_kernels_wait_for_their_predecessor_before_reading_what_it_wrote(compiled, variant, arch=90):
    """Launched as programmatic dependents (common.dependent_launch), the combine and the pooling start before the
    kernel they follow has ended: each waits for it (griddepcontrol.wait) before its first read of what it wrote. The
    combine reads only the split kernel's partials: it waits first. The pooling reads its ranges and log c (written
    before the split pass) while the combine ends, then waits, then reads the scores (16-byte vectors), lse and
    lse_gen. The split kernel and the combine release their dependents at once (a dependent's programs then wait on
    SMs they would otherwise leave idle). Without PDL none of it is there."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    (sass,) = sass_by_function(Path(compiled[f"{variant}@sm_{arch}"]["cubin"])).values()
    code = [opcode(instruction) for instruction in instructions(sass)]
    kernel = VARIANTS[variant][1]
    if not variant.startswith("pdl_"):
        assert GRID_WAIT not in code and GRID_RELEASE not in code
        return
    assert code.count(GRID_WAIT) == (kernel != "_split_kv_kernel")
    assert code.count(GRID_RELEASE) == (kernel != "_pool_kernel")
    loads = [n for n, name in enumerate(code) if name.startswith("LDG")]
    if kernel == "_split_kv_combine_kernel":
        assert code.index(GRID_WAIT) < loads[0] and code.index(GRID_RELEASE) < loads[0]
    if kernel == "_pool_kernel":
        wait = code.index(GRID_WAIT)
        early = [code[n] for n in loads if n < wait]
        # start, end and kv_len (one int64 each), a window's column start, and with INTO_LOG_C the log c a thread
        # adds to.
        constexprs = VARIANTS[variant][3]
        assert len(early) == 3 + constexprs["WINDOWED"] + constexprs["INTO_LOG_C"], early
        assert "LDG.E.128" not in early


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", ["features_bf16_d64", "lse_fp16_d64", "lse_softcap_sinks_bf16_d64"])
def test_feature_masks_compare_32_bit_offsets(compiled, variant, arch):
    """AT2's feature kernels mask each (BLOCK_R x BLOCK_N) score tile with int32 offsets from bounds set outside the
    tile: a 64-bit compare per element would put at least one per element a thread holds in the loop (64 x 64 / 128
    threads = 32). Comparing int64 keys there, the loops held 68-74."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the SASS")
    (sass,) = sass_by_function(Path(compiled[f"{variant}@sm_{arch}"]["cubin"])).values()
    (loop,) = loops(sass)
    constexprs = VARIANTS[variant][3]
    elements_per_thread = constexprs["BLOCK_R"] * constexprs["BLOCK_N"] // (32 * VARIANTS[variant][4]["num_warps"])
    assert wide_compares(loop) < elements_per_thread, f"{wide_compares(loop)} 64-bit compares in the loop"
