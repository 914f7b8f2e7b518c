"""Attribution under Hugging Face's compiled paths: generate's own torch.compile of a static-cache generation
(on an accelerator, or anywhere when its compile_config asks for all devices) and a user's compiled forward. Each
returned sequence's rows equal the independent eager `output_attentions` reference (max |d log c| <= 1e-3), the
tokens equal the uncompiled run's, and a longer generation in a cache of the same size compiles nothing new (the
per-pass bookkeeping stays outside the compiled region, so no step recompiles). What the tracer does not follow
under compile is refused before the first forward, naming it."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache
from transformers.generation.configuration_utils import CompileConfig

from macs_kernels import attach, explain
from macs_kernels.engines.hf_models import cache_argument
from tests.helpers import default_model, eager_macs, tiny_llama

LOG_TOLERANCE = 1e-3
# A left-padded batch of 2 prompts of different lengths (pad id 0).
PROMPTS = torch.tensor([[0, 0, 5, 9, 14, 20, 33, 41], [1, 5, 9, 14, 20, 33, 41, 7]])
MASK = (torch.arange(8) >= torch.tensor([[2], [0]])).long()


class IdTokenizer:
    """The tokenizer explain() needs for token-id prompts on a tiny random model: ids are their own text."""

    pad_token_id, eos_token_id, chat_template = 0, 96, None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def compile_everywhere(backend: str, mode: str | None = None) -> CompileConfig:
    """generate's compile config, applied on CPUs too (transformers compiles only on accelerators by default)."""
    config = CompileConfig(backend=backend, mode=mode)
    config._compile_all_devices = True
    return config


def traced(model, ids, mask, max_new_tokens=5, cache=None, **generate_kwargs):
    """(tokens (B, new), [step_log_c per sequence]) of a greedy static-cache generate inside attach(): in `cache`
    (a StaticCache) if given, else in one that generate sizes for the call."""
    generate_kwargs |= cache_argument(model, cache) if cache is not None else {"cache_implementation": "static"}
    with torch.no_grad(), attach(model, backend="torch") as tracer:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                             do_sample=False, **generate_kwargs)
    generated = out[:, ids.shape[1]:]
    return generated, [tracer.rows(i, generated.shape[1])[0] for i in range(out.shape[0])]


def assert_eager_rows(model, ids, mask, generated, rows):
    for prompt, attended, tokens, log_c in zip(ids, mask, generated, rows):
        reference, _ = eager_macs(model, prompt[attended.bool()], tokens)
        assert log_c.shape == reference.shape
        assert (log_c.double() - reference).abs().max() <= LOG_TOLERANCE


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def small_gqa_model():
    return tiny_llama(heads=4, kv_heads=2, layers=2)


# Dynamo traces transformers' forward for ~20 s on a busy 2-core machine whatever the backend; aot_eager adds
# AOTAutograd, inductor compiles C++ (about a minute).
@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow),
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_generate_compiled_static_cache_rows_equal_the_eager_reference(backend):
    model = small_gqa_model()
    plain_tokens, plain_rows = traced(model, PROMPTS, MASK, max_new_tokens=6)
    config = compile_everywhere(backend)
    short, _ = traced(model, PROMPTS, MASK, max_new_tokens=3, cache=StaticCache(model.config, max_cache_len=16),
                      compile_config=config)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # generate did compile its decode steps
    # Twice as many steps in a cache of the same size: they replay what the first steps compiled (nothing guards
    # on the tracer's per-step state).
    tokens, rows = traced(model, PROMPTS, MASK, max_new_tokens=6, cache=StaticCache(model.config, max_cache_len=16),
                          compile_config=config)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(tokens, plain_tokens) and torch.equal(short, plain_tokens[:, :3])
    assert_eager_rows(model, PROMPTS, MASK, tokens, rows)
    for log_c, plain in zip(rows, plain_rows):
        assert (log_c - plain).abs().max() <= 1e-5


@pytest.mark.slow  # compiles the prefill and the decode step, then again for explain's shapes (about a minute)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_users_compiled_forward_with_a_static_cache(backend):
    model = small_gqa_model()
    plain_tokens, _ = traced(model, PROMPTS, MASK)
    model.forward = torch.compile(model.forward, backend=backend)
    tokens, rows = traced(model, PROMPTS, MASK)
    assert counters["stats"]["unique_graphs"] > 0
    assert torch.equal(tokens, plain_tokens)
    assert_eager_rows(model, PROMPTS, MASK, tokens, rows)
    explanation = explain(model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=4,
                          cache_implementation="static")
    reference, _ = eager_macs(model, PROMPTS[1], explanation.generated_ids)
    assert (explanation.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE


def _count_forwards(model):
    calls = []
    return calls, model.model.register_forward_pre_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("generate_kwargs,attach_kwargs,message", [
    (dict(), dict(), "static cache only"),  # a user's compiled forward with a growing cache
    (dict(cache_implementation="static", num_beams=2), dict(), "beam_search under torch.compile"),
    (dict(cache_implementation="static"), dict(attention="efficient"), "attention='efficient' under torch.compile"),
], ids=["dynamic-cache", "beams", "efficient"])
def test_unsupported_compiled_modes_are_refused_before_work(generate_kwargs, attach_kwargs, message):
    model = small_gqa_model()
    model.forward = torch.compile(model.forward, backend="eager")
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(NotImplementedError, match=message), torch.no_grad():
            with attach(model, **attach_kwargs):
                model.generate(PROMPTS[1:], max_new_tokens=3, pad_token_id=0, **generate_kwargs)
    finally:
        handle.remove()
    assert not calls


def test_generate_compile_with_a_hook_is_refused_before_work():
    from macs_kernels.engines.generate import TraceHook

    model = small_gqa_model()
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(NotImplementedError, match="per-layer hooks under torch.compile"), torch.no_grad():
            with attach(model, hooks=[TraceHook()]):
                model.generate(PROMPTS[1:], max_new_tokens=3, pad_token_id=0, cache_implementation="static",
                               compile_config=compile_everywhere("eager"))
    finally:
        handle.remove()
    assert not calls


def test_a_compiled_plain_forward_is_refused():
    model = small_gqa_model()
    model.forward = torch.compile(model.forward, backend="eager")
    with pytest.raises(NotImplementedError, match="inside generate with a static cache only"), torch.no_grad():
        with attach(model):
            model(PROMPTS[1:])


def test_continuous_batching_with_a_compiled_forward_is_refused():
    from macs_kernels.engines.continuous import attach_continuous

    model = small_gqa_model()
    model.forward = torch.compile(model.forward, backend="eager")
    with pytest.raises(NotImplementedError, match="continuous batching with a torch.compile'd forward"):
        with attach_continuous(model):
            pass


@pytest.mark.slow  # compiles the default model's decode step (about a minute on a busy 2-core machine)
def test_default_model_generate_compiled_static_cache():
    model, tokenizer = default_model()
    ids = tokenizer("The Eiffel Tower stands in", return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    plain_tokens, _ = traced(model, ids, mask, max_new_tokens=4)
    tokens, rows = traced(model, ids, mask, max_new_tokens=4, compile_config=compile_everywhere("aot_eager"))
    assert torch.equal(tokens, plain_tokens)
    assert_eager_rows(model, ids, mask, tokens, rows)


def _gpu_reason():
    return None if torch.cuda.is_available() else "needs a CUDA device"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("how", ["generate-auto-compile", "reduce-overhead-forward"])
def test_compiled_static_cache_on_a_gpu(how):
    model = small_gqa_model().cuda()
    ids, mask = PROMPTS.cuda(), MASK.cuda()
    plain_tokens, _ = traced(model, ids, mask, disable_compile=True)
    if how == "reduce-overhead-forward":
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    tokens, rows = traced(model, ids, mask)  # a static cache on an accelerator: generate compiles it itself
    assert torch.equal(tokens, plain_tokens)
    assert_eager_rows(model, ids.cpu(), mask.cpu(), tokens.cpu(), rows)

