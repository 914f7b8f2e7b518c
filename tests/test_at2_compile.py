"""The attention_features Triton kernels compile for sm_80 and sm_90 with no GPU present, on tensor cores.

Same subprocess approach (and script) as tests/test_triton_compile.py: TRITON_INTERPRET=1 would replace
the JITFunctions that triton.compile needs.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.test_triton_compile import _SCRIPT, ROOT, TARGETS

INDEX = {"source_start_ptr": "i64", "source_end_ptr": "i64", "start_ptr": "i64", "kv_len_ptr": "i64", "n_rows_ptr": "i64"}
VARIANTS = {
    "features_bf16_d64": (
        "attention_features", "_features_kernel", {"q_ptr": "bf16", "k_ptr": "bf16", **INDEX},
        dict(D=64, BLOCK_D=64, BLOCK_R=64, BLOCK_N=64, DOT_F32=False), dict(num_warps=4),
    ),
    "features_fp32_d128": (
        "attention_features", "_features_kernel", INDEX,
        dict(D=128, BLOCK_D=128, BLOCK_R=64, BLOCK_N=64, DOT_F32=True), dict(num_warps=4),
    ),
    "lse_fp16_d64": (
        "attention_features", "_features_lse_kernel", {"q_ptr": "fp16", "k_ptr": "fp16", **INDEX},
        dict(D=64, BLOCK_D=64, BLOCK_R=64, BLOCK_N=64, DOT_F32=False), dict(num_warps=4),
    ),
}


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(ROOT), json.dumps(VARIANTS), json.dumps(TARGETS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernel_compiles(compiled, variant, arch):
    result = compiled[f"{variant}@sm_{arch}"]
    assert result["cubin_bytes"] > 0 and f".target sm_{arch}" in result["ptx"]
    assert result["shared"] <= 160 * 1024


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", ["features_bf16_d64", "lse_fp16_d64"])
def test_half_precision_scores_use_tensor_cores(compiled, variant, arch):
    assert re.search(r"\b(mma\.sync\.aligned\.m16n8k16|wgmma\.mma_async)", compiled[f"{variant}@sm_{arch}"]["ptx"])
