"""MACS and AT2 under tensor parallelism: the default model split three ways over real gloo processes (torchrun,
tp_plan="auto", 3 of its 9 query and 1 of its 3 KV heads per rank). Every rank must return the same rows, equal to
a single-process teacher-forced trace of the same tokens."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from macs_kernels import explain, trace_tensors
from macs_kernels.api.prompts import qa_messages
from tests.helpers import QUESTIONS, default_model

ROOT = Path(__file__).resolve().parents[2]
RANKS = 3
TOLERANCE = 1e-3


def run_torchrun(out: Path, mode: str) -> list[dict]:
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--standalone",
               str(ROOT / "tests" / "distributed" / "tp_worker.py"), str(out), mode]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]


def assert_same_on_every_rank(saved: list[dict]) -> None:
    for rank in range(1, RANKS):
        for name, fields in saved[0].items():
            for field, value in fields.items():
                torch.testing.assert_close(saved[rank][name][field], value, rtol=0, atol=1e-5,
                                           msg=f"rank {rank} differs from rank 0 in {name}.{field}")


def assert_equals_single_process(record: dict, name: str, **config) -> None:
    model, _ = default_model()
    traced = trace_tensors(model, record["input_ids"], record["generated_ids"], backend="torch", **config)
    assert record["step_log_c"].shape == traced.log_c.shape, name
    difference = (record["step_log_c"] - traced.log_c).abs().max().item()
    assert difference <= TOLERANCE, f"{name}: max |d log c| = {difference}"


@pytest.fixture(scope="module")
def explained_runs(tmp_path_factory):
    return run_torchrun(tmp_path_factory.mktemp("tp"), "explain")


def test_every_rank_returns_the_single_process_rows(explained_runs):
    assert_same_on_every_rank(explained_runs)
    for name in ("greedy", "batch0", "batch1"):
        assert_equals_single_process(explained_runs[0][name], name)


@pytest.mark.slow
def test_every_entry_point_under_tensor_parallelism(tmp_path):
    saved = run_torchrun(tmp_path, "all")
    assert_same_on_every_rank(saved)
    record = saved[0]
    for name in ("greedy", "batch0", "batch1", "sampled", "fused"):
        assert_equals_single_process(record[name], name)
    assert_equals_single_process(record["mean_pool"], "mean_pool", pooling="mean")
    model, tokenizer = default_model()
    efficient = explain(model, tokenizer, qa_messages(*QUESTIONS[0]), max_new_tokens=3, attention="efficient")
    assert torch.equal(efficient.generated_ids, record["efficient"]["generated_ids"])
    assert (efficient.step_log_c - record["efficient"]["step_log_c"]).abs().max() <= TOLERANCE
    greedy = record["greedy"]
    single = trace_tensors(model, greedy["input_ids"], greedy["generated_ids"], at2=True, backend="torch")
    assert record["trace"]["at2_features"].shape == single.at2_features.shape  # global heads, in global order
    assert (record["trace"]["at2_features"] - single.at2_features).abs().max() <= 1e-5
    assert (record["trace"]["pooled"] - single.pooled).abs().max() <= 1e-5
    attached = record["attach"]
    assert (attached["step_log_c"] - trace_tensors(model, greedy["input_ids"], attached["generated_ids"]).log_c
            ).abs().max() <= TOLERANCE


UNEVEN_WORKER = """
import sys, torch
from transformers import AutoModelForCausalLM
import macs_kernels
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto").eval()
try:
    macs_kernels.trace_tensors(model, torch.tensor([1, 2, 3]), torch.tensor([4, 5]))
except NotImplementedError as error:
    print("REFUSED:", error)
"""


def test_heads_that_do_not_split_evenly_are_refused(tmp_path):
    """6 query / 3 KV heads over 2 ranks: transformers loads it, MACS refuses before any pass, naming why."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # An even vocabulary: transformers 5.17 refuses an lm_head that does not split over the ranks before MACS looks.
    config = LlamaConfig(vocab_size=98, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    (tmp_path / "worker.py").write_text(UNEVEN_WORKER)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(tmp_path / "worker.py"), str(tmp_path / "model")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks print to one pipe: their lines can interleave, so count the messages, not the lines.
    assert result.stdout.count("REFUSED:") == 2
    assert result.stdout.count("do not split evenly over 2 tensor-parallel ranks") == 2


@pytest.mark.slow
def test_tp_explain_recipe_runs_under_torchrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
         str(ROOT / "python" / "tp_explain.py"), "--max-new-tokens", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{RANKS} ranks; answer:" in result.stdout and "top prompt tokens" in result.stdout
