"""MACS under transformers continuous batching: packed passes, chunked prefill, shared prefixes, streaming
readers; rows against explain() of each prompt alone and against the independent eager reference."""
import re
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from macs_kernels import explain
from macs_kernels.api.explanation import explain_continuous
from macs_kernels.engines.continuous import (
    Segments,
    _check_manager,
    attach_continuous,
    macs_pool_packed,
)
from macs_kernels.ops import reference
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, default_model, eager_macs, qa, tiny_llama
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = NEEDS_CONTINUOUS_BATCHING

LOG_C_TOLERANCE = 1e-3
GREEDY = {"do_sample": False, "eos_token_id": -1, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.fixture
def tiny():
    model = tiny_llama(heads=6, kv_heads=2)  # GQA 3:1
    model.set_attn_implementation("sdpa")
    return model


class PassLog:
    """Query tokens of every continuous-batching forward pass (teacher-forced reference forwards excluded)."""

    def __init__(self, model):
        self.tokens = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if "cu_seq_lens_q" in kwargs:
            self.tokens.append(kwargs["position_ids"].shape[1])

    def remove(self):
        self.handle.remove()


def cb_config(max_batch_tokens, page_size=4, num_blocks=48):
    # A small cache: sized from free memory, it would take most of a test's time to allocate.
    return ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, page_size=page_size, num_blocks=num_blocks)


def run_batch(model, prompts, max_new_tokens, budget, **config):
    """generate_batch inside attach_continuous; (outputs in prompt order, rows per request, query tokens per pass)."""
    passes = PassLog(model)
    try:
        with attach_continuous(model, **config) as tracer:
            outputs = model.generate_batch(
                prompts, generation_config=GenerationConfig(max_new_tokens=max_new_tokens, **GREEDY),
                continuous_batching_config=cb_config(budget),
            )
            rows = {request_id: tracer.request_rows(request_id) for request_id in outputs}
    finally:
        passes.remove()
    return list(outputs.values()), list(rows.values()), passes.tokens


def assert_rows_match_reference(model, prompt, output, rows, **config):
    log_c, scores = rows
    generated = torch.tensor(output.generated_tokens)
    assert list(output.prompt_ids) == prompt
    assert log_c.shape == scores.shape == (len(generated), len(prompt))
    assert log_c.dtype == scores.dtype == torch.float32
    log_ref, _ = eager_macs(model, torch.tensor(prompt), generated, **config)
    assert (log_c.double() - log_ref).abs().max() <= LOG_C_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooling", ["max", "mean", "min"])
@pytest.mark.parametrize("redistribute", [True, False, "mixed"])
def test_macs_pool_packed_matches_float64_reference(dtype, pooling, redistribute):
    """Rows over a packed key tensor (a 37-key segment of a non-emitting prefill chunk between them), GQA 3:1,
    odd lengths; against the float64 reference of ops.macs_pool with per-row ranges."""
    heads, kv_heads, dim = 9, 3, 16
    starts, lengths, n_input = [0, 150, 157], [113, 7, 40], [100, 7, 33]
    flags = [True, False, True] if redistribute == "mixed" else [redistribute] * 3
    q = torch.randn(heads, 3, dim, dtype=dtype) * 2
    key = torch.randn(kv_heads, 197, dim, dtype=dtype)
    segments = Segments(starts, lengths, n_input, flags, torch.device("cpu"))
    got = macs_pool_packed(q, key, segments, scale=dim**-0.5, pooling=pooling)
    assert got.dtype == torch.float32 and got.shape == (3, 100)
    for r, flag in enumerate(flags):
        ref = reference.macs_pool_reference(
            q[:, r : r + 1].unsqueeze(0), key.unsqueeze(0), input_start=[[starts[r]]],
            input_end=[[starts[r] + n_input[r]]], kv_len=[[starts[r] + lengths[r]]], scale=dim**-0.5,
            pooling=pooling, redistribute=flag,
        )[0, 0]
        assert relative_error(got[r, : n_input[r]], ref) <= RELATIVE_ERROR[dtype]


def test_macs_pool_packed_refuses_bad_ranges():
    with pytest.raises(ValueError, match="n_input"):
        Segments([0], [5], [6], [True], torch.device("cpu"))
    segments = Segments([0, 10], [10, 5], [4, 5], [True, True], torch.device("cpu"))
    with pytest.raises(ValueError, match="inside the key tensor"):
        macs_pool_packed(torch.randn(4, 2, 8), torch.randn(2, 12, 8), segments, scale=1.0)
    with pytest.raises(ValueError, match="pooling"):
        macs_pool_packed(torch.randn(4, 2, 8), torch.randn(2, 15, 8), segments, scale=1.0, pooling="sum")


def test_packed_requests_with_chunked_prefill_match_reference(tiny):
    prompts = [list(range(1, 12)), [1, 5, 6, 7, 20, 21], list(range(30, 47)), [3, 4]]
    outputs, rows, passes = run_batch(tiny, prompts, max_new_tokens=5, budget=8)
    assert max(passes) <= 8 and max(map(len, prompts)) > 8, "prefills must be split into chunks"
    assert max(passes) > 1 and passes.count(1) < len(passes), "requests must share passes"
    for prompt, output, request_rows in zip(prompts, outputs, rows):
        assert_rows_match_reference(tiny, prompt, output, request_rows)


def test_shared_prefix_blocks_match_reference(tiny):
    prefix = list(range(2, 22))
    prompts = [prefix + [40, 41, 42], prefix + [50, 51], [1, 60, 61, 62, 63]]
    outputs, rows, passes = run_batch(tiny, prompts, max_new_tokens=4, budget=16)
    computed_without_sharing = sum(map(len, prompts)) + len(prompts) * 3
    assert sum(passes) <= computed_without_sharing - 16, "the common prefix must be read from shared blocks"
    for prompt, output, request_rows in zip(prompts, outputs, rows):
        assert_rows_match_reference(tiny, prompt, output, request_rows)


def test_eager_implementation_is_traced_through_paged_eager(tiny):
    tiny.set_attn_implementation("eager")
    prompts = [list(range(1, 10)), [7, 8, 9]]
    outputs, rows, _ = run_batch(tiny, prompts, max_new_tokens=3, budget=8)
    assert tiny.config._attn_implementation == "eager"
    for prompt, output, request_rows in zip(prompts, outputs, rows):
        assert_rows_match_reference(tiny, prompt, output, request_rows)


def test_per_request_configuration_in_one_batch(tiny):
    configs = [{"alpha": 0.5, "pooling": "mean"}, {"redistribute": False}, {"alpha": 1.0, "pooling": "min"}, {}]
    prompts = [list(range(1, 9)), list(range(10, 15)), list(range(20, 31)), [40, 41, 42]]
    gen = GenerationConfig(max_new_tokens=3, **GREEDY)
    with attach_continuous(tiny) as tracer:
        manager = tiny.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(64))
        manager.start()
        try:
            for i, config in enumerate(configs):
                tracer.configure(f"r{i}", **config)
            ids = [manager.add_request(prompt, request_id=f"r{i}") for i, prompt in enumerate(prompts)]
            outputs = {}
            while len(outputs) < len(ids):
                output = manager.get_result(timeout=30)
                assert output is not None, "the manager stopped answering"
                outputs[output.request_id] = output
        finally:
            manager.stop(block=True)
        for request_id, prompt, config in zip(ids, prompts, configs):
            log_c, _ = tracer.request_rows(request_id)
            generated = torch.tensor(outputs[request_id].generated_tokens)
            log_ref, _ = eager_macs(tiny, torch.tensor(prompt), generated, **config)
            finite = torch.isfinite(log_ref)
            assert torch.equal(torch.isfinite(log_c), finite)
            assert (log_c.double()[finite] - log_ref[finite]).abs().max() <= LOG_C_TOLERANCE


def test_streaming_reader_sees_one_row_per_token_then_release(tiny):
    prompt = list(range(1, 14))
    gen = GenerationConfig(max_new_tokens=6, **GREEDY)
    seen, errors = [], []
    with attach_continuous(tiny) as tracer:
        manager = tiny.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(8))
        manager.start()
        try:
            other = manager.add_request(list(range(40, 60)), request_id="other")
            request_id = manager.add_request(prompt, request_id="streamed", streaming=True)

            def consume():
                try:
                    for output in manager.request_id_iter(request_id):
                        log_c, _ = tracer.request_rows(request_id)
                        seen.append((len(output.generated_tokens), log_c.shape[0], output))
                except Exception as error:  # noqa: BLE001 - reported in the test thread
                    errors.append(error)

            reader = threading.Thread(target=consume)
            reader.start()
            reader.join(timeout=120)
        finally:
            manager.stop(block=True)
        assert not errors and seen, errors
        assert all(steps >= tokens for tokens, steps, _ in seen), "a token arrived before its row"
        assert seen[-1][0] == 6
        assert tracer.request_input_count(request_id) == len(prompt)
        assert_rows_match_reference(tiny, prompt, seen[-1][2], tracer.request_rows(request_id))
        tracer.release(request_id)
        with pytest.raises(KeyError, match="released"):
            tracer.request_rows(request_id)
        tracer.release(request_id)  # idempotent
        assert tracer.request_rows(other)[0].shape[0] == 6


def test_finished_requests_beyond_keep_finished_are_dropped(tiny):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    gen = GenerationConfig(max_new_tokens=2, **GREEDY)
    with attach_continuous(tiny, keep_finished=0) as tracer:
        tiny.generate_batch(prompts[:2], generation_config=gen, continuous_batching_config=cb_config(64),
                            persistent_manager=True)
        try:
            tiny.generate_batch(prompts[2:], generation_config=gen, persistent_manager=True)
            # The second run's first pass retires the first run's finished requests.
            for request_id in ("req_0", "req_1"):
                with pytest.raises(KeyError, match="keep_finished=0"):
                    tracer.request_rows(request_id)
            assert tracer.request_rows("req_2")[0].shape == (2, 2)
        finally:
            tiny.destroy_cached_continuous_batching_manager()


def test_request_ids_reused_by_a_new_manager_start_new_rows(tiny):
    gen = GenerationConfig(max_new_tokens=2, **GREEDY)
    with attach_continuous(tiny) as tracer:
        for prompt in ([1, 2, 3, 4, 5, 6], [7, 8, 9]):
            outputs = tiny.generate_batch([prompt], generation_config=gen, continuous_batching_config=cb_config(64))
            assert list(outputs) == ["req_0"]
            assert_rows_match_reference(tiny, prompt, outputs["req_0"], tracer.request_rows("req_0"))


def model_state(model) -> dict:
    """What attaching may touch: transformers' registries, the model's implementation and attributes."""
    return {
        "attention": dict(AttentionInterface._global_mapping),
        "attention_local": dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
        "masks": dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping),
        "masks_local": dict(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping),
        "implementation": model.config._attn_implementation,
        "attributes": dict(vars(model)),
        "module_attributes": [dict(vars(module)) for module in model.modules()],
    }


def test_leaving_attach_restores_model_and_registries(tiny):
    gen = GenerationConfig(max_new_tokens=3, **GREEDY)
    prompts = [list(range(1, 12)), [5, 6, 7]]
    before = model_state(tiny)
    plain = tiny.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config(8))
    with attach_continuous(tiny) as tracer:
        assert AttentionInterface._global_mapping["sdpa"] is not before["attention"]["sdpa"]
        traced = tiny.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config(8))
        # Outside continuous batching the wrapper is the original implementation.
        ids = torch.tensor([prompts[0]])
        assert torch.equal(tiny(ids).logits, tiny(ids).logits)
    after = model_state(tiny)
    assert after == before
    assert [o.generated_tokens for o in traced.values()] == [o.generated_tokens for o in plain.values()]
    assert all(tracer.request_rows(request_id)[0].shape[0] == 3 for request_id in traced)


def test_unsupported_modes_raise_before_generation(tiny):
    with pytest.raises(ValueError, match="alpha"), attach_continuous(tiny, alpha=0.0):
        pass
    gen = GenerationConfig(max_new_tokens=2, num_return_sequences=2, do_sample=True, eos_token_id=-1, pad_token_id=0)
    with attach_continuous(tiny), pytest.raises(NotImplementedError, match="num_return_sequences"):
        tiny.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(8))
    with attach_continuous(tiny) as tracer:
        with pytest.raises(ValueError, match="per request"):
            tracer.configure("r", backend="torch")
        with pytest.raises(KeyError, match="no MACS rows"):
            tracer.request_rows("never-added")
    with pytest.raises(ValueError, match="prompts"):
        explain_continuous(tiny, None, [])
    assert tiny.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("attention", "options", "returned", "refusal"),
    [
        ("flash_attention_2", {}, 1, "macs_pool_paged scores such a cache"),
        ("paged|flash_attention_2", {}, 1, "auto_switch_to_flash=False"),
        ("sdpa", {"use_async_batching": True}, 1, "use_async_batching"),
        ("sdpa", {"use_cuda_graph": True}, 1, "use_cuda_graph=False"),
        ("sdpa", {}, 2, "num_return_sequences"),
    ],
)
def test_managers_the_tracer_cannot_follow_are_refused(attention, options, returned, refusal):
    config = ContinuousBatchingConfig(page_size=4, num_blocks=8, max_batch_tokens=8, **options)
    manager = SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(_attn_implementation=attention)),
        continuous_batching_config=config, num_return_sequences=returned,
    )
    with pytest.raises(NotImplementedError, match=re.escape(refusal)):
        _check_manager(manager)


def test_an_sdpa_manager_passes_the_checks():
    config = ContinuousBatchingConfig(page_size=4, num_blocks=8, max_batch_tokens=8, use_cuda_graph=False)
    manager = SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")),
        continuous_batching_config=config, num_return_sequences=1,
    )
    _check_manager(manager)


def test_manager_created_before_attach_needs_track(tiny):
    gen = GenerationConfig(max_new_tokens=2, **GREEDY)
    manager = tiny.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(64))
    with attach_continuous(tiny) as tracer:
        manager.start()
        try:
            untracked = manager.add_request([1, 2, 3], request_id="untracked")
            assert manager.get_result(request_id=untracked, timeout=30) is not None
            with pytest.raises(KeyError, match="track"):
                tracer.request_rows(untracked)
            tracer.track(manager)
            tracked = manager.add_request([4, 5, 6, 7], request_id="tracked")
            output = manager.get_result(request_id=tracked, timeout=30)
        finally:
            manager.stop(block=True)
        assert_rows_match_reference(tiny, [4, 5, 6, 7], output, tracer.request_rows(tracked))


def explain_default_batch(model, tokenizer, prompts):
    """explain_continuous with prefills split into 64-token chunks and the chat template's common prefix
    shared between requests (both checked)."""
    passes = PassLog(model)
    try:
        batch = explain_continuous(
            model, tokenizer, prompts, max_new_tokens=5,
            continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=64, page_size=16),
        )
    finally:
        passes.remove()
    lengths = [len(item.input_ids) for item in batch]
    assert len(set(lengths)) == len(prompts) and max(lengths) > 64
    assert max(passes.tokens) <= 64
    assert sum(passes.tokens) < sum(lengths) + 4 * len(prompts), "the chat template's prefix must be shared"
    return batch


DEFAULT_PROMPTS = [qa(0), "Name a primary colour.", qa(2)]


def test_default_model_rows_match_teacher_forced_reference(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    for item in explain_default_batch(model, tokenizer, DEFAULT_PROMPTS):
        assert item.step_log_c.shape == item.step_scores.shape == (len(item.generated_ids), len(item.input_ids))
        log_ref, _ = eager_macs(model, item.input_ids, item.generated_ids)
        assert (item.step_log_c.double() - log_ref).abs().max() <= LOG_C_TOLERANCE


@pytest.mark.slow
def test_default_model_rows_equal_explain_alone(model_and_tokenizer):
    """Each request's rows and tokens equal explain() of its prompt alone (three generate() runs: slow on a
    busy machine)."""
    model, tokenizer = model_and_tokenizer
    for prompt, item in zip(DEFAULT_PROMPTS, explain_default_batch(model, tokenizer, DEFAULT_PROMPTS)):
        alone = explain(model, tokenizer, prompt, max_new_tokens=5, backend="torch")
        assert torch.equal(item.input_ids, alone.input_ids)
        assert torch.equal(item.generated_ids, alone.generated_ids)
        assert item.input_tokens == alone.input_tokens and item.text == alone.text
        assert (item.step_log_c - alone.step_log_c).abs().max() <= LOG_C_TOLERANCE
        assert item.config == alone.config


def test_attach_hands_generate_batch_to_the_continuous_tracer_and_restores_the_model(tiny):
    """`with macs_kernels.attach(model) as tracer:` around generate_batch: request_rows per request, each equal
    to the eager reference; leaving the block restores the model exactly; generate is refused in that block."""
    import macs_kernels

    prompts = [list(range(1, 12)), [5, 6, 7, 8]]
    with macs_kernels.attach(tiny):  # registers the tracer's attention names, once per process
        pass
    before = model_state(tiny)
    with macs_kernels.attach(tiny) as tracer:
        outputs = tiny.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=3, **GREEDY),
                                      continuous_batching_config=cb_config(8))
        rows = [tracer.request_rows(request_id) for request_id in outputs]
        with pytest.raises(RuntimeError, match="continuous batching"):
            tiny.generate(torch.tensor([prompts[0]]), max_new_tokens=2)
    assert model_state(tiny) == before
    # The eager reference after the check: output_attentions makes transformers add hooks of its own.
    for prompt, output, request_rows in zip(prompts, outputs.values(), rows):
        assert_rows_match_reference(tiny, prompt, output, request_rows)
    with macs_kernels.attach(tiny) as tracer, pytest.raises(RuntimeError, match="no continuous batching"):
        tracer.request_rows("req_0")


def test_explain_with_continuous_batching_returns_one_explanation_per_prompt(model_and_tokenizer):
    import macs_kernels

    model, tokenizer = model_and_tokenizer
    prompts = ["Name a primary colour.", qa(0)]
    explanations = macs_kernels.explain(model, tokenizer, prompts, max_new_tokens=3, continuous_batching=True)
    assert len(explanations) == 2
    for explanation in explanations:
        log_ref, _ = eager_macs(model, explanation.input_ids, explanation.generated_ids)
        assert (explanation.step_log_c.double() - log_ref).abs().max() <= LOG_C_TOLERANCE
    single = macs_kernels.explain(model, tokenizer, prompts[0], max_new_tokens=3, continuous_batching=True)
    assert torch.equal(single.generated_ids, explanations[0].generated_ids)
    # Sampling is followed (the conformance suite); options the engine's config does not carry are refused.
    with pytest.raises(ValueError, match="repetition_penalty"):
        macs_kernels.explain(model, tokenizer, prompts, continuous_batching=True, repetition_penalty=1.2)


@pytest.mark.parametrize("sinks", [False, True])
def test_capped_attention_of_a_packed_pass_equals_the_reference(sinks):
    """The attention output the tracer computes for a softcap layer of a packed pass (two requests, one
    prefill chunk after 3 cached tokens, one decode row), with the engine's additive mask: each query row's
    float64 reference probabilities (capped logits, a sink logit per head) times its own request's values."""
    from macs_kernels.engines.continuous import capped_attention
    from macs_kernels.ops import Variant

    torch.manual_seed(0)
    heads, kv_heads, dim, softcap = 4, 2, 8, 2.0
    # request 0: keys 0..7 (5 new queries on tokens 3..7); request 1: keys 8..13 (1 decode query on token 5)
    rows = [(0, t) for t in range(3, 8)] + [(8, 5)]  # (its first key, its token)
    query = torch.randn(1, heads, len(rows), dim) * 2
    key, value = torch.randn(1, kv_heads, 14, dim) * 2, torch.randn(1, kv_heads, 14, dim)
    mask = torch.full((1, 1, len(rows), 14), torch.finfo(torch.float32).min)
    for i, (start, token) in enumerate(rows):
        mask[0, 0, i, start : start + token + 1] = 0.0
    sink_logits = torch.randn(heads) if sinks else None
    got = capped_attention(query, key, value, mask, dim**-0.5, Variant(softcap=softcap, sinks=sink_logits))
    assert got.shape == (1, len(rows), heads, dim)
    for i, (start, token) in enumerate(rows):
        for h in range(heads):
            keys = slice(start, start + token + 1)
            p = reference.variant_row_reference(query[0, h, i], key[0, h // 2, keys], dim**-0.5, softcap=softcap,
                                                sink=None if sink_logits is None else sink_logits[h])
            assert relative_error(got[0, i, h], p @ value[0, h // 2, keys].double()) <= RELATIVE_ERROR[torch.float32]
