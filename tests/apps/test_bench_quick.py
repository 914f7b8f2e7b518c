"""The generation benchmark's --quick mode (what CI runs), its CSV schema, and `macs-kernels bench` run from
an installed copy of the package, away from any checkout."""
import argparse
import csv
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from macs_kernels.apps.bench import generate as bench
from macs_kernels.apps.bench.common import PACKAGE_DIR, source_commit
from macs_kernels.apps.cli import build_parser
from tests.helpers import NEEDS_CONTINUOUS_BATCHING

ROOT = Path(__file__).resolve().parents[2]

def read(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench.main(["--quick", "--out", str(out), "--name", "quick"]) == 0
    return out


def test_quick_mode_writes_every_method_and_mode_with_the_schema(quick_run):
    columns, rows = read(quick_run / "quick.csv")
    assert tuple(columns) == bench.COLUMNS
    generating = ("plain-sdpa", "macs-torch", "macs-torch-fused")
    # The output_attentions ways score greedy batch-1 rows only; assisted decoding takes one sequence.
    expected = {("greedy", m, 1) for m in bench.EAGER_METHODS} | {
        (mode, m, b) for m in generating for mode, batches in
        (("greedy", (1, 2)), ("static", (1, 2)), ("beam4", (1, 2)), ("prompt-lookup", (1,))) for b in batches}
    for n in bench.QUICK_LENGTHS:
        assert {(r["mode"], r["method"], int(r["batch"])) for r in rows if r["prompt_len"] == str(n)} == expected
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["commit"] and r["torch"] and r["transformers"] and r["device"]
        for field in ("prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s", "decode_cpu_tok_s", "e2e_tok_s",
                      "peak_mem_bytes"):
            assert float(r[field]) > 0, field
        # Throughput is what the timings say: B x N prompt tokens over the prefill time, the decoded tokens
        # over the decode time, end to end the new tokens over both (the rerun's decode extrapolated).
        batch, new, steps = int(r["batch"]), int(r["new_tokens"]), int(r["decode_steps"])
        assert steps == (min(new, bench.RERUN_STEPS) if r["method"] == bench.RERUN else new) - 1
        prefill_tok_s = batch * int(r["prompt_len"]) / float(r["prefill_s"])
        assert float(r["prefill_tok_s"]) == pytest.approx(prefill_tok_s, rel=1e-2)
        assert float(r["decode_tok_s"]) == pytest.approx(batch * steps / float(r["decode_s"]), rel=1e-2)
        e2e_s = float(r["prefill_s"]) + float(r["decode_s"]) * (new - 1) / steps
        assert float(r["e2e_tok_s"]) == pytest.approx(batch * new / e2e_s, rel=1e-2)
    assert (quick_run / "quick.png").stat().st_size > 0


def test_summary_has_medians_and_ratios(quick_run):
    columns, summary = read(quick_run / "quick_summary.csv")
    assert tuple(columns) == bench.SUMMARY_COLUMNS
    _, rows = read(quick_run / "quick.csv")
    for s in summary:
        assert int(s["repeats"]) == 1
        if s["method"] == "plain-sdpa":
            assert float(s["decode_vs_plain"]) == float(s["mem_vs_plain"]) == 1.0
        plain = next(r for r in rows if (r["mode"], r["method"], r["batch"], r["prompt_len"])
                     == (s["mode"], "plain-sdpa", s["batch"], s["prompt_len"]))
        assert float(s["decode_vs_plain"]) == pytest.approx(
            float(s["decode_tok_s"]) / float(plain["decode_tok_s"]), abs=1e-3)
        assert float(s["mem_vs_plain"]) == pytest.approx(
            float(s["peak_mem_bytes"]) / float(plain["peak_mem_bytes"]), abs=1e-3)
        if s["batch"] == "1" and s["mode"] == "greedy":
            oa = next(r for r in rows if r["method"] == bench.OUTPUT_ATTENTIONS and r["prompt_len"] == s["prompt_len"])
            assert float(s["mem_vs_output_attentions"]) == pytest.approx(
                float(s["peak_mem_bytes"]) / float(oa["peak_mem_bytes"]), abs=1e-3)
            rerun = next(r for r in rows if r["method"] == bench.RERUN and r["prompt_len"] == s["prompt_len"])
            assert float(s["e2e_vs_output_attentions_rerun"]) == pytest.approx(
                float(s["e2e_tok_s"]) / float(rerun["e2e_tok_s"]), abs=1e-3)
        else:  # no output_attentions runs at batch > 1 or in other modes
            assert s["decode_vs_output_attentions"] == s["e2e_vs_output_attentions_rerun"] == ""


def test_beam_and_prompt_lookup_rows_have_sane_ratios_to_plain_in_their_mode(quick_run):
    _, summary = read(quick_run / "quick_summary.csv")
    for mode in ("beam4", "prompt-lookup"):
        rows = {(s["method"], s["batch"], s["prompt_len"]): s for s in summary if s["mode"] == mode}
        for method in ("macs-torch", "macs-torch-fused"):
            for n in bench.QUICK_LENGTHS:
                s = rows[(method, "1", str(n))]
                for column in ("decode_vs_plain", "decode_cpu_vs_plain", "e2e_vs_plain", "mem_vs_plain"):
                    assert 0 < float(s[column]) < float("inf"), (mode, method, column)
                # Same process, same weights, a few KB of score state: memory within 10% even on the tiny model.
                assert float(s["mem_vs_plain"]) == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("mode, option, value", [
    ("beam4", "num_beams", 4), ("static", "cache_implementation", "static"),
    ("prompt-lookup", "prompt_lookup_num_tokens", 3),
])
def test_each_mode_reaches_generate_with_its_options_under_macs(mode, option, value):
    spec = bench.Spec(None, "tiny", "float32", "cpu", "macs-torch", 1, 24, 5, 1, mode)
    model, pad = bench.load(spec)
    calls = []
    generate = model.generate

    def recording_generate(*args, **kwargs):
        calls.append((kwargs, model.config._attn_implementation))
        return generate(*args, **kwargs)

    model.generate = recording_generate
    result = bench.measure(spec, model, pad)
    assert result["status"] == "ok" and result["decode_steps"] == 4
    (warm_up, _), (timed, implementation) = calls
    assert warm_up[option] == timed[option] == value
    assert timed["do_sample"] is False and timed["min_new_tokens"] == timed["max_new_tokens"] == 5
    assert implementation == "macs_kernels"  # generate ran with the tracer attached


def test_medians_over_repeats(tmp_path):
    base = {"machine": "m", "device": "d", "model": "x", "dtype": "float32", "batch": 1, "prompt_len": 8,
            "new_tokens": 4, "status": "ok"}
    rows = [base | {"method": method, "prefill_tok_s": p, "decode_tok_s": d, "decode_cpu_tok_s": d,
                    "e2e_tok_s": d, "peak_mem_bytes": m}
            for method, p, d, m in [("plain-sdpa", 10, 4.0, 100), ("plain-sdpa", 30, 2.0, 300),
                                    ("plain-sdpa", 20, 3.0, 200), ("macs-torch", 10, 1.5, 220)]]
    # Rows of another mode are summarised apart and compared with plain in their own mode (rows without a
    # mode, as in CSVs written before modes existed, are greedy).
    rows += [base | {"mode": "beam4", "method": method, "prefill_tok_s": 5, "decode_tok_s": d, "decode_cpu_tok_s": d,
                     "e2e_tok_s": d, "peak_mem_bytes": m}
             for method, d, m in [("plain-sdpa", 1.0, 400), ("macs-torch", 0.9, 404)]]
    summary = {(s["mode"], s["method"]): s for s in bench.summarise(rows)}
    greedy, beams = summary[("greedy", "macs-torch")], summary[("beam4", "macs-torch")]
    plain = summary[("greedy", "plain-sdpa")]
    assert plain["decode_tok_s"] == 3.0 and plain["repeats"] == 3
    assert greedy["decode_vs_plain"] == 0.5 and greedy["mem_vs_plain"] == 1.1
    assert greedy["decode_vs_output_attentions"] == ""
    assert beams["decode_vs_plain"] == 0.9 and beams["mem_vs_plain"] == 1.01 and beams["repeats"] == 1
    bench.plot(list(summary.values()), tmp_path / "modes.png")  # one prompt length: bars per mode
    assert (tmp_path / "modes.png").stat().st_size > 0


def test_cli_has_the_bench_subcommand():
    args = build_parser().parse_args(["bench", "--quick", "--lengths", "32"])
    assert args.quick and args.lengths == [32] and callable(args.run)


def test_modes_option():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parse = lambda *argv: bench.finish_args(parser.parse_args(list(argv))).modes  # noqa: E731
    assert parse() == ["greedy"]  # today's figures stay comparable
    assert parse("--quick") == list(bench.MODES)
    assert parse("--modes", "greedy,beam4", "prompt-lookup") == ["greedy", "beam4", "prompt-lookup"]
    with pytest.raises(SystemExit, match="--modes beam: choose from greedy, static, beam4, prompt-lookup"):
        parse("--modes", "beam")
    assert parse("--config", "Llama-3.1-8B") == ["greedy", "static"]  # issue 42's side by side: eager, compiled


def test_methods_never_include_the_triton_interpreter():
    assert bench.methods_for("cpu") == ["plain-sdpa", "macs-torch", "macs-torch-fused", *bench.EAGER_METHODS]


@pytest.mark.slow  # fresh processes load torch and the model each: ~40 s
def test_peak_memory_comes_from_a_fresh_process_with_fixed_malloc_thresholds():
    spec = bench.Spec(None, "tiny", "float32", "cpu", "macs-torch", 1, 32, 4, 1)
    result = bench._fresh_process_memory(spec)
    assert result["memory"] == "rss_peak_fixed_mmap_threshold"
    # The weights and the interpreter are in it: a fresh process's peak RSS is tens of MB at least.
    assert result["peak_mem_bytes"] > 20 * 2**20
    failed = bench._fresh_process_memory(dataclasses.replace(spec, config="no-such-config.json"))
    assert failed["status"].startswith("failed (exit ")


@pytest.mark.slow  # fresh processes load torch and the model each: ~25 s
def test_a_cpu_run_times_in_process_and_takes_memory_from_fresh_processes(tmp_path):
    argv = ["--config", "tiny", "--lengths", "16", "--batches", "1", "--methods", "plain-sdpa", "macs-torch",
            "--modes", "greedy", "--new-tokens", "3", "--repeats", "1", "--threads", "1", "--out", str(tmp_path),
            "--name", "cpu"]
    assert bench.main(argv) == 0
    _, rows = read(tmp_path / "cpu.csv")
    assert [r["method"] for r in rows] == ["plain-sdpa", "macs-torch"]
    assert all(r["status"] == "ok" and r["isolated"] == "True" for r in rows)
    assert all(r["memory"] == "rss_peak_fixed_mmap_threshold" and int(r["peak_mem_bytes"]) > 20 * 2**20 for r in rows)
    assert all(int(r["decode_steps"]) == 2 and float(r["decode_cpu_tok_s"]) > 0 for r in rows)


def test_a_stopped_runs_csv_is_summarised_as_the_run_itself_would(quick_run, tmp_path):
    copy = tmp_path / "copy.csv"
    copy.write_text((quick_run / "quick.csv").read_text())
    assert bench.main(["--summarise", str(copy)]) == 0
    assert (tmp_path / "copy_summary.csv").read_text() == (quick_run / "quick_summary.csv").read_text()
    assert (tmp_path / "copy.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_runs_from_an_installed_copy_and_writes_to_the_working_directory(tmp_path):
    """The package copied as pip installs it (site-packages, no checkout, no git): results land in the working
    directory (or --out), the commit column stays empty instead of naming some other repository's commit."""
    site, work = tmp_path / "site-packages", tmp_path / "work"
    shutil.copytree(PACKAGE_DIR, site / "macs_kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    work.mkdir()
    command = [sys.executable, "-m", "macs_kernels", "bench", "--quick", "--lengths", "16", "--batches", "1",
               "--methods", "plain-sdpa", "macs-torch", "--name", "installed", "--threads", "1"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(site), "TRITON_INTERPRET": "1"}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in work.iterdir()) == ["installed.csv", "installed.png", "installed_summary.csv"]
    _, rows = read(work / "installed.csv")
    assert {r["method"] for r in rows} == {"plain-sdpa", "macs-torch"} and all(r["status"] == "ok" for r in rows)
    assert all(r["commit"] == "" for r in rows)
    assert not (site / "benchmarks").exists() and not list(site.glob("*.csv"))


def test_the_commit_is_this_checkouts_when_run_from_it():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert source_commit() == head.stdout.strip()


def test_no_commit_is_taken_from_a_repository_that_merely_encloses_the_package(tmp_path, monkeypatch):
    """A virtual environment inside someone's project: git there answers with the project's commit."""
    from macs_kernels.apps.bench import common

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=x", "-c", "user.email=x@y", "commit", "-q",
                    "--allow-empty", "-m", "project"], check=True)
    package = tmp_path / "venv" / "site-packages" / "macs_kernels"
    package.mkdir(parents=True)
    monkeypatch.setattr(common, "PACKAGE_DIR", package)
    assert common.source_commit() is None  # the editable install's pip record names a folder, not a commit


def test_paired_ratio_divides_within_each_repeat():
    """Plain and MACS measured side by side in each repeat while the machine's speed drifts: the paired median
    is MACS's 0.9x, the ratio of medians (20 / 20) hides it."""
    def row(method, repeat, tokens_per_cpu_s):
        values = dict.fromkeys((field for _, field in bench.RATIOS), 1.0)
        return {**values, "status": "ok", "mode": "greedy", "method": method, "batch": 1, "prompt_len": 64,
                "repeat": repeat, "decode_cpu_tok_s": tokens_per_cpu_s}

    rows = [row("plain-sdpa", i, v) for i, v in enumerate((10.0, 30.0, 20.0))]
    rows += [row("macs-torch", i, v) for i, v in enumerate((9.0, 27.0, 20.0))]
    macs = next(s for s in bench.summarise(rows) if s["method"] == "macs-torch")
    assert macs["decode_cpu_vs_plain"] == 1.0
    assert macs["decode_cpu_vs_plain_paired"] == 0.9


@NEEDS_CONTINUOUS_BATCHING
def test_serving_quick_mode_streams_every_token_and_pairs_throughput(tmp_path):
    args = build_parser().parse_args(["bench", "--serving", "--quick", "--repeats", "1", "--out", str(tmp_path),
                                      "--name", "serving"])
    assert args.run(args) == 0
    _, rows = read(tmp_path / "serving.csv")
    stream = [r for r in rows if r["kind"] == "stream"]
    # Every token of the streamed request but the first (timed from the one before) with its own row read.
    assert [int(r["step"]) for r in stream] == list(range(1, 96))
    assert all(float(r["read_s"]) > 0 and float(r["token_s"]) > 0 for r in stream)
    runs = [r for r in rows if r["kind"] == "throughput"]
    assert [r["attribution"] for r in runs] == ["False", "True", "True", "False"]
    for r in runs:  # end of sequence suppressed: every request makes all its tokens
        assert int(r["generated"]) == 8 * 4
        assert float(r["tok_s"]) == pytest.approx(int(r["generated"]) / float(r["wall_s"]), rel=1e-6)
    _, (summary,) = read(tmp_path / "serving_summary.csv")
    on = sorted(float(r["cpu_tok_s"]) for r in runs if r["attribution"] == "True")
    off = sorted(float(r["cpu_tok_s"]) for r in runs if r["attribution"] == "False")
    assert float(summary["throughput_on_vs_off_paired_cpu"]) == pytest.approx(sum(on) / sum(off), rel=1e-6)
    assert 0 < float(summary["read_ratio_late_vs_64"]) < 100
    assert (tmp_path / "serving.png").stat().st_size > 0


def test_a_config_run_compares_eager_and_static_cache_side_by_side_with_profiled_time(tmp_path):
    """Issue 42's side-by-side grid in miniature: --config's default modes (eager dynamic cache, static cache), plain
    and MACS with the backend attach picks, the profiler's time per token; ratios to plain in the same mode."""
    argv = ["--config", "tiny", "--lengths", "16", "--batches", "1", "--methods", "plain-sdpa", bench.AUTO,
            "--new-tokens", "3", "--repeats", "1", "--threads", "1", "--profile", "--in-process",
            "--out", str(tmp_path), "--name", "side"]
    assert bench.main(argv) == 0
    _, rows = read(tmp_path / "side.csv")
    assert {(r["mode"], r["method"]) for r in rows} == {(m, x) for m in ("greedy", "static")
                                                        for x in ("plain-sdpa", bench.AUTO)}
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["compiled"] == "False"  # generate compiles a static cache on an accelerator only
        assert r["timed_compiles"] == "0"
        assert r["backend"] == ("torch" if r["method"] == bench.AUTO else "")
        assert r["profiled"] == "cpu ops" and float(r["profiled_s"]) > 0
        assert float(r["profiled_ms_per_token"]) == pytest.approx(1e3 * float(r["profiled_s"]) / 3, rel=1e-3)
    _, summary = read(tmp_path / "side_summary.csv")
    by = {(s["mode"], s["method"]): s for s in summary}
    for mode in ("greedy", "static"):
        macs, plain = by[(mode, bench.AUTO)], by[(mode, "plain-sdpa")]
        for ratio, field in (("profiled_vs_plain", "profiled_ms_per_token"), ("decode_vs_plain", "decode_tok_s"),
                             ("mem_vs_plain", "peak_mem_bytes")):
            assert float(macs[ratio]) == pytest.approx(float(macs[field]) / float(plain[field]), abs=1e-3)
    assert (tmp_path / "side.png").stat().st_size > 0


def test_each_static_cell_gets_a_cache_of_its_own_size_warmed_at_its_shape():
    """generate keeps the largest static cache length any call asked for; a short prompt measured after a long
    one would then attend a long cache. The warm-up runs the timed shape: compiled graphs are per cache size."""
    spec = bench.Spec(None, "tiny", "float32", "cpu", "plain-sdpa", 1, 40, 4, 1, "static")
    model, pad = bench.load(spec)
    calls = []
    generate = model.generate

    def recording_generate(ids, **kwargs):
        calls.append((ids.shape, kwargs["max_new_tokens"]))
        return generate(ids, **kwargs)

    model.generate = recording_generate
    assert bench.measure(spec, model, pad)["status"] == "ok"
    assert model._previous_max_cache_length == 40 + 4 - 1  # the last new token is never fed back
    short = dataclasses.replace(spec, prompt_len=12)
    assert bench.measure(short, model, pad)["status"] == "ok"
    assert model._previous_max_cache_length == 12 + 4 - 1
    assert calls[2:] == [((1, 12), 4), ((1, 12), 4)]


def test_an_unknown_method_is_refused_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(bench, "load", lambda spec: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="--methods macs-numba: choose from plain-sdpa"):
        bench.main(["--config", "tiny", "--methods", "plain-sdpa", "macs-numba"])


def test_a_cell_that_fails_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """A GPU session has minutes: one method refused or crashing in one mode must not cost the rest of the grid."""
    import macs_kernels.engines.generate

    def refuse(*args, **kwargs):
        raise NotImplementedError("refused in this mode\nsecond line")

    monkeypatch.setattr(macs_kernels.engines.generate, "attach", refuse)
    argv = ["--config", "tiny", "--lengths", "16", "--batches", "1", "--methods", "plain-sdpa", "macs-torch",
            "--modes", "greedy", "--new-tokens", "3", "--repeats", "1", "--in-process", "--out", str(tmp_path),
            "--name", "failing"]
    assert bench.main(argv) == 0
    _, rows = read(tmp_path / "failing.csv")
    assert [(r["method"], r["status"]) for r in rows] == [
        ("plain-sdpa", "ok"), ("macs-torch", "failed: NotImplementedError: refused in this mode")]
    _, summary = read(tmp_path / "failing_summary.csv")
    assert [s["method"] for s in summary] == ["plain-sdpa"]


def test_vllm_summary_puts_engine_modes_side_by_side_and_keeps_a_refusal(tmp_path):
    """One row per engine mode of the latest run: paired on/off ratios where attribution ran, the refusal where the
    engine refused it (its plain runs still summarised), plain throughput over the eager engine's."""
    from macs_kernels.apps.bench import vllm_engine

    def row(run, engine, mode, repeat, tok_s, status="ok"):
        return {"run": run, "engine": engine, "status": status, "plugin": "macs_kernels", "paged_backend": "numba",
                "mode": mode, "repeat": repeat, "requests": 4, "prompt_min": 64, "prompt_max": 256, "new_tokens": 8,
                "tokens_per_s": tok_s, "tokens_per_cpu_s": 2 * tok_s, "engine_rss_mib": 100.0}

    old = [row("old", "eager", "off", 0, 1.0), row("old", "eager", "on", 0, 1.0)]  # another run: left out
    rows = old + [row("new", "eager", mode, repeat, value) for mode, repeat, value in
                  (("off", 0, 10.0), ("on", 0, 9.0), ("on", 1, 8.0), ("off", 1, 10.0))]
    rows += [row("new", "compiled", "on", "", "", status="refused: NotImplementedError: not in compiled mode"),
             row("new", "compiled", "off", 0, 15.0), row("new", "compiled", "off", 1, 25.0)]
    eager, compiled = vllm_engine.summarise([{k: str(v) for k, v in r.items()} for r in rows], serving=[])
    assert eager["engine"] == "eager" and eager["attribution"] == "ok" and eager["repeats"] == 2
    assert eager["tokens_per_s_off"] == 10.0 and eager["tokens_per_s_on"] == 8.5
    assert eager["on_vs_off_tokens_per_s_paired"] == pytest.approx(0.85)  # median of 0.9 and 0.8
    assert eager["on_vs_off_tokens_per_cpu_s_paired"] == pytest.approx(0.85)
    assert compiled["attribution"] == "refused: NotImplementedError: not in compiled mode"
    assert compiled["tokens_per_s_on"] == "" and compiled["on_vs_off_tokens_per_s_paired"] == ""
    assert compiled["off_vs_eager_off_tokens_per_s"] == pytest.approx(2.0)
    vllm_engine.plot([eager, compiled], tmp_path / "vllm.png")
    assert (tmp_path / "vllm.png").stat().st_size > 0


def test_vllm_summary_reads_a_csv_written_before_engine_modes():
    from macs_kernels.apps.bench import vllm_engine

    with open(Path(__file__).parents[2] / "benchmarks" / "results" / "vllm_cpu_throughput.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    with open(Path(__file__).parents[2] / "benchmarks" / "results" / "serving_cpu.csv", newline="") as handle:
        serving = list(csv.DictReader(handle))  # `bench --serving`'s runs of the same workload (8 x 32 tokens)
    (summary,) = vllm_engine.summarise(rows, serving)
    # What that run's summary said (vllm_cpu_throughput_summary.csv): its latest paged backend's 6 repeats.
    with open(Path(__file__).parents[2] / "benchmarks" / "results" / "vllm_cpu_throughput_summary.csv") as handle:
        (recorded,) = csv.DictReader(handle)
    assert summary["engine"] == "eager" and summary["attribution"] == "ok"
    assert summary["paged_backend"] == recorded["paged_backend"] and summary["repeats"] == int(recorded["repeats"])
    for field in ("on_vs_off_tokens_per_s_paired", "on_vs_off_tokens_per_cpu_s_paired", "tokens_per_s_on",
                  "serve_on_tokens_per_s", "vllm_on_vs_serve_on_tokens_per_cpu_s"):
        assert summary[field] == pytest.approx(float(recorded[field]), rel=1e-9)


@pytest.mark.slow  # dynamo traces the forward of each method (about a minute on a busy 2-core machine)
def test_a_compiled_static_cache_is_compiled_in_the_warm_up_not_in_the_timed_run(tmp_path, monkeypatch):
    """generate compiles a static cache only on an accelerator; its compile config can ask for it here too, which
    takes the benchmark through the path a GPU run takes (dynamo's eager backend: no CUDA graphs on a CPU)."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    monkeypatch.setitem(bench.MODES, bench.STATIC, {"cache_implementation": "static", "compile_config": config})
    argv = ["--config", "tiny", "--lengths", "16", "--batches", "1", "--methods", "plain-sdpa", bench.AUTO,
            "--modes", "static", "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--in-process",
            "--out", str(tmp_path), "--name", "compiled"]
    assert bench.main(argv) == 0
    _, rows = read(tmp_path / "compiled.csv")
    assert [(r["method"], r["status"], r["compiled"], r["timed_compiles"]) for r in rows] == [
        ("plain-sdpa", "ok", "True", "0"), (bench.AUTO, "ok", "True", "0")]


def test_the_compiled_gpu_presets_benchmark_dry_runs_on_a_cpu(tmp_path):
    """`GPU_STAGES=compiled .ci/gpu` runs benchmarks/bench_compiled.py on a GPU; its CPU dry run takes the same code
    path at toy sizes (dynamo's eager backend), so a lent GPU's few minutes are not lost to a name: one JSON line per
    figure, rows equal to the teacher-forced reference, and the attributed step compiled as plain's is."""
    import json

    pytest.importorskip("triton")  # a row per backend, triton's among them

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_compiled
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert bench_compiled.main(["--dry-run", "--out", str(tmp_path), "--stages", "rows", "speed", "--models",
                                "4-layer-fp32", "--prompts", "20", "28", "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "compiled_dry_run.jsonl").read_text().splitlines()]
    rows = {backend: [line for line in lines if line["stage"] == "rows" and line["backend"] == backend]
            for backend in ("None", "triton", "cuda", "cuda-unrefused")}
    assert [line["prompt"] for line in rows["None"]] == [20, 28]
    assert all(line["max_abs_diff"] <= 1e-3 for line in rows["None"])
    assert rows["None"][-1]["graphs_so_far"] == 1 and rows["None"][-1]["graph_breaks_so_far"] == 0  # replayed
    # The interpreted Triton kernels do not compile inside torch.compile: the steps run torch's, with the warning.
    assert [line["kernels"] for line in rows["triton"]] == ["torch", "torch"]
    assert all(line["max_abs_diff"] <= 1e-3 for line in rows["triton"])
    assert any("does not run in a compiled pass" in w for w in rows["triton"][0]["warnings"])
    assert [line["status"] for line in rows["cuda"]] == [line["status"] for line in rows["cuda-unrefused"]] == [
        "unavailable"]
    speed = {line["method"]: line for line in lines if line["stage"] == "speed"}
    assert speed["attributed"]["frames"] == speed["plain"]["frames"] and speed["attributed"]["graph_breaks"] == 0
    assert speed["attributed"]["recompiles_after_warmup"] == 0
    ratio = next(line for line in lines if line["stage"] == "speed-ratio")
    assert ratio["same_frames"] and ratio["tokens_per_s"] > 0
