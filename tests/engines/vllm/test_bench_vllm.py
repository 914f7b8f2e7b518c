"""`macs-kernels bench --vllm` on a tiny model: an engine that refuses attribution gets the refusal recorded as its
"on" row, and its plain runs still go on (a refusal is a figure of the comparison, not the end of the run)."""
import csv

import pytest

pytest.importorskip("vllm")

from macs_kernels.apps.cli import build_parser  # noqa: E402


@pytest.mark.slow  # starts a vLLM engine (a minute or more on a busy 2-core machine)
def test_a_refused_engine_is_recorded_and_its_plain_runs_go_on(tiny_path, tmp_path, monkeypatch):
    # Without the plugin the engine has no worker extension: attach refuses it, naming what is missing.
    monkeypatch.setenv("VLLM_PLUGINS", "none")
    args = build_parser().parse_args([
        "bench", "--vllm", "--model", tiny_path, "--vllm-engines", "eager", "--repeats", "1", "--requests", "2",
        "--prompt-lens", "16", "32", "--new-tokens", "4", "--out", str(tmp_path), "--name", "refused"])
    assert args.run(args) == 0
    with open(tmp_path / "refused.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["engine"], r["mode"]) for r in rows] == [("eager", "on"), ("eager", "off")]
    assert rows[0]["status"].startswith("refused: RuntimeError: this LLM has no macs_kernels worker extension")
    assert rows[1]["status"] == "ok"
    assert float(rows[1]["tokens_per_s"]) > 0 and float(rows[1]["tokens_per_cpu_s"]) > 0
    with open(tmp_path / "refused_summary.csv", newline="") as handle:
        (summary,) = csv.DictReader(handle)
    assert summary["attribution"] == rows[0]["status"] and summary["tokens_per_s_on"] == ""
