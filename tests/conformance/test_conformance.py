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
from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

from macs_kernels import explain
from macs_kernels.core import support
from macs_kernels.engines.hf_models import attention_variants
from tests.helpers import continuous_batching_refusal, eager_norm_log_c
from tests.integration.test_integration_efficient import _efficient_reference as efficient_reference

from .conftest import TINY, eager_at2_features, eager_log_c

LOG_C_TOLERANCE = 1e-3
FEATURE_TOLERANCE = 1e-5  # attention probabilities in float32
NEW_TOKENS = 5
SHARED = "Hamlet is a tragedy written by William Shakespeare around 1600. It is set in Denmark, at Elsinore. "
PROMPTS = {
    "one": ["Why is the sky blue?"],
    "three": ["Who wrote Hamlet?", "Name a colour.", "Where is the Eiffel Tower? Answer in one word, please."],
    "shared": [SHARED * 2 + "Who wrote it?", SHARED * 2 + "Where is it set?"],
    "pressure": [SHARED + "Who wrote it?", SHARED + "When?", SHARED + "Where is it set?", SHARED + "Why?"],
}
STOP = "stop_strings"  # the layout's options stand for _stop_strings(): a string greedy decoding meets
# generate's own compile of a static cache, asked for on a CPU too (dynamo's eager backend: the graphs, not inductor).
COMPILED = CompileConfig(backend="eager")
COMPILED._compile_all_devices = True
# layout -> (prompts, generate options). Sampling layouts seed torch first.
LAYOUTS = {
    "greedy": ("one", {}),
    "sampling": ("one", {"do_sample": True, "temperature": 1.0, "top_k": 20}),
    "several": ("one", {"do_sample": True, "num_return_sequences": 2}),
    "beams": ("one", {"num_beams": 2, "num_return_sequences": 2}),
    STOP: ("one", {STOP: None}),
    "left_padded": ("three", {}),
    "shared_prefix": ("shared", {}),
    "chunked_prefill": ("three", {}),
    "cache_pressure": ("pressure", {}),
    "compiled": ("one", {"cache_implementation": "static", "compile_config": COMPILED}),
}
METHODS = {  # MACS methods: explain()'s options
    "exact": {"fused_decode": False},
    "fused": {"fused_decode": True},
    "efficient": {"attention": "efficient"},
    "norm": {"attention": "norm"},
}
AT2 = "at2"  # AT2's features (L, H, N): the mean over generated tokens of each head's attention on each input


def _stop_strings(model, tokenizer) -> list[str]:
    """The text of the third token greedy decoding makes from PROMPTS["one"] (met there first): generate stops
    after that token; the server returns the two tokens before it."""
    greedy = explain(model, tokenizer, PROMPTS["one"][0], max_new_tokens=3, backend="torch")
    stop = tokenizer.decode(greedy.generated_ids[2:3])
    assert stop.strip() and greedy.text.index(stop) == len(tokenizer.decode(greedy.generated_ids[:2])), greedy.text
    return [stop]


def _options(model, tokenizer, layout: str) -> dict:
    """The layout's generate options, its stop strings resolved."""
    options = dict(LAYOUTS[layout][1])
    if STOP in options:
        options[STOP] = _stop_strings(model, tokenizer)
    return options


def _cb_config(layout: str) -> ContinuousBatchingConfig:
    engine = {"page_size": 16, "max_batch_tokens": 256, "num_blocks": 64}
    if layout == "chunked_prefill":
        engine["max_batch_tokens"] = 16
    if layout == "cache_pressure":
        engine.update(page_size=4, num_blocks=20, max_batch_tokens=32)  # 80 cache tokens, 4 requests of ~60
    return ContinuousBatchingConfig(**engine)


def _sequences(result) -> list[tuple]:
    items = result if isinstance(result, list) else [result]
    return [(item.input_ids, item.generated_ids, item.step_log_c) for item in items]


def generate_engine(model, tokenizer, _server):
    def run(method, layout):
        prompts, options = LAYOUTS[layout][0], _options(model, tokenizer, layout)
        if STOP in options:
            options["tokenizer"] = tokenizer
        if layout == "cache_pressure":
            pytest.skip("generate has no paged cache to put under pressure")
        if layout == "chunked_prefill":
            options = {"prefill_chunk_size": 8}
        if method == AT2:
            return _generate_at2(model, tokenizer, PROMPTS[prompts], options)
        prompt = PROMPTS[prompts] if len(PROMPTS[prompts]) > 1 else PROMPTS[prompts][0]
        return _sequences(explain(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS, backend="torch",
                                  **METHODS[method], **options))

    return run


def _generate_at2(model, tokenizer, prompts, options):
    """AT2's features of generate: queries captured in the pass (QueryCapture), keys from the cache."""
    from macs_kernels.api.explanation import encode_prompts

    ids, mask, _ = encode_prompts(tokenizer, prompts)
    return traced_generate(model, ids, mask, AT2, pad_token_id=tokenizer.pad_token_id, **options)[0]


def traced_generate(model, ids, mask, method: str, **options):
    """(sequences, tracer) of model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **options) in
    attach(): per returned sequence (prompt ids, generated ids, step log c) of a MACS method, or (prompt ids,
    generated ids, AT2 features, steps) with queries captured in the pass (QueryCapture), keys from the cache."""
    from macs_kernels import attach
    from macs_kernels.apps.at2.features import QueryCapture

    capture = QueryCapture() if method == AT2 else None
    config = {} if method == AT2 else METHODS[method]
    with torch.no_grad(), attach(model, hooks=[capture] if capture else [], backend="torch", **config) as tracer:
        out = model.generate(ids, attention_mask=mask, **{"max_new_tokens": NEW_TOKENS, **options})
    steps = torch.tensor([tracer.rows(i)[0].shape[0] for i in range(tracer.sequences())])
    features = None if capture is None else capture.features(source_start=tracer.input_start,
                                                              source_end=tracer.input_end, target_end=steps)
    sequences = []
    for i, length in enumerate(steps.tolist()):
        row = i // (len(steps) // len(ids))
        prompt_ids = ids[row][mask[row].bool()]
        generated = out[i, ids.shape[1] : ids.shape[1] + length]
        found = tracer.rows(i)[0] if capture is None else features[i, :, :, : len(prompt_ids)]
        sequences.append((prompt_ids, generated, found) + (() if capture is None else (length,)))
    return sequences, tracer


offload_requests = OffloadingManager.offload_requests


def continuous_engine(model, tokenizer, _server):
    def run(method, layout):
        if continuous_batching_refusal() is not None:
            pytest.skip(continuous_batching_refusal())
        prompts, options = LAYOUTS[layout][0], _options(model, tokenizer, layout)
        offloaded = []

        def offload(manager):
            offloaded.append(offload_requests(manager))
            return offloaded[-1]

        if layout == "compiled":  # continuous batching has no compile option: a compiled forward asks for it
            model.forward, options = torch.compile(model.forward, backend="eager"), {}
        try:
            with mock.patch.object(OffloadingManager, "offload_requests", offload):
                if method == AT2:
                    result = _continuous_at2(model, tokenizer, PROMPTS[prompts], options, _cb_config(layout))
                else:
                    result = _sequences(explain(
                        model, tokenizer, PROMPTS[prompts], max_new_tokens=NEW_TOKENS, backend="torch",
                        continuous_batching=True, continuous_batching_config=_cb_config(layout), **METHODS[method],
                        **options,
                    ))
        finally:
            model.__dict__.pop("forward", None)
        if layout == "cache_pressure":
            assert any(offloaded), "the cache was not small enough to make the engine offload requests"
        return result

    return run


def _continuous_at2(model, tokenizer, prompts, options, cb_config):
    """AT2's features under continuous batching: configure(request, at2_features=True), read per request."""
    from transformers import GenerationConfig

    from macs_kernels.api.explanation import encode_prompts
    from macs_kernels.engines.continuous import attach_continuous

    inputs = [encode_prompts(tokenizer, prompt)[0][0].tolist() for prompt in prompts]
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **{"do_sample": False} | options)
    with attach_continuous(model, backend="torch") as tracer:
        for i in range(len(inputs)):
            tracer.configure(f"req_{i}", at2_features=True)
        outputs = model.generate_batch(inputs, generation_config=generation, continuous_batching_config=cb_config)
        return [(torch.tensor(output.prompt_ids), torch.tensor(output.generated_tokens),
                 tracer.at2_features(request_id), len(output.generated_tokens))
                for request_id, output in outputs.items()]


def server_engine(model, tokenizer, server):
    """The server runs with a 16-token pass budget and 128 cache tokens (conftest): every prefill is chunked,
    and concurrent requests put its cache under pressure. Sampling layouts send temperature (and top_k) with a
    seed, several sequences n = 2, stop strings the server's `stop`; every choice is checked."""
    import httpx

    def run(method, layout):
        prompts, options = LAYOUTS[layout][0], _options(model, tokenizer, layout)
        if "num_beams" in options:
            pytest.skip("OpenAI's API has no beam search option")
        if "compile_config" in options:
            pytest.skip("OpenAI's API has no compile option (the server's engine, continuous batching, is refused "
                        "a compiled forward above)")
        if options.pop("do_sample", False):
            options |= {"seed": 0, "temperature": options.get("temperature", 1.0)}
        if "num_return_sequences" in options:
            options["n"] = options.pop("num_return_sequences")
        if STOP in options:
            options["stop"] = options.pop(STOP)
        attribution = {"method": AT2} if method == AT2 else dict(METHODS[method])

        def ask(text):
            body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": NEW_TOKENS,
                    "attribution": attribution} | options
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
            if response.status_code == 400 and "is not supported under" in response.text:
                raise NotImplementedError(response.json()["error"]["message"])
            assert response.status_code == 200, response.text
            choices = response.json()["choices"]
            assert [c["index"] for c in choices] == list(range(options.get("n", 1)))
            if "stop" in options:
                assert all(c["finish_reason"] == "stop" for c in choices), choices
            return [c["attribution"] for c in choices]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS[prompts])) as pool:
            answers = [a for choices in pool.map(ask, PROMPTS[prompts]) for a in choices]
        if method == AT2:  # the server answers AT2's scores: the features weighted by the coefficients
            return [(torch.tensor(a["input_ids"]), torch.tensor(a["generated_ids"]), torch.tensor(a["at2_scores"]),
                     len(a["generated_ids"])) for a in answers]
        return [
            (torch.tensor(a["input_ids"]), torch.tensor(a["generated_ids"]),
             torch.tensor([[float("-inf") if v is None else v for v in row] for row in a["step_log_c"]]))
            for a in answers
        ]

    return run


ENGINES = {"generate": generate_engine, "continuous": continuous_engine, "server": server_engine}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", [*METHODS, AT2])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_rows_equal_the_teacher_forced_reference_or_are_refused(engine, method, layout, chat_model, request):
    model, tokenizer = chat_model
    server = request.getfixturevalue("conformance_server") if engine == "server" else None
    run = ENGINES[engine](model, tokenizer, server)
    check_rows_or_refusal(model, run, engine, method, layout, [support.message(engine, method, layout)], request)


def check_rows_or_refusal(model, run, engine: str, method: str, layout: str, refusals: list, request,
                          efficient=None) -> None:
    """run(method, layout) raises one of the `refusals` (None entries ignored), or returns rows (or AT2 features)
    equal to the teacher-forced eager reference of each returned sequence (efficient: the efficient rows'
    reference (model, prompt ids, generated ids) -> step log c, default the eager rows projected by
    ops.efficient_attention)."""
    refusals = [refusal for refusal in refusals if refusal is not None]
    torch.manual_seed(0)
    if refusals:
        with pytest.raises(NotImplementedError) as refused:
            run(method, layout)
        assert any(refusal in str(refused.value) for refusal in refusals), str(refused.value)
        return
    sequences = run(method, layout)
    expected = len(PROMPTS[LAYOUTS[layout][0]]) * LAYOUTS[layout][1].get("num_return_sequences", 1)
    assert len(sequences) == expected
    if layout == STOP:  # the stop string ended every sequence early (its tokens are the engine's to keep or not)
        assert all(len(sequence[1]) < NEW_TOKENS for sequence in sequences)
    if layout in ("sampling", "several") and engine == "server":  # a seed: the same answers on a second run
        assert [s[1].tolist() for s in run(method, layout)] == [s[1].tolist() for s in sequences]
    assert_sequences_equal_the_reference(model, method, sequences, request, efficient)


def assert_sequences_equal_the_reference(model, method: str, sequences, request, efficient=None) -> None:
    """Each returned sequence's rows (or AT2 features) equal the teacher-forced eager reference of its own tokens
    (see check_rows_or_refusal)."""
    if method == AT2:
        for prompt_ids, generated_ids, features, steps in sequences:
            assert steps > 0 and features.shape[-1] == len(prompt_ids)
            reference = eager_at2_features(model, prompt_ids, generated_ids, steps)
            if features.dim() == 1:
                theta = request.getfixturevalue("at2_theta")[1].double()
                reference = torch.einsum("lh,lhn->n", theta, reference)
            assert (features.double() - reference).abs().max() <= FEATURE_TOLERANCE * max(1.0, reference.abs().max())
        return
    for prompt_ids, generated_ids, log_c in sequences:
        assert log_c.shape == (len(generated_ids), len(prompt_ids)) and len(generated_ids) > 0
        if method == "efficient":
            reference = (efficient or (lambda *args: efficient_reference(*args)[0]))(model, prompt_ids, generated_ids)
        elif method == "norm":
            reference = eager_norm_log_c(model, prompt_ids, generated_ids)
        else:
            reference = eager_log_c(model, prompt_ids, generated_ids)
        finite = torch.isfinite(reference)
        assert torch.equal(torch.isfinite(log_c), finite)
        assert (log_c.double()[finite] - reference[finite]).abs().max() <= LOG_C_TOLERANCE


def test_server_seeded_sampling_under_cache_pressure_draws_what_each_request_draws_alone(conformance_server,
                                                                                         chat_model):
    """Four seeded sampling requests at once on the server's small cache (conftest: every prefill chunked, room
    for two of them) get the tokens each gets alone, with rows equal to the teacher-forced reference."""
    import httpx

    model, _ = chat_model

    def ask(i):
        body = {"model": TINY, "messages": [{"role": "user", "content": PROMPTS["pressure"][i]}],
                "max_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 100 + i, "attribution": True}
        response = httpx.post(conformance_server.url + "/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["attribution"]

    alone = [ask(i) for i in range(len(PROMPTS["pressure"]))]
    with concurrent.futures.ThreadPoolExecutor(len(alone)) as pool:
        together = list(pool.map(ask, range(len(alone))))
    assert [a["generated_ids"] for a in together] == [a["generated_ids"] for a in alone]
    for answer in together:
        log_c = torch.tensor([[float("-inf") if v is None else v for v in row] for row in answer["step_log_c"]])
        reference = eager_log_c(model, torch.tensor(answer["input_ids"]), torch.tensor(answer["generated_ids"]))
        assert (log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE


def tensor_parallel_engines() -> list[tuple[str, dict]]:
    """The engines tp_worker.py runs, with explain's options: continuous batching only where it is not refused before
    any work (transformers < 5.19; the refusal is tests/integration/test_continuous_versions.py's)."""
    engines = [("generate", {})]
    if continuous_batching_refusal() is None:
        engines.append(("continuous", {"continuous_batching": True}))
    return engines


def check_tensor_parallel_ranks(model, folder, out, *worker_args, efficient=None) -> None:
    """tp_worker.py on two ranks over the model saved in `folder` (each rank with half the query and KV heads):
    both ranks return the same rows, equal to the single-process eager reference of their tokens, in generate
    and in continuous batching alike where it runs (efficient: as in check_rows_or_refusal)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(root / "tests" / "conformance" / "tp_worker.py"), str(folder), str(out), *worker_args]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert set(ranks[0]) == {f"{engine}-{method}" for engine, _ in tensor_parallel_engines() for method in METHODS}
    # A model with attention variants may be refused for one of them before tensor parallelism is looked at.
    layouts = ("tensor_parallel", *attention_variants(model))
    for name, sequences in ranks[0].items():
        engine, method = name.split("-")
        refusals = [r for r in (support.message(engine, method, layout) for layout in layouts) if r is not None]
        if refusals:
            assert any(r in sequences for r in refusals) and ranks[1][name] == sequences, (name, sequences)
            continue
        assert len(sequences) == len(PROMPTS["three"])
        for (prompt_ids, generated_ids, log_c), other in zip(sequences, ranks[1][name]):
            torch.testing.assert_close(other[2], log_c, rtol=0, atol=1e-5, msg=f"rank 1 differs in {name}")
            if name.endswith("efficient"):
                reference = (efficient or (lambda *args: efficient_reference(*args)[0]))(model, prompt_ids,
                                                                                         generated_ids)
            else:
                reference = eager_log_c(model, prompt_ids, generated_ids)
            assert (log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE, name


@pytest.mark.slow
def test_tensor_parallel_ranks_equal_the_reference(chat_model, chat_model_folder, tmp_path):
    """Two ranks, each with 2 of the 4 query heads and 1 of the 2 KV heads: head pooling is reduced across the
    group by the core."""
    check_tensor_parallel_ranks(chat_model[0], chat_model_folder, tmp_path)
