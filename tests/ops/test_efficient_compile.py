"""The efficient-attention back-projection kernel compiles to PTX and cubin for sm_80 and sm_90 (no GPU needed), with
the launcher's tiles (ops.triton.common.back_projection_block) at D = 64, 128 and 256: exact products, no spills, and
shared memory a block gets on every GPU from sm_80 on.

triton.compile needs the real (non-interpreted) Triton, so it runs in a subprocess with TRITON_INTERPRET=0.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # triton.compile for sm_80 and sm_90

from macs_kernels.apps.bench.sass import SHARED_PER_BLOCK, cuobjdump, resources

SCRIPT = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from macs_kernels.ops.triton.common import back_projection_block
from macs_kernels.ops.triton.efficient_attention import _efficient_back_projection_kernel as kernel

results = []
for capability in (80, 90):
    for compute, values, causal in (("fp32", "bf16", True), ("fp32", "fp32", False), ("fp64", "fp64", False)):
        for dim in (64, 128, 256):
            block_m, block_s, num_warps = back_projection_block(dim)
            signature = {
                "w_ptr": "*" + compute, "v_ptr": "*" + values, "out_ptr": "*" + compute, "partial_ptr": "*" + compute,
                "start_ptr": "*i64", "kv_len_ptr": "*i64",
                **{name: "i32" for name in ("kv_heads", "rows_m", "rows_r", "keys", "dim", "stride_vb", "stride_vh",
                                            "stride_vs")},
                **{name: "constexpr" for name in ("CAUSAL", "COMPUTE", "BLOCK_M", "BLOCK_S", "BLOCK_D")},
            }
            constants = {"CAUSAL": causal, "COMPUTE": tl.float64 if compute == "fp64" else tl.float32,
                         "BLOCK_M": block_m, "BLOCK_S": block_s, "BLOCK_D": dim}
            compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constants),
                                      target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
            name = f"{compute}_{values}_d{dim}_sm{capability}"
            cubin = f"{sys.argv[1]}/{name}.cubin"
            with open(cubin, "wb") as file:
                file.write(compiled.asm["cubin"])
            results.append({"name": name, "capability": capability, "compute": compute, "cubin": cubin,
                            "shared": compiled.metadata.shared,
                            "f64_mma": "mma.sync.aligned.m8n8k4.row.col.f64" in compiled.asm["ptx"]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("cubins"))], env=env,
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_back_projection_kernel_compiles_for_sm80_and_sm90(compiled):
    assert len(compiled) == 18
    for result in compiled:
        assert Path(result["cubin"]).stat().st_size > 0
        # float64 rows use the float64 tensor-core MMA; float32 uses exact FMA (input_precision="ieee").
        assert result["f64_mma"] == (result["compute"] == "fp64"), result


def test_back_projection_tiles_fit_shared_memory_without_spilling(compiled):
    """With tiles of up to 64 rows and 64 keys the kernel spilled up to 37 KiB a thread, and in float64 at D >= 128 took
    152-416 KiB of shared memory (more than any GPU gives a block at D = 256)."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's) to read the resources")
    for result in compiled:
        (used,) = resources(Path(result["cubin"])).values()
        assert used.stack == 0 and used.local == 0, (result["name"], used)
        assert result["shared"] <= SHARED_PER_BLOCK[result["capability"]], (result["name"], result["shared"])
