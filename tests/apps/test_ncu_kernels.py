"""benchmarks/ncu_kernels.py's summary of an ncu raw export: kernels split into calls at the markers, units made us
and MB, the costliest stall reasons first (the profile itself needs a GPU and ncu: .ci/gpu's kernels preset)."""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_kernels  # noqa: E402

COLUMNS = ["ID", "Process ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum",
           "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
           "smsp__average_warp_latency_issue_stalled_barrier.ratio",  # cycles over the whole run: not a share
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "sm__cycles_active.avg",
           "sm__cycles_active.max"]
UNITS = ["", "", "", "ns", "byte", "%", "register/thread", "", "", "", "", "", "cycle", "cycle"]


def _kernel(number: int, name: str, ns: str, read: str, barrier: str, scoreboard: str,
            sm_cycles: tuple[str, str] = ("80,000", "100,000")) -> list[str]:
    return [str(number), "77", name, ns, read, "61.5", "168", "123,456", barrier, scoreboard, "2", "1", *sm_cycles]


def _export(tmp_path: Path, kernels: list[list[str]]) -> Path:
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    for row in (COLUMNS, UNITS, *kernels):
        writer.writerow(row)
    raw = tmp_path / "ncu_issue48_raw.csv"
    raw.write_text("==PROF== Connected to process 77\n" + text.getvalue())
    return raw


def _manifest(tmp_path: Path, providers: list[str]) -> None:
    calls = [{"provider": name, "B": 1, "H": 32, "H_kv": 8, "D": 128, "S": 32768} for name in providers]
    (tmp_path / f"{ncu_kernels.NAME}.json").write_text(json.dumps(calls))


def test_the_summary_splits_calls_at_markers_and_ranks_stall_reasons(tmp_path, capsys):
    raw = _export(tmp_path, [
        _kernel(0, "spin_kernel(long)", "1,000", "0", "0", "0"),
        _kernel(1, "void macs::mma_split_kernel<__nv_bfloat16, 128, true>(macs::SplitParams<__nv_bfloat16>)",
                "52,400", "134,217,728", "7.25", "3.5"),
        _kernel(2, "void macs::combine_kernel<__nv_bfloat16>(macs::CombineParams<__nv_bfloat16>)", "2,100",
                "1,048,576", "0.25", "9"),
        _kernel(3, "spin_kernel(long)", "1,000", "0", "0", "0"),
        _kernel(4, "flash_fwd_splitkv_kernel", "38,000", "134,217,728", "1", "4", ("0", "0")),
    ])
    _manifest(tmp_path, ["cuda-attention-only", "torch-sdpa-gqa"])
    ncu_kernels.main(["--summarise", str(raw), "--out", str(tmp_path)])

    rows = [json.loads(line)["ncu"] for line in capsys.readouterr().out.splitlines() if line.startswith('{"ncu"')]
    assert [(row["provider"], row["kernel"].split("<")[0]) for row in rows] == [
        ("cuda-attention-only", "void macs::mma_split_kernel"),
        ("cuda-attention-only", "void macs::combine_kernel"), ("torch-sdpa-gqa", "flash_fwd_splitkv_kernel")]
    mma, combine, sdpa = rows
    assert (mma["us"], mma["dram_read_MB"], mma["dram_pct"], mma["registers"]) == (52.4, 134.22, 61.5, 168.0)
    # Stalls per issued instruction, the costliest first; neither the whole run's cycles nor the issuing itself.
    assert mma["top_stalls"] == "barrier=7.2 long_scoreboard=3.5 wait=2.0"
    assert combine["top_stalls"] == "long_scoreboard=9.0 wait=2.0 barrier=0.2"
    assert sdpa["us"] == 38.0 and mma["cycles_per_issue"] is None  # a metric the export lacks
    # The SMs' mean active cycles over the busiest one's; none where no SM was active.
    assert (mma["sm_balance"], sdpa["sm_balance"]) == (0.8, None)
    with (tmp_path / f"{ncu_kernels.NAME}.csv").open() as handle:
        assert [row["kernel"] for row in csv.DictReader(handle)] == [row["kernel"] for row in rows]


def test_an_export_whose_calls_differ_from_the_manifest_is_refused(tmp_path):
    raw = _export(tmp_path, [_kernel(0, "spin_kernel(long)", "1", "0", "0", "0"),
                             _kernel(1, "void macs::combine_kernel<float>(macs::CombineParams<float>)", "5", "4",
                                     "1", "1")])
    _manifest(tmp_path, ["cuda", "triton"])
    with pytest.raises(SystemExit, match="1 marked calls, but the manifest lists 2"):
        ncu_kernels.main(["--summarise", str(raw), "--out", str(tmp_path)])


def test_the_run_profiles_one_call_of_each_provider_after_its_marker(tmp_path, monkeypatch):
    """What ncu runs, with the CUDA calls recorded instead (no GPU here) and torch providers standing in for the
    broken-down ones: each provider built right before its calls, warmed up before the profiled range, then one call
    inside it after a marker."""
    import bench_ops
    import torch

    events = []
    original = bench_ops.backend_call("torch")

    def recorded(name):
        def build(op, problem):
            events.append(f"build {name}")
            fn = original(op, problem)
            return lambda: (events.append("call"), fn())
        return bench_ops.Provider(name, bench_ops.OPS, lambda device: None, build)

    monkeypatch.setattr(bench_ops, "BROKEN_DOWN", ("first", "second"))
    monkeypatch.setattr(bench_ops, "PROVIDERS", (recorded("first"), recorded("second")))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: events.append("marker"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    manifest = tmp_path / "calls.json"
    ncu_kernels.run(manifest, "cpu", shapes=((1, 4, 2, 16, 40), (2, 4, 2, 16, 40)))
    one = ["call", "call", "start", "marker", "call", "stop"]
    assert events == (["build first", *one, "build second", *one]) * 2
    assert [(call["provider"], call["B"]) for call in json.loads(manifest.read_text())] == [
        ("first", 1), ("second", 1), ("first", 2), ("second", 2)]
