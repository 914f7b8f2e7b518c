"""benchmarks/bench_traffic.py on a small shape, for each backend it counts (cuda: on the CUDA emulation): it writes its
three files, and its figures are the bytes its calls must move (K and V once, each fused pass's scores at their
width, written and read back once, with the maxima they are kept relative to)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.ops.cases import NEEDS_CUDA_EMULATION, NEEDS_TRITON_INTERPRETER, RELATIVE_SCORE_PASSES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_ops
    import bench_traffic
finally:
    sys.path.remove(str(ROOT / "benchmarks"))



@pytest.mark.parametrize("backend", [pytest.param("triton", marks=NEEDS_TRITON_INTERPRETER),
                                     pytest.param("cuda", marks=NEEDS_CUDA_EMULATION)])
def test_the_traffic_benchmark_counts_the_bytes_its_calls_must_move(backend, tmp_path):
    batch, keys, dim = 1, 300, 64
    bench_traffic.main(["--backend", backend, "--shape", f"{batch},{keys},{dim}", "--out", str(tmp_path)])
    stem = tmp_path / f"traffic_{backend}_cpu"
    assert all(stem.with_suffix(suffix).stat().st_size > 0 for suffix in (".csv", ".json", ".png"))
    rows = [json.loads(line) for line in stem.with_suffix(".json").read_text().splitlines()]
    assert [row["call"] for row in rows] == ["attention", "decode_attention with log_c", "macs_update"]
    # bf16 at D 64: the cuda backend's tensor-core kernel, named by the kernels the emulation counted.
    assert [row["split_pass"] for row in rows[1:]] == 2 * ["mma" if backend == "cuda" else "fused"], rows
    kv_bytes = 2 * batch * bench_traffic.KV_HEADS * keys * dim * 2
    inputs = keys - bench_ops.GENERATED
    relative, group = RELATIVE_SCORE_PASSES[backend]
    for row in rows:
        must_read = kv_bytes if row["call"] != "macs_update" else kv_bytes // 2
        assert row["cache_bytes"] == must_read and row["distinct_bytes"] > must_read, row
        assert row["sector_bytes"] >= row["distinct_bytes"], row
        if row["call"] == "attention":
            assert row["score_bytes"] == 0, row
            continue
        width = 2 if row["split_pass"] in relative else 4  # float16 s - m for bf16's log c update
        # Written (relative scores a whole group of keys at a time), then read back.
        written = -(-inputs // group) * group if row["split_pass"] in relative else inputs
        # The Triton pool reads whole score rows as 16-byte vectors (ops/triton/split_kv.py, score_columns).
        read_back = inputs
        if backend == "triton":
            from macs_kernels.ops.triton.split_kv import score_columns

            read_back = score_columns(inputs)
        scores = batch * bench_traffic.HEADS * (written + read_back) * width
        assert row["score_bytes"] >= scores, row
        # Beyond the scores, only the float32 maxima that relative scores are kept against (one per `group` keys).
        maxima = 2 * batch * bench_traffic.HEADS * (inputs // group + 1) * 4 if row["split_pass"] in relative else 0
        assert row["score_bytes"] - scores <= maxima, row
        ratio = row["distinct_over_attention"] if row["call"] != "macs_update" else row["distinct_over_K"]
        assert ratio > 1, row
