"""Every recipe in python/ runs as it is (on CPU, few new tokens)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
        start, stop = result["source_span"]
        assert 0 < start < stop <= len(result["input_ids"])
        if "prompt" in record:  # a free prompt's span is the user's own text
            assert "".join(result["input_tokens"][start:stop]).strip() == record["prompt"]


@pytest.mark.slow  # two worker processes load the default model: ~30 s
def test_batch_explain_data_parallel_resumes_with_every_prompt_once(tmp_path):
    """Two torchrun ranks append to one output; ids already there (an earlier, stopped run) are skipped, and
    each result equals the single-process run's."""
    inputs = tmp_path / "prompts.jsonl"
    lines = (RECIPES / "example_prompts.jsonl").read_text().splitlines()
    inputs.write_text("\n".join(lines + [json.dumps({"id": "extra", "prompt": "Name a colour."})]) + "\n")
    single = tmp_path / "single.jsonl"
    run(RECIPES / "batch_explain.py", inputs, single, "--max-new-tokens", "3", cwd=tmp_path)
    expected = {str(r["id"]): r for r in map(json.loads, single.read_text().splitlines())}
    stopped = tmp_path / "parallel.jsonl"
    first = single.read_text().splitlines()[0]
    stopped.write_text(first + "\n" + first[: len(first) // 3])  # one result, then a line cut by a kill
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              RECIPES / "batch_explain.py", inputs, stopped, "--max-new-tokens", "3", cwd=tmp_path)
    assert "holds 4 results (1 from an earlier run)" in out
    results = []
    for line in stopped.read_text().splitlines():
        try:
            results.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    assert sorted(str(r["id"]) for r in results) == sorted(expected)
    for result in results:
        reference = expected[str(result["id"])]
        assert result["generated_ids"] == reference["generated_ids"]
        assert max(abs(a - b) for row, ref in zip(result["step_log_c"], reference["step_log_c"])
                   for a, b in zip(row, ref) if a is not None) <= 1e-4
