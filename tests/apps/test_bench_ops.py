"""benchmarks/bench_ops.py's providers run where their kernels run: a lent GPU's minutes (the `kernels` preset times
them by graph replay) are not lost to a provider that cannot be built. On a CPU the triton providers run on Triton's
interpreter and the cuda ones on the CUDA emulation (MACS_KERNELS_CUDA_EMULATION=1; CI's emulation step), each giving
the torch backend's attention output and log c on a small GQA problem (CI's emulation step selects the cuda ones
by their ids)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from macs_kernels.ops import why_unavailable
from tests.tolerances import RELATIVE_ERROR, relative_error

pytest.importorskip("triton")  # bench_ops times Triton with triton.testing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_ops
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def _backend(provider: str) -> str | None:
    """The macs_kernels backend a provider times (None: another library's kernel)."""
    backend = provider.split("-")[0]
    return backend if backend in ("torch", "triton", "cuda") else None


def _run(provider, op, problem) -> list[torch.Tensor]:
    """What one call of the provider's build computes: its returned tensors and the log c it updates."""
    problem.log_c.zero_()
    returned = provider.build(op, problem)()
    returned = returned if isinstance(returned, tuple) else (returned,)
    return [t.float() for t in returned if t is not None] + [problem.log_c.clone()]


@pytest.mark.parametrize("name", [p.name for p in bench_ops.PROVIDERS if _backend(p.name) in ("triton", "cuda")])
def test_the_kernel_benchmarks_providers_run_on_a_cpu(name):
    provider = next(p for p in bench_ops.PROVIDERS if p.name == name)
    reason = why_unavailable(_backend(name), "cpu")
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    problem = bench_ops.Problem(batch=2, heads=6, kv_heads=2, dim=64, keys=113, dtype=torch.bfloat16,
                                device=torch.device("cpu"))
    reference = next(p for p in bench_ops.PROVIDERS if p.name == "torch")
    for op in provider.ops:
        want = _run(reference, op, problem)
        got = _run(provider, op, problem)
        assert len(got) == len(want), (op, [t.shape for t in got])
        if name.endswith("-attention-only"):  # the attention alone: out and lse, no log c update
            assert not got.pop().any()
            want.pop()
        for g, w in zip(got, want, strict=True):
            assert relative_error(g, w) <= RELATIVE_ERROR[torch.bfloat16], (op, relative_error(g, w))


def test_each_ratio_is_to_the_same_backends_call(capsys):
    """print_json_lines divides a public op's time by the time of the provider that calls its backend's kernels
    directly, and a fused pass's by its own attention alone: never by another backend's."""
    shape = dict(op="decode_attention", mode="cudagraph", B=1, H=32, H_kv=8, D=128, S=4096, GB_s=1.0, vs_sdpa=1.0)
    times = {"cuda": 0.04, "cuda-attention-only": 0.032, "cuda-public": 0.1, "triton": 0.03,
             "triton-attention-only": 0.025, "triton-public": 0.06, "triton-pdl": 0.028,
             "triton-pdl-attention-only": 0.02}
    bench_ops.print_json_lines([dict(shape, provider=name, ms=ms) for name, ms in times.items()])
    lines = {line["provider"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert lines["cuda-public"]["public_vs_kernel"] == 2.5 and lines["cuda-public"]["public_extra_us"] == 60.0
    assert lines["triton-public"]["public_vs_kernel"] == 2.0
    assert lines["cuda"]["fused_vs_attention"] == 1.25 and lines["triton"]["fused_vs_attention"] == 1.2
    assert lines["triton-pdl"]["fused_vs_attention"] == 1.4
    assert lines["triton-pdl"]["pdl_vs_plain"] == round(0.028 / 0.03, 3)
    assert lines["triton-pdl-attention-only"]["pdl_vs_plain"] == 0.8
    assert "pdl_vs_plain" not in lines["triton"] and "pdl_vs_plain" not in lines["triton-public"]
    assert "public_vs_kernel" not in lines["cuda"] and "fused_vs_attention" not in lines["cuda-attention-only"]


def test_the_host_profile_names_where_a_public_call_spends_its_time(tmp_path, capsys):
    """bench_ops' host profile (what the GPU check records beside the eager host cost): per backend that runs here,
    the public decode_attention's functions by their own time, the argument checks among them."""
    path = tmp_path / "profile.txt"
    bench_ops.host_profile(torch.device("cpu"), torch.float32, path, calls=5)
    text = path.read_text()
    assert "=== torch: 5 public decode_attention calls" in text
    assert "_checks.py" in text and "decode_attention.py" in text
    assert "host profile, torch:" in capsys.readouterr().out


def test_the_null_driver_keeps_the_last_launches_a_timing_loop_asks_for():
    """bench_triton_host's null driver holds `keep` launch records: an unbounded list of them (every record holds its
    arguments) made Python's full garbage collections pause its timing loops for 0.2 s."""
    from macs_kernels.apps.bench.null_driver import NullDriver

    metadata = types.SimpleNamespace(name="kernel", hash="digest")
    for keep, recorded in ((2, [(3, 1, 1), (4, 1, 1)]), (None, [(n, 1, 1) for n in range(1, 5)])):
        null = NullDriver(keep=keep)
        launcher = null.launcher_cls(None, metadata)
        for n in range(1, 5):
            launcher(n, 1, 1, null.stream, 7, (), None, None, None, "argument")
        assert [grid for _, _, grid, *_ in null.launches] == recorded


def test_the_host_events_count_what_a_public_call_does_below_python():
    """bench_ops' host events (the GPU check's breakdown of an eager call below Python: on a GPU the CUDA runtime
    calls), here the torch backend's public decode_attention on a CPU: its aten ops, each with its exact count per call,
    the costliest first."""
    rows = bench_ops.host_events(torch.device("cpu"), torch.float32, calls=6)
    by_event = {row["event"]: row for row in rows}
    assert {row["backend"] for row in rows} == {"torch"}
    assert by_event["aten::logsumexp"]["per_call"] >= 1 and float(by_event["aten::logsumexp"]["per_call"]).is_integer()
    times = [row["self_us_per_call"] for row in rows]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)


def test_the_kernel_breakdown_times_each_kernel_of_a_call():
    """kernel_times (the GPU check's per-kernel split of a fused pass against its attention), here on the torch
    provider, whose "kernels" on a CPU are aten ops: the score matmul among them, each with its launches per call."""
    problem = bench_ops.Problem(batch=1, heads=4, kv_heads=2, dim=64, keys=256, dtype=torch.float32,
                                device=torch.device("cpu"))
    torch_provider = next(p for p in bench_ops.PROVIDERS if p.name == "torch")
    rows = bench_ops.kernel_times(torch_provider, "decode_attention", problem, torch.device("cpu"), calls=4)
    by_kernel = {row["kernel"]: row for row in rows}
    assert by_kernel["aten::logsumexp"]["launches"] >= 1 and by_kernel["aten::exp_"]["launches"] >= 1
    assert all(row["us"] > 0 and row["launches"] > 0 and row["S"] == 256 for row in rows)


def test_the_kernel_times_follow_the_table_at_every_shape(tmp_path, monkeypatch, capsys):
    """bench_ops --kernel-times (the kernels preset's breakdown) profiles the chosen providers at each shape of the run
    after the timings, printing JSON lines and writing <stem>_kernels.csv: here the torch provider on a CPU."""
    monkeypatch.setattr(bench_ops, "BROKEN_DOWN", ("torch",))
    monkeypatch.setattr(bench_ops, "PROVIDERS", tuple(p for p in bench_ops.PROVIDERS if p.name == "torch"))
    bench_ops.main(["--quick", "--kernel-times", "--ops", "decode_attention", "--out", str(tmp_path), "--name", "k"])
    lines = [json.loads(line)["kernel_us"] for line in capsys.readouterr().out.splitlines()
             if line.startswith('{"kernel_us"')]
    assert {(row["S"], row["D"]) for row in lines} == {(1024, 128), (4096, 64)}  # --quick's two shapes
    assert (tmp_path / "k_kernels.csv").read_text().count("\n") == len(lines) + 1
    assert "aten::logsumexp" in (tmp_path / "k_host_events.csv").read_text()  # host_events, after the breakdown
