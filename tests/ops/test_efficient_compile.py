"""The efficient-attention back-projection kernel compiles to PTX and cubin for sm_80 and sm_90 (no GPU needed).

triton.compile needs the real (non-interpreted) Triton, so it runs in a subprocess with TRITON_INTERPRET=0.
"""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from macs_kernels.ops.triton.efficient_attention import _efficient_back_projection_kernel as kernel

results = []
for capability in (80, 90):
    for compute, values, causal in (("fp32", "bf16", True), ("fp64", "fp64", False)):
        signature = {
            "w_ptr": "*" + compute, "v_ptr": "*" + values, "out_ptr": "*" + compute, "partial_ptr": "*" + compute,
            "start_ptr": "*i64", "kv_len_ptr": "*i64",
            **{name: "i32" for name in ("kv_heads", "rows_m", "rows_r", "keys", "dim", "stride_vb", "stride_vh",
                                        "stride_vs")},
            **{name: "constexpr" for name in ("CAUSAL", "COMPUTE", "BLOCK_M", "BLOCK_S", "BLOCK_D")},
        }
        constants = {"CAUSAL": causal, "COMPUTE": tl.float64 if compute == "fp64" else tl.float32,
                     "BLOCK_M": 16, "BLOCK_S": 64, "BLOCK_D": 64}
        compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constants),
                                  target=GPUTarget("cuda", capability, 32))
        ptx = compiled.asm["ptx"]
        results.append({"capability": capability, "compute": compute, "cubin": len(compiled.asm["cubin"]),
                        "f64_mma": "mma.sync.aligned.m8n8k4.row.col.f64" in ptx})
print(json.dumps(results))
"""


def test_back_projection_kernel_compiles_for_sm80_and_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for result in results:
        assert result["cubin"] > 0
        # float64 rows use the float64 tensor-core MMA; float32 uses exact FMA (input_precision="ieee").
        assert result["f64_mma"] == (result["compute"] == "fp64"), result
