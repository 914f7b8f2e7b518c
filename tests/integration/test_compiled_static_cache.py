"""Attribution under Hugging Face's compiled paths: generate's own torch.compile of a static-cache generation
(on an accelerator, or anywhere when its compile_config asks for all devices) and a user's compiled forward. Each
returned sequence's rows equal the independent eager `output_attentions` reference (max |d log c| <= 1e-3), the
tokens equal the uncompiled run's, and the decode step compiles as plain generate's does: one frame, no graph
break, for more layers than dynamo's recompile limit (issue 47), and a later generation compiles nothing new. What
the tracer does not follow under compile is refused before the first forward, naming it; a backend whose kernels do
not compile there is replaced, with one warning."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from transformers import StaticCache
from transformers.generation.configuration_utils import CompileConfig

from macs_kernels import attach, explain
from macs_kernels.engines.hf_models import cache_argument
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, default_model, eager_macs, tiny_llama
from tests.ops.cases import CUDA_BACKEND_DEVICE, why_no_cuda_backend

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


def traced(model, ids, mask, max_new_tokens=5, cache=None, backend="torch", **generate_kwargs):
    """(tokens (B, new), [step_log_c per sequence]) of a static-cache generate inside attach() (greedy unless
    generate_kwargs sample): in `cache` (a StaticCache) if given, else in one that generate sizes for the call."""
    generate_kwargs |= cache_argument(model, cache) if cache is not None else {"cache_implementation": "static"}
    with torch.no_grad(), attach(model, backend=backend) as tracer:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                             **{"do_sample": False, **generate_kwargs})
    generated = out[:, ids.shape[1]:]
    return generated, [tracer.rows(i, generated.shape[1])[0] for i in range(out.shape[0])]


def assert_eager_rows(model, ids, mask, generated, rows):
    """Each sequence's rows (on the CPU) equal the teacher-forced eager reference of its own tokens, up to where it
    ended (an end-of-sequence token stops a sequence's rows; generate pads it on)."""
    for prompt, attended, tokens, log_c in zip(ids, mask, generated, rows):
        reference, _ = eager_macs(model, prompt[attended.bool()], tokens)
        assert log_c.shape[1:] == reference.shape[1:] and 0 < log_c.shape[0] <= reference.shape[0]
        assert (log_c.double() - reference[:log_c.shape[0]].cpu()).abs().max() <= LOG_TOLERANCE


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


def compile_counts(model, traced_kwargs: dict | None) -> tuple[dict, list]:
    """(dynamo's frames, graph breaks and unique graphs of two compiled generations in a row, the second's prompts
    shorter, in the static cache generate sized for the first; the second's tokens and rows): plain generate when
    `traced_kwargs` is None, else attributed."""
    torch._dynamo.reset()
    counters.clear()
    config = compile_everywhere("eager")
    calls = [(PROMPTS, MASK), (PROMPTS[:, 2:], MASK[:, 2:])]
    with torch.no_grad():
        for ids, mask in calls:
            if traced_kwargs is None:
                model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, do_sample=False,
                               cache_implementation="static", compile_config=config)
                tokens = rows = None
            else:
                first = dict(counters["frames"])
                tokens, rows = traced(model, ids, mask, compile_config=config, **traced_kwargs)
    if traced_kwargs is not None:
        assert dict(counters["frames"]) == first, "the second generation compiled again"
    return dict(frames=counters["frames"]["total"], graph_breaks=sum(counters["graph_break"].values()),
                graphs=counters["stats"]["unique_graphs"]), (tokens, rows)


def test_a_deep_models_compiled_decode_step_is_one_graph_as_plain_generates_is():
    """12 layers, past dynamo's recompile limit of 8 (issue 47): a graph break inside the attention forward would
    compile it once per layer and stop compiling after 8. Attributed, the step compiles the frames plain generate
    compiles, with no graph break, once for two generations of different prompt lengths in one static cache; its
    rows equal the eager reference."""
    model = tiny_llama(heads=4, kv_heads=2, layers=12)
    plain, _ = compile_counts(model, None)
    attributed, (tokens, rows) = compile_counts(model, {})
    assert plain["graph_breaks"] == 0 and plain["frames"] >= 1
    assert attributed == plain
    assert torch.equal(tokens, traced(model, PROMPTS[:, 2:], MASK[:, 2:], disable_compile=True)[0])
    assert_eager_rows(model, PROMPTS[:, 2:], MASK[:, 2:], tokens, rows)


def test_a_backend_whose_kernels_do_not_compile_is_replaced_with_one_warning(monkeypatch):
    """Triton's interpreted kernels (TRITON_INTERPRET on a CPU) cannot be traced by dynamo: the registry's compiled
    self-check finds it before the steps compile, the steps run torch's kernels, generate does not fail, and the rows
    are exact."""
    pytest.importorskip("triton")
    from macs_kernels.ops import registry

    monkeypatch.setattr(registry, "_warned", set())  # the warning is once per process: an earlier test may have had it
    model = small_gqa_model()
    with pytest.warns(RuntimeWarning, match="the triton backend does not run in a compiled pass") as record:
        tokens, rows = traced(model, PROMPTS, MASK, backend="triton", compile_config=compile_everywhere("eager"))
    assert sum("compiled pass" in str(w.message) for w in record) == 1
    assert_eager_rows(model, PROMPTS, MASK, tokens, rows)


def test_sampled_compiled_generation_rows_equal_the_reference_of_the_tokens_drawn():
    """Sampling is the other compiled mode: whatever tokens the compiled steps draw, each sequence's rows equal the
    teacher-forced reference of those tokens."""
    model = small_gqa_model()
    torch.manual_seed(3)
    tokens, rows = traced(model, PROMPTS, MASK, max_new_tokens=6, do_sample=True, top_k=20,
                          compile_config=compile_everywhere("eager"))
    assert counters["stats"]["unique_graphs"] > 0
    assert_eager_rows(model, PROMPTS, MASK, tokens, rows)


def test_a_streamed_compiled_generation_reads_each_steps_row_between_steps():
    """stream() reads each row while generate runs: a compiled step's row from the step buffers, between steps (the
    host never reads inside a step). Each streamed row equals the reference's."""
    from macs_kernels import stream
    from macs_kernels.core.scores import log_zscores

    model = small_gqa_model()
    ids = PROMPTS[1]
    streamed = list(stream(model, IdTokenizer(), input_ids=ids, max_new_tokens=6, cache_implementation="static",
                           compile_config=compile_everywhere("eager")))
    assert counters["stats"]["unique_graphs"] > 0
    reference, _ = eager_macs(model, ids, torch.tensor([token for token, _ in streamed]))
    assert len(streamed) == 6
    for (_, scores), log_c in zip(streamed, reference):
        assert (scores.double() - log_zscores(log_c.float()).double()).abs().max() <= 1e-4


def _count_forwards(model):
    calls = []
    return calls, model.model.register_forward_pre_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("generate_kwargs,attach_kwargs,message", [
    (dict(), dict(), "static cache only"),  # a user's compiled forward with a growing cache
    (dict(cache_implementation="static", num_beams=2), dict(), "beam_search under torch.compile"),
    (dict(cache_implementation="static"), dict(attention="efficient"),
     r"attention='efficient' with torch.compile \(.*\) is not supported under macs_kernels' generate engine"),
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


@NEEDS_CONTINUOUS_BATCHING
def test_continuous_batching_with_a_compiled_forward_is_refused():
    from macs_kernels.engines.continuous import attach_continuous

    model = small_gqa_model()
    model.forward = torch.compile(model.forward, backend="eager")
    with pytest.raises(NotImplementedError, match=r"torch.compile \(.*\) is not supported under macs_kernels' "
                                                  "continuous engine"):
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
    assert_eager_rows(model, ids, mask, tokens, rows)


def _gpu_backends():
    from macs_kernels.ops import why_unavailable

    params = []
    for backend in (None, "triton", "cuda"):
        reason = _gpu_reason() or (None if backend is None else why_unavailable(backend, "cuda"))
        params.append(pytest.param(backend, id=str(backend), marks=[pytest.mark.gpu] + (
            [pytest.mark.skip(reason=reason)] if reason else [])))
    return params


@pytest.mark.parametrize("prompt", [300, 1200])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_compiled_generate_on_a_gpu_equals_the_reference_at_long_prompts(backend, prompt):
    """Issue 47, point 2: the cuda kernels returned wrong rows inside generate's inductor-compiled step at a 1,200-token
    prompt (exact at 300). Every backend a user can name gives rows equal to the eager reference there (cuda is
    replaced in compiled passes, with a warning, until a GPU run shows it exact)."""
    torch.manual_seed(0)
    model = tiny_llama(heads=8, kv_heads=2, layers=4).cuda()
    ids = torch.randint(3, 96, (1, prompt), device="cuda")
    mask = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tokens, rows = traced(model, ids, mask, max_new_tokens=12, backend=backend)
    assert counters["stats"]["unique_graphs"] > 0
    assert_eager_rows(model, ids, mask, tokens, rows)


@pytest.mark.parametrize("prompt", [300, 1200])
def test_the_cuda_kernels_inside_an_inductor_compiled_step_equal_the_reference(prompt, monkeypatch):
    """Issue 47's failure class: the cuda backend's kernels, with the registry's refusal of them in compiled passes
    (COMPILE_UNSAFE) set aside, run inside generate's inductor-compiled decode steps and give rows equal to the eager
    reference at a 1,200-token prompt (the H200 gave max |d log c| 3.73 there at 7a80728). On a GPU, generate compiles
    as it does for its users: while this fails there, compiled passes keep refusing cuda; once it passes, the refusal
    can go. On the CPU emulation (MACS_KERNELS_CUDA_EMULATION=1; inductor asked for on every device) it passes, so
    what failed on the H200 lies in what the emulation does not model (CUDA graphs, streams, the GPU's memory) or in
    the compiled graph of 7a80728 (graph breaks, per-layer frames). The stride padding inductor applies on GPUs only
    (strides over 1,024 elements rounded up to 128 bytes: a threshold between 300 tokens and 1,200) is on here too,
    so that a step that pads a tensor is compiled as a GPU would; today's step pads none."""
    if why_no_cuda_backend() is not None:
        pytest.skip(why_no_cuda_backend())
    from macs_kernels.ops import registry

    monkeypatch.setattr(registry, "COMPILE_UNSAFE", {})
    torch.manual_seed(0)
    layers, new_tokens = 4, 12
    model = tiny_llama(heads=8, kv_heads=2, layers=layers).to(CUDA_BACKEND_DEVICE)
    ids = torch.randint(3, 96, (1, prompt)).to(CUDA_BACKEND_DEVICE)
    mask = torch.ones_like(ids)
    emulated = CUDA_BACKEND_DEVICE == "cpu"
    if emulated:
        from macs_kernels.ops.cuda import emulation

        emulation.take_launches()
    with warnings.catch_warnings(), inductor_config.patch(disable_padding_cpu=False):
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to another backend
        tokens, rows = traced(model, ids, mask, max_new_tokens=new_tokens, backend="cuda",
                              **{"compile_config": compile_everywhere("inductor")} if emulated else {})
    assert counters["stats"]["unique_graphs"] > 0
    if emulated:
        decode_steps = sum("combine_kernel<" in launch.name for launch in emulation.take_launches())
        assert decode_steps >= layers * (new_tokens - 1)
    assert_eager_rows(model, ids, mask, tokens, rows)
