"""`torchrun --nproc-per-node 2 -m macs_kernels eval`: two real gloo ranks split the samples and append to one
results stream; the stream holds every sample once with the single-process results, and a run that died midway
(its stream cut inside a line, later lines missing) resumes with only the missing samples recomputed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from macs_kernels.apps.cli import main
from macs_kernels.apps.data_parallel import print_line
from macs_kernels.apps.evaluation.store import checksum_problem, read_results
from tests.apps.evaluation.test_resume import eval_command, results, write_data
from tests.helpers import QUESTIONS

ROOT = Path(__file__).resolve().parents[3]
PAIRS = QUESTIONS + [(q + " Answer briefly.", c) for q, c in QUESTIONS]  # 6 samples, 3 per rank
ANSWERS = ["William Shakespeare", "blue", "Paris"] * 2


def torchrun_eval(arguments: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "macs_kernels", *arguments, "--threads", "1"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def by_key(lines: list[dict]) -> dict[tuple, dict]:
    return {(line["kind"], line.get("index"), line.get("method")): line for line in lines if line["kind"] != "run"}


# What differs between two runs of the same work: when a line was written, and a cost line's measurements (with the
# checksum over them, checked on its own).
MEASURED = ("time", "seconds", "peak_bytes", "checksum")


def comparable(line: dict) -> dict:
    return {k: v for k, v in line.items() if k not in (MEASURED if line["kind"] == "cost" else ("time",))}


@pytest.mark.slow
def test_two_ranks_write_one_stream_equal_to_a_single_process(tmp_path, capsys):
    data = write_data(tmp_path / "qa.json", PAIRS, ANSWERS)
    assert main(eval_command(data, tmp_path / "single.jsonl", tmp_path / "records_single")) == 0
    single = by_key(results(tmp_path / "single.jsonl"))

    out = tmp_path / "dp.jsonl"
    run = torchrun_eval(eval_command(data, out, tmp_path / "records_dp"))
    assert "rank 0 of 2: 3 of 6 samples" in run.stdout and "rank 1 of 2: 3 of 6 samples" in run.stdout
    lines = results(out)
    assert lines[0]["kind"] == "run" and sum(line["kind"] == "run" for line in lines) == 1
    keys = [(line["kind"], line.get("index"), line.get("method")) for line in lines[1:]]
    assert len(keys) == len(set(keys)), "a line was written twice"
    parallel = by_key(lines)
    assert sorted(parallel) == sorted(single)
    for key, line in single.items():
        assert comparable(parallel[key]) == comparable(line), key
        assert checksum_problem(parallel[key]) is None, key
    assert (tmp_path / "dp.json").is_file() and "wrote" in run.stdout

    # A run that died: the stream stops inside a line, with two samples' lines missing.
    text = out.read_text().splitlines()
    dropped = {line["index"] for line in map(json.loads, text[1:]) if line["kind"] == "sample"}
    dropped = sorted(dropped)[-2:]
    kept = [t for t in text if json.loads(t).get("index") not in dropped]
    out.write_text("\n".join(kept) + "\n" + text[-1][: len(text[-1]) // 2])
    resumed = torchrun_eval(eval_command(data, out, tmp_path / "records_resumed"))
    generations = dict(re.findall(r"rank (\d) of 2: (\d+) generations this run", resumed.stdout))
    assert sorted(generations) == ["0", "1"] and sum(map(int, generations.values())) == len(dropped), resumed.stdout
    final = {key: line for key, line in read_results(out).items() if key[0] != "run"}  # skips the cut line
    assert sorted(final) == sorted(single)
    for key, line in single.items():
        assert comparable(final[key]) == comparable(line), key


def test_distributed_flag_outside_torchrun_is_refused(tmp_path):
    data = write_data(tmp_path / "qa.json", PAIRS[:1], ANSWERS[:1])
    with pytest.raises(SystemExit, match="torchrun"):
        main(eval_command(data, tmp_path / "r.jsonl", tmp_path / "records") + ["--distributed"])


def test_a_ranks_line_reaches_stdout_in_one_write(monkeypatch):
    # Unbuffered, print() writes the newline apart, and two ranks sharing the pipe joined their lines (a CI failure).
    class Recording:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    stdout = Recording()
    monkeypatch.setattr(sys, "stdout", stdout)
    print_line("eval: rank 1 of 2: 1 generations this run")
    assert stdout.writes == ["eval: rank 1 of 2: 1 generations this run\n"]
