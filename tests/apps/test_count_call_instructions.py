"""benchmarks/count_call_instructions.py: callgrind counts the instructions of the public calls' loop alone (not the
import of torch before it, about 10^10 instructions, nor nothing) and writes its JSON and plot."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_each_public_call_is_counted_alone(tmp_path):
    out = tmp_path / "counts"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "count_call_instructions.py"), "--calls", "20",
                           "--path", "wrapper", "--out", str(out)], capture_output=True, text=True, timeout=1200,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["op"] for row in rows] == ["decode_attention", "decode_attention_fused", "macs_pool", "macs_update"]
    # A public call's checks and choice run thousands of instructions; the import before the loop is ~10^10.
    assert all(10_000 < row["instructions_per_call"] < 1_000_000 for row in rows), rows
    assert all(row["path"] == "wrapper" and row["vs_this_checkout"] == 1.0 for row in rows)
    assert out.with_suffix(".png").stat().st_size > 0
