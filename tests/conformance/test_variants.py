"""The conformance suite on models whose attention is a variant (sliding windows, logit softcapping, attention
sinks): random models of Gemma 2, Gemma 3, Mistral, Qwen2 (use_sliding_window) and gpt-oss configurations, every
engine x method x layout either equal to the teacher-forced eager `output_attentions` reference or refused
before work with the support table's message (naming the model type)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import DynamicCache

from macs_kernels.api.explanation import encode_prompts
from macs_kernels.core import support
from macs_kernels.engines.hf_models import attention_variants, cache_argument, returned_cache, window_key_offset
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, eager_macs

from .conftest import VARIANT_MODELS, WINDOW, eager_log_c, variant_model
from .test_conformance import (
    AT2,
    LAYOUTS,
    LOG_C_TOLERANCE,
    METHODS,
    PROMPTS,
    STOP,
    assert_sequences_equal_the_reference,
    check_rows_or_refusal,
    check_tensor_parallel_ranks,
    continuous_engine,
    generate_engine,
    traced_generate,
)

ENGINES = {"generate": generate_engine, "continuous": continuous_engine}
# The default run: every model on the layout that moves keys the most (a left-padded batch, fused decode), and the
# window, softcap and sink models in more layouts and methods; the rest of the grid is slow.
FAST = {("fused", "left_padded")}
FAST_MORE = {"gemma2", "gemma3", "gpt_oss"}, {("exact", "greedy"), ("exact", "beams"), ("exact", "chunked_prefill"),
                                             ("exact", "compiled"), (AT2, "greedy"), ("efficient", "greedy")}
CASES = [
    pytest.param(model, engine, method, layout, id=f"{model}-{engine}-{method}-{layout}",
                 marks=() if (method, layout) in FAST or (model in FAST_MORE[0] and (method, layout) in FAST_MORE[1])
                 else pytest.mark.slow)
    for model in VARIANT_MODELS for engine in ENGINES for method in [*METHODS, AT2] for layout in LAYOUTS
    # Where a sequence stops is the stopping criteria's, not attention's; and a random model's greedy text
    # need not hold the distinct token the stop-strings layout stops at.
    if layout != STOP
]


def _refusals(model, engine: str, method: str, layout: str) -> list[str]:
    """The support table's refusals that apply (the variant's, the layout's and the two together's: any may come
    first)."""
    variants = attention_variants(model)
    found = [support.message(engine, method, variant) for variant in variants]
    together = [support.message_together(engine, method, (variant, layout)) for variant in variants]
    return [*found, *together, support.message(engine, method, layout)]


@pytest.mark.parametrize(("name", "engine", "method", "layout"), CASES)
def test_variant_rows_equal_the_teacher_forced_reference_or_are_refused(name, engine, method, layout, variant_models,
                                                                         request):
    if layout == "cache_pressure" and name == "mistral":
        pytest.skip("every layer a window: a request's cache never outgrows the window, so nothing is offloaded")
    model, tokenizer = variant_models(name)
    run = ENGINES[engine](model, tokenizer, None)
    # Every prompt is longer than the window: the last query of a window layer cannot see the first inputs.
    assert all(encode_prompts(tokenizer, p)[0].shape[1] > WINDOW + 4 for p in PROMPTS[LAYOUTS[layout][0]])
    check_rows_or_refusal(model, run, engine, method, layout, _refusals(model, engine, method, layout), request,
                          efficient=_window_efficient_reference)


@pytest.mark.parametrize("name", [pytest.param("gemma2", marks=pytest.mark.slow), "gpt_oss", "mistral_d4"])
def test_evaluation_record_of_a_variant_model_equals_the_reference(name, variant_models):
    """The evaluation's recorded rows (every configuration scored from one generation) of window, softcap and sink
    layers are in token positions: any MACS configuration from the record equals the eager reference."""
    from macs_kernels.apps.evaluation.record import generate_record, macs_from_record

    model, tokenizer = variant_models(name)
    prompt_ids = encode_prompts(tokenizer, PROMPTS["one"][0])[0][0]
    record, generated, step_log_c = generate_record(model, tokenizer, prompt_ids, max_new_tokens=4, backend="torch",
                                                    attentions=("efficient",))
    reference = eager_log_c(model, prompt_ids, generated)
    assert (step_log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE
    assert (torch.from_numpy(macs_from_record(record)) - reference).abs().max() <= LOG_C_TOLERANCE
    efficient = torch.from_numpy(macs_from_record(record, attention="efficient"))
    assert (efficient - _window_efficient_reference(model, prompt_ids, generated)).abs().max() <= LOG_C_TOLERANCE
    mean_half = eager_macs(model, prompt_ids, generated, pooling="mean", alpha=0.5)[0]
    assert (torch.from_numpy(macs_from_record(record, pooling="mean", alpha=0.5)) - mean_half).abs().max() \
        <= LOG_C_TOLERANCE


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize(("name", "method"), [
    ("gpt_oss", "fused"), pytest.param("gemma3", "exact", marks=pytest.mark.slow),
    pytest.param("mistral", "exact", marks=pytest.mark.slow), pytest.param("qwen2", "fused", marks=pytest.mark.slow),
    pytest.param("gemma2", "fused", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_variant_rows_on_the_gpu_kernels_equal_the_reference(name, method, engine, backend, variant_models):
    """The Triton kernels (the interpreter without a GPU) and the CUDA kernels (on a GPU) take the window, the
    softcap and the sinks too."""
    import copy

    from macs_kernels import explain
    from macs_kernels.ops import why_unavailable

    from .test_conformance import NEW_TOKENS

    device = "cuda" if backend == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the cuda backend runs on CUDA tensors only")
    if why_unavailable(backend, device) is not None:
        pytest.skip(why_unavailable(backend, device))
    model, tokenizer = variant_models(name)
    if device == "cuda":  # the fixture's model stays on the CPU for the other tests
        model = copy.deepcopy(model).to(device)
    options = {"continuous_batching": True} if engine == "continuous" else {}
    if any(_refusals(model, engine, method, "left_padded")):
        with pytest.raises(NotImplementedError):
            explain(model, tokenizer, PROMPTS["three"][:2], max_new_tokens=NEW_TOKENS, backend=backend,
                    **METHODS[method], **options)
        return
    for item in explain(model, tokenizer, PROMPTS["three"][:2], max_new_tokens=NEW_TOKENS, backend=backend,
                        **METHODS[method], **options):
        reference = eager_log_c(model, item.input_ids.to(device), item.generated_ids.to(device))
        assert (item.step_log_c.double().cpu() - reference.cpu()).abs().max() <= LOG_C_TOLERANCE


@pytest.mark.parametrize(("name", "engine"), [
    ("gemma2_full", "generate"), ("gpt_oss_full", "continuous"),
    pytest.param("gemma2_full", "continuous", marks=pytest.mark.slow),
    pytest.param("gpt_oss_full", "generate", marks=pytest.mark.slow),
])
def test_efficient_rows_of_softcap_and_sink_layers_equal_the_reference(name, engine, variant_models, request):
    """Efficient attention projects the layer's own softmax rows (capped logits, sink mass left out): equal to
    the eager rows projected by ops.efficient_attention; its Gram state cannot follow a window (refused)."""
    model, tokenizer = variant_models(name)
    check_rows_or_refusal(model, ENGINES[engine](model, tokenizer, None), engine, "efficient", "left_padded",
                          _refusals(model, engine, "efficient", "left_padded"), request)


def _window_efficient_reference(model, prompt_ids, generated_ids):
    """Step log c (steps, N) float64 of efficient rows, independently: eager rows over every token (a cache that
    keeps every layer's values), each projected onto the values of the keys its layer attends (a window layer:
    its last `sliding_window` tokens) by reference.efficient_row_reference."""
    from transformers import DynamicCache

    from macs_kernels.ops import reference

    config = model.config
    previous = config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        full = torch.cat([prompt_ids, generated_ids])[None, :-1]
        out = model(full, output_attentions=True, use_cache=True, **cache_argument(model, DynamicCache()))
    finally:
        model.set_attn_implementation(previous)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    n, heads = len(prompt_ids), config.num_attention_heads
    group = heads // config.num_key_value_heads
    steps = []
    for k in range(len(generated_ids)):
        query = n - 1 + k
        layers = []
        for layer, attention in enumerate(out.attentions):
            first = max(0, query - config.sliding_window + 1) if kinds[layer] == "sliding_attention" else 0
            values = returned_cache(out).layers[layer].values[0]
            rows = torch.zeros(heads, query + 1, dtype=torch.float64)
            for h in range(heads):
                rows[h, first:] = reference.efficient_row_reference(attention[0, h, query, first : query + 1],
                                                                    values[h // group, first : query + 1])
            layers.append(rows)
        steps.append(reference.macs_step_reference(layers, n)[0])
    return torch.stack(steps)


@pytest.mark.parametrize(("name", "engine"), [
    ("mistral_d4", "generate"), ("gemma3_d4", "continuous"),
    pytest.param("mistral_d4", "continuous", marks=pytest.mark.slow),
    pytest.param("gemma3_d4", "generate", marks=pytest.mark.slow),
])
def test_efficient_rows_of_window_layers_project_onto_the_window(name, engine, variant_models):
    """A window layer's efficient row is its softmax row projected onto the values of the keys it attends (its
    window); full layers keep their Gram state over every value."""
    model, tokenizer = variant_models(name)
    sequences = ENGINES[engine](model, tokenizer, None)("efficient", "left_padded")
    assert len(sequences) == len(PROMPTS["three"])
    for prompt_ids, generated_ids, log_c in sequences:
        reference = _window_efficient_reference(model, prompt_ids, generated_ids)
        assert (log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE
        # The projection matters here: the softmax rows' log c differs.
        assert (eager_log_c(model, prompt_ids, generated_ids) - reference).abs().max() > 10 * LOG_C_TOLERANCE


# Generate modes whose window caches are rolled, cropped or handed in: a static cache (its window layers fill a
# buffer of `sliding_window` slots, then roll it), prompt lookup and a second model's assisted decoding (verify
# passes of several candidates; the cache cropped back after rejections), and a continued conversation (a
# DynamicCache from an earlier generate, whose window layers already dropped the first turn's first tokens and
# pads). Each returned sequence against the teacher-forced eager reference of its own tokens.
CACHE_MODES = ["static", "static_beams", "prompt_lookup", "assisted", "continued"]
CACHE_LAYOUTS = {"static_beams": "beams", "prompt_lookup": "assisted", "assisted": "assisted"}  # support's names
FAST_CACHE = {("gemma2", "static", "fused"), ("gemma3", "prompt_lookup", "exact"), ("gpt_oss", "assisted", "fused"),
              ("mistral", "continued", "exact"), ("qwen2", "static", AT2), ("gemma3", "continued", "efficient")}
CACHE_CASES = [
    pytest.param(model, mode, method, id=f"{model}-{mode}-{method}",
                 marks=() if (model, mode, method) in FAST_CACHE else pytest.mark.slow)
    for model in VARIANT_MODELS for mode in CACHE_MODES for method in [*METHODS, AT2]
]


def _left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def _cache_mode_sequences(name: str, model, tokenizer, mode: str, method: str) -> list:
    prompt = encode_prompts(tokenizer, PROMPTS["one"][0])[0][0]
    pad = tokenizer.pad_token_id
    if mode == "static":
        # A left-padded batch (every prompt longer than the window) and a prompt shorter than the window: its
        # window layers hand over their whole buffer until it is full, then roll it one slot a token.
        ids, mask = _left_padded([prompt, prompt[-20:]], pad)
        batch, _ = traced_generate(model, ids, mask, method, cache_implementation="static", pad_token_id=pad)
        short = prompt[-5:][None]
        alone, _ = traced_generate(model, short, torch.ones_like(short), method, cache_implementation="static",
                                   max_new_tokens=3 * WINDOW // 2, pad_token_id=pad, min_new_tokens=WINDOW)
        return batch + alone
    if mode == "static_beams":  # the beams' rows of the static window buffer reordered by beam search
        ids, mask = _left_padded([prompt, prompt[-20:]], pad)
        return traced_generate(model, ids, mask, method, cache_implementation="static", num_beams=3,
                               num_return_sequences=2, pad_token_id=pad)[0]
    if mode == "continued":
        # Turn one of a left-padded batch (the second prompt's pads outnumber the window), then a follow-up.
        ids, mask = _left_padded([prompt, prompt[:12]], pad)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                   **cache_argument(model, cache), pad_token_id=pad)
        both = torch.cat([first, prompt[-6:].expand(2, -1)], dim=1)
        mask = torch.cat([mask, torch.ones(2, both.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        return traced_generate(model, both, mask, method, **cache_argument(model, cache), pad_token_id=pad)[0]
    # A prompt that holds its own greedy continuation: prompt lookup finds candidates; a perturbed copy of the
    # model proposes tokens the model sometimes rejects.
    with torch.no_grad():
        continuation = model.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=pad)[0]
    ids = torch.cat([continuation, prompt[-20:]])[None]
    if mode == "prompt_lookup":
        options = {"prompt_lookup_num_tokens": 3}
    else:
        assistant = variant_model(name)[0]  # the same weights (seeded), built anew
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in assistant.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        options = {"assistant_model": assistant}
    try:
        sequences, tracer = traced_generate(model, ids, torch.ones_like(ids), method, max_new_tokens=10,
                                            pad_token_id=pad, **options)
    except NotImplementedError:  # MACS's refusal, which the caller expects
        raise
    except RuntimeError:
        _skip_where_transformers_fails(model, ids, pad, options)
        raise
    generated = sum(len(sequence[1]) for sequence in sequences)
    assert max(p["rows"] for p in tracer.passes) > 1, "no verify pass of several candidates"
    assert sum(p["rows"] for p in tracer.passes) > generated, "no candidate rejected: no crop was followed"
    return sequences


def _skip_where_transformers_fails(model, ids, pad, options) -> None:
    """The failed generation again without MACS: skipped where transformers itself raises (5.17's assisted decoding of
    a window model under sdpa: its assistant's mask is a window wide, its keys are not; 5.18 runs it)."""
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, pad_token_id=pad, **options)
    except RuntimeError as error:
        pytest.skip(f"transformers {transformers.__version__} fails here without MACS too: {error}")


def test_a_window_layers_token_count_is_read_as_an_int_or_a_0_dim_integer_tensor():
    """transformers 5.17's dynamic sliding layer holds its token count as a 0-dim tensor after a crop by a tensor count
    (assisted decoding, prompt lookup): read as the int it stands for; any other kind is refused, naming the layer."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=8)
    cache = SimpleNamespace(layers=[layer])
    offsets = []
    for count in (69, torch.tensor(69), torch.tensor(69, dtype=torch.int32)):
        layer.cumulative_length = count
        offsets.append(window_key_offset(cache, 0, keys=7))
    assert offsets == [62, 62, 62]
    for count in (torch.tensor(69.0), torch.tensor([69]), None):
        layer.cumulative_length = count
        with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer is not supported"):
            window_key_offset(cache, 0, keys=7)


@pytest.mark.parametrize(("name", "mode", "method"), CACHE_CASES)
def test_window_caches_rolled_cropped_or_passed_in_equal_the_reference(name, mode, method, variant_models, request):
    """Window layers' keys start where their cache says (hf_models.window_key_offset): static caches, assisted
    decoding and prompt lookup, a cache passed in; the methods that cannot drop rejected candidates are refused."""
    model, tokenizer = variant_models(name)
    # A mode without a layout of its own is refused only for the model's variants, as greedy decoding is.
    refusals = [r for r in _refusals(model, "generate", method, CACHE_LAYOUTS.get(mode, "greedy")) if r is not None]
    if refusals:
        with pytest.raises(NotImplementedError) as refused:
            _cache_mode_sequences(name, model, tokenizer, mode, method)
        assert any(refusal in str(refused.value) for refusal in refusals), str(refused.value)
        return
    sequences = _cache_mode_sequences(name, model, tokenizer, mode, method)
    assert len(sequences) == {"static": 3, "static_beams": 4, "continued": 2}.get(mode, 1)
    assert_sequences_equal_the_reference(model, method, sequences, request, efficient=_window_efficient_reference)


@NEEDS_CONTINUOUS_BATCHING
@pytest.mark.parametrize("method", ["exact", "fused"])
def test_continuous_batching_computes_the_capped_attention_of_gemma2(method, variant_models):
    """transformers' continuous-batching attention (paged|eager, sdpa) drops Gemma 2's logit cap; with macs_kernels
    attached the engine computes the capped attention itself (prefill chunks and decode passes), so each request's
    greedy tokens are generate's and its rows the eager reference's."""
    from macs_kernels import explain

    from .test_conformance import _cb_config

    model, tokenizer = variant_models("gemma2_cap1")
    prompts = PROMPTS["three"]
    batched = explain(model, tokenizer, prompts, max_new_tokens=8, backend="torch", continuous_batching=True,
                      continuous_batching_config=_cb_config("chunked_prefill"), **METHODS[method])
    for prompt, item in zip(prompts, batched):
        alone = explain(model, tokenizer, prompt, max_new_tokens=8, backend="torch")
        assert torch.equal(item.generated_ids, alone.generated_ids)
        reference = eager_log_c(model, item.input_ids, item.generated_ids)
        assert (item.step_log_c.double() - reference).abs().max() <= LOG_C_TOLERANCE


@pytest.mark.slow
def test_sinks_under_tensor_parallelism_equal_the_reference(variant_models, tmp_path):
    """gpt-oss split over two ranks with its per-head sink logits split with the query heads (tp_worker's
    SINK_PLAN): each rank's attention puts its own heads' sinks in the denominator, so the rows reduced over the
    group equal the single-process eager reference, in every method and in generate and continuous batching."""
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    if "local_params" not in ALL_PARALLEL_STYLES:
        pytest.skip(f"transformers {transformers.__version__} cannot split gpt-oss's sinks over ranks without MACS (no "
                    "'local_params' parallel style: its attention mixes the sharded sinks with local tensors)")
    model, tokenizer = variant_models("gpt_oss")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    check_tensor_parallel_ranks(model, tmp_path / "model", tmp_path, "sinks", efficient=_window_efficient_reference)
