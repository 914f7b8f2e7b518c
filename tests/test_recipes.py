"""Every recipe in python/ runs as it is (on CPU, few new tokens)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "python"


def run(*args, cwd):
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_explain_qa_writes_the_html(tmp_path):
    page = tmp_path / "answer.html"
    out = run(RECIPES / "explain_qa.py", "--max-new-tokens", "4", "--html", page, cwd=tmp_path)
    assert "answer:" in out and "z =" in out
    html = page.read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "Principia" in html


def test_bare_decode_loop_matches_explain(tmp_path):
    out = run(RECIPES / "bare_decode_loop.py", "--max-new-tokens", "4", cwd=tmp_path)
    assert "using sdpa plus a logsumexp" in out  # the GPU kernels skip with a message on a CPU
    error = float(out.split("max |z - explain's z| = ")[1].split()[0])
    assert error <= 1e-3


def test_batch_explain_writes_one_result_per_prompt(tmp_path):
    results = tmp_path / "results.jsonl"
    run(RECIPES / "batch_explain.py", RECIPES / "example_prompts.jsonl", results, "--max-new-tokens", "3",
        "--batch-size", "2", cwd=tmp_path)
    inputs = [json.loads(line) for line in (RECIPES / "example_prompts.jsonl").read_text().splitlines()]
    outputs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [o["id"] for o in outputs] == [i["id"] for i in inputs]
    for record, result in zip(inputs, outputs):
        steps = len(result["generated_ids"])
        assert 1 <= steps <= 3
        assert len(result["step_scores"]) == steps
        assert all(len(row) == len(result["input_ids"]) for row in result["step_scores"])
        if "question" in record:
            start, stop = result["source_span"]
            assert 0 < start < stop <= len(result["input_ids"])
        else:
            assert result["source_span"] is None
