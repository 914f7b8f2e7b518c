"""benchmarks/bench_traffic.py on a small shape: it writes its three files, and its figures are the bytes its calls
must move (K and V once, each fused pass's scores at their width, written and read back once)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.ops.cases import NEEDS_TRITON_INTERPRETER

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_ops
    import bench_traffic
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

pytestmark = NEEDS_TRITON_INTERPRETER


def test_the_traffic_benchmark_counts_the_bytes_its_calls_must_move(tmp_path):
    batch, keys, dim = 1, 300, 64
    bench_traffic.main(["--shape", f"{batch},{keys},{dim}", "--out", str(tmp_path)])
    stem = tmp_path / "traffic_triton_cpu"
    assert all(stem.with_suffix(suffix).stat().st_size > 0 for suffix in (".csv", ".json", ".png"))
    rows = [json.loads(line) for line in stem.with_suffix(".json").read_text().splitlines()]
    assert len(rows) == 1 + 2 * 3  # attention, then decode_attention and macs_update under each fused pass
    kv_bytes = 2 * batch * bench_traffic.KV_HEADS * keys * dim * 2
    inputs = keys - bench_ops.GENERATED
    for row in rows:
        must_read = kv_bytes if row["call"] != "macs_update" else kv_bytes // 2
        assert row["cache_bytes"] == must_read and row["distinct_bytes"] > must_read, row
        assert row["sector_bytes"] >= row["distinct_bytes"], row
        if row["call"] == "attention":
            assert row["score_bytes"] == 0, row
            continue
        width = 4 if row["split_pass"] == "verified" else 2  # float16 s - m for bf16's log c update
        scores = 2 * batch * bench_traffic.HEADS * inputs * width  # written, then read back
        assert row["score_bytes"] >= scores, row
        assert row["score_bytes"] - scores <= 2 * batch * bench_traffic.HEADS * (inputs // 64 + 1) * 4, row
        ratio = row["distinct_over_attention"] if row["call"] != "macs_update" else row["distinct_over_K"]
        assert ratio > 1, row
