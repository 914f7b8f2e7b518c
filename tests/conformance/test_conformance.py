"""One conformance suite for every engine: engine x method x layout either returns, for every sequence, rows
whose step_log_c equals a teacher-forced eager `output_attentions` trace of that sequence's own tokens, or is
refused before any work by the core's one check (macs_kernels.core.support), with its one message.

An engine joins by adding one entry to ENGINES: a function (model, tokenizer, server) -> run(method, layout)
that returns [(prompt ids, generated ids, step_log_c)] per returned sequence, going through the engine's
public entry point.
"""
from __future__ import annotations

import concurrent.futures
from unittest import mock

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

from macs_kernels import explain
from macs_kernels.core import support
from tests.integration.test_integration_efficient import _efficient_reference as efficient_reference

from .conftest import TINY, eager_log_c

LOG_C_TOLERANCE = 1e-3
NEW_TOKENS = 5
SHARED = "Hamlet is a tragedy written by William Shakespeare around 1600. It is set in Denmark, at Elsinore. "
PROMPTS = {
    "one": ["Why is the sky blue?"],
    "three": ["Who wrote Hamlet?", "Name a colour.", "Where is the Eiffel Tower? Answer in one word, please."],
    "shared": [SHARED * 2 + "Who wrote it?", SHARED * 2 + "Where is it set?"],
    "pressure": [SHARED + "Who wrote it?", SHARED + "When?", SHARED + "Where is it set?", SHARED + "Why?"],
}
# layout -> (prompts, generate options). Sampling layouts seed torch first.
LAYOUTS = {
    "greedy": ("one", {}),
    "sampling": ("one", {"do_sample": True, "temperature": 1.0, "top_k": 20}),
    "several": ("one", {"do_sample": True, "num_return_sequences": 2}),
    "beams": ("one", {"num_beams": 2, "num_return_sequences": 2}),
    "left_padded": ("three", {}),
    "shared_prefix": ("shared", {}),
    "chunked_prefill": ("three", {}),
    "cache_pressure": ("pressure", {}),
}
METHODS = {
    "exact": {"fused_decode": False},
    "fused": {"fused_decode": True},
    "efficient": {"attention": "efficient"},
}


def _sequences(result) -> list[tuple]:
    items = result if isinstance(result, list) else [result]
    return [(item.input_ids, item.generated_ids, item.step_log_c) for item in items]


def generate_engine(model, tokenizer, _server):
    def run(method, layout):
        prompts, options = LAYOUTS[layout]
        if layout == "cache_pressure":
            pytest.skip("generate has no paged cache to put under pressure")
        if layout == "chunked_prefill":
            options = {"prefill_chunk_size": 8}
        prompt = PROMPTS[prompts] if len(PROMPTS[prompts]) > 1 else PROMPTS[prompts][0]
        return _sequences(explain(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS, backend="torch",
                                  **METHODS[method], **options))

    return run


offload_requests = OffloadingManager.offload_requests


def continuous_engine(model, tokenizer, _server):
    def run(method, layout):
        prompts, options = LAYOUTS[layout]
        engine = {"page_size": 16, "max_batch_tokens": 256, "num_blocks": 64}
        if layout == "chunked_prefill":
            engine["max_batch_tokens"] = 16
        if layout == "cache_pressure":
            engine.update(page_size=4, num_blocks=20, max_batch_tokens=32)  # 80 cache tokens, 4 requests of ~60
        offloaded = []

        def offload(manager):
            offloaded.append(offload_requests(manager))
            return offloaded[-1]

        with mock.patch.object(OffloadingManager, "offload_requests", offload):
            result = explain(model, tokenizer, PROMPTS[prompts], max_new_tokens=NEW_TOKENS, backend="torch",
                             continuous_batching=True, continuous_batching_config=ContinuousBatchingConfig(**engine),
                             **METHODS[method], **options)
        if layout == "cache_pressure":
            assert any(offloaded), "the cache was not small enough to make the engine offload requests"
        return _sequences(result)

    return run


def server_engine(_model, _tokenizer, server):
    """The server runs with a 16-token pass budget and 128 cache tokens (conftest): every prefill is chunked,
    and concurrent requests put its cache under pressure."""
    import httpx

    def run(method, layout):
        prompts, options = LAYOUTS[layout]
        if options:
            pytest.skip("the server's sampling options are issue 27's (not in this suite yet)")
        attribution = {key: value for key, value in METHODS[method].items()}

        def ask(text):
            body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": NEW_TOKENS,
                    "attribution": attribution}
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["attribution"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS[prompts])) as pool:
            answers = list(pool.map(ask, PROMPTS[prompts]))
        return [
            (torch.tensor(a["input_ids"]), torch.tensor(a["generated_ids"]),
             torch.tensor([[float("-inf") if v is None else v for v in row] for row in a["step_log_c"]]))
            for a in answers
        ]

    return run


ENGINES = {"generate": generate_engine, "continuous": continuous_engine, "server": server_engine}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_rows_equal_the_teacher_forced_reference_or_are_refused(engine, method, layout, chat_model, request):
    model, tokenizer = chat_model
    server = request.getfixturevalue("conformance_server") if engine == "server" else None
    run = ENGINES[engine](model, tokenizer, server)
    reason = support.unsupported(engine, method, layout)
    torch.manual_seed(0)
    if reason is not None:
        with pytest.raises(NotImplementedError) as refusal:
            run(method, layout)
        assert str(refusal.value).endswith(reason) and support.LAYOUTS[layout] in str(refusal.value)
        return
    sequences = run(method, layout)
    expected = len(PROMPTS[LAYOUTS[layout][0]]) * LAYOUTS[layout][1].get("num_return_sequences", 1)
    assert len(sequences) == expected
    for prompt_ids, generated_ids, log_c in sequences:
        assert log_c.shape == (len(generated_ids), len(prompt_ids)) and len(generated_ids) > 0
        if method == "efficient":
            reference, _ = efficient_reference(model, prompt_ids, generated_ids)
        else:
            reference = eager_log_c(model, prompt_ids, generated_ids)
        finite = torch.isfinite(reference)
        assert torch.equal(torch.isfinite(log_c), finite)
        assert (log_c.double()[finite] - reference[finite]).abs().max() <= LOG_C_TOLERANCE


@pytest.mark.slow
def test_tensor_parallel_ranks_equal_the_reference(chat_model, chat_model_folder, tmp_path):
    """Two ranks, each with 2 of the 4 query heads and 1 of the 2 KV heads: head pooling is reduced across the
    group by the core, in generate and in continuous batching alike."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(root / "tests" / "conformance" / "tp_worker.py"), str(chat_model_folder), str(tmp_path)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model, _ = chat_model
    assert set(ranks[0]) == {f"{engine}-{method}" for engine in ("generate", "continuous") for method in METHODS}
    for name, sequences in ranks[0].items():
        assert len(sequences) == len(PROMPTS["three"])
        for (prompt_ids, generated_ids, log_c), other in zip(sequences, ranks[1][name]):
            torch.testing.assert_close(other[2], log_c, rtol=0, atol=1e-5, msg=f"rank 1 differs in {name}")
            if name.endswith("efficient"):
                reference, _ = efficient_reference(model, prompt_ids, generated_ids)
            else:
                reference = eager_log_c(model, prompt_ids, generated_ids)
            assert (log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE, name
