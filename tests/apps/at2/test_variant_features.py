"""AT2 features of layers whose attention is a variant (sliding windows, logit softcapping, attention sinks):
ops.attention_features with an ops.Variant against the float64 reference, and the features of random Gemma 2,
Mistral and gpt-oss models, one-forward (AT2 training) and captured during generation, against the eager
`output_attentions` of one teacher-forced forward."""
from __future__ import annotations

import functools

import pytest
import torch

from macs_kernels import attach, ops
from macs_kernels.api.explanation import encode_prompts
from macs_kernels.apps.at2.features import QueryCapture, forward_capture
from macs_kernels.ops import reference
from macs_kernels.ops.variant import Variant
from tests.conformance.conftest import WINDOW, variant_model
from tests.conformance.test_conformance import PROMPTS
from tests.helpers import eager_attentions
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {  # name -> (window, softcap, sinks?)
    "window": (5, None, False),
    "softcap": (None, 2.0, False),
    "sinks": (None, None, True),
    "window_softcap_sinks": (6, 3.0, True),
}
HEADS, KV_HEADS, DIM, KEYS, ROWS = 4, 2, 16, 40, 11


def _case(name, seed):
    """Two items, item 1 left-padded by 3 with a shorter cache and fewer valid rows; sources past the prompt."""
    window, softcap, with_sinks = VARIANTS[name]
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, ROWS, DIM, generator=generator) * 2
    k = torch.randn(2, KV_HEADS, KEYS, DIM, generator=generator) * 2
    sinks = torch.randn(HEADS, generator=generator) * 2 + 8 if with_sinks else None  # rivals the largest logits
    args = dict(source_start=torch.tensor([2, 5]), source_end=torch.tensor([KEYS - 1, KEYS - 3]),
                kv_len=torch.tensor([KEYS, KEYS - 2]), kv_start=torch.tensor([0, 3]), n_rows=torch.tensor([ROWS, 7]),
                scale=0.3)
    return q, k, args, Variant(window=window, softcap=softcap, sinks=sinks)


def _backends():
    return [pytest.param(name, marks=pytest.mark.skip(reason=ops.why_unavailable(name, "cpu"))
                         if ops.why_unavailable(name, "cpu") else ()) for name in ("torch", "triton")]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", list(VARIANTS))
def test_features_of_a_variant_layer_equal_the_reference(name, backend):
    q, k, args, variant = _case(name, seed=len(name))
    got = ops.attention_features(q, k, backend=backend, variant=variant, **args)
    want = reference.attention_features_reference(q, k, window=variant.window, softcap=variant.softcap,
                                                  sinks=variant.sinks, **args)
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]
    for b, n in enumerate((args["source_end"] - args["source_start"]).tolist()):
        assert not got[b, :, n:].any()
    # The variant matters: the plain softmax's features differ.
    assert relative_error(reference.attention_features_reference(q, k, **args), want) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpu_features_of_a_variant_layer_equal_the_reference(name, dtype, backend):
    q, k, args, variant = _case(name, seed=len(name))
    q, k = q.to(dtype), k.to(dtype)
    on_gpu = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in args.items()}
    sinks = None if variant.sinks is None else variant.sinks.cuda()
    got = ops.attention_features(q.cuda(), k.cuda(), backend=backend, **on_gpu,
                                 variant=Variant(window=variant.window, softcap=variant.softcap, sinks=sinks))
    want = reference.attention_features_reference(q, k, window=variant.window, softcap=variant.softcap,
                                                  sinks=variant.sinks, **args)
    assert relative_error(got, want) <= RELATIVE_ERROR[dtype]


@pytest.mark.parametrize(("variant", "lse", "message"), [
    (Variant(window=4, key_offset=3), None, "key_offset=0"),
    (Variant(softcap=2.0), torch.zeros(2, HEADS, ROWS), "lse cannot be given with a variant"),
    (Variant(sinks=torch.zeros(3)), None, "one logit per query head"),
])
def test_bad_variant_arguments_raise(variant, lse, message):
    q, k, args, _ = _case("window", seed=0)
    with pytest.raises(ValueError, match=message):
        ops.attention_features(q, k, variant=variant, lse=lse, **args)


# ---- random models of the real configurations ---------------------------------------------------------
MODELS = ["gemma2", "mistral", "gpt_oss"]
models = functools.cache(variant_model)  # name -> (model, tokenizer), built on first use


def _eager_features(model, prompt_ids, response_ids, start, end, rows=None):
    """(L, H, end - start) float64: each head's eager attention on tokens [start, end) summed over the response
    rows [rows) (default all; row t: the query at token n - 1 + t) and divided by their count."""
    first, stop = rows if rows is not None else (0, response_ids.numel())
    n = prompt_ids.numel()
    attentions = eager_attentions(model, prompt_ids, response_ids)
    return torch.stack([layer[:, n - 1 + first : n - 1 + stop, start:end].double().sum(1) / (stop - first)
                        for layer in attentions])


@pytest.mark.parametrize("name", MODELS)
def test_one_forward_features_of_a_variant_model_equal_eager_output_attentions(name):
    """forward_capture (what AT2 training and AT2Attributor with a given response run): every response row of a
    window layer attends its own window (the first prompt tokens slide out), capped logits, sinks."""
    model, tokenizer = models(name)
    prompt_ids = encode_prompts(tokenizer, PROMPTS["three"][2])[0][0]
    response_ids = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(1))
    assert prompt_ids.numel() > WINDOW + 4
    capture = forward_capture(model, prompt_ids, response_ids)
    n = prompt_ids.numel()
    # The whole prompt; sources among the response's own tokens; a sub-range of the target rows.
    for start, end, rows in ((0, n, None), (3, n + 6, None), (0, n, (2, 7))):
        target = {} if rows is None else {"target_start": rows[0], "target_end": rows[1]}
        got = capture.features(source_start=start, source_end=end, **target)[0]
        assert relative_error(got, _eager_features(model, prompt_ids, response_ids, start, end, rows)) \
            <= RELATIVE_ERROR[torch.float32]


@pytest.mark.parametrize("name", MODELS)
def test_generation_features_of_a_variant_model_equal_eager_output_attentions(name):
    """QueryCapture during a left-padded greedy generate (rows=1 per pass, a window layer's cache dropping the
    tokens that slid out), sources past the prompt included, equal the teacher-forced eager attentions and the
    one-forward capture."""
    model, tokenizer = models(name)
    ids, mask, _ = encode_prompts(tokenizer, PROMPTS["three"])
    capture = QueryCapture()
    steps = 6
    with torch.no_grad(), attach(model, hooks=[capture], backend="torch"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    pads = (mask == 0).sum(1)
    generated = out[:, ids.shape[1]:]
    # Sources: from the 2nd prompt token to the 4th generated one.
    features = capture.features(source_start=pads + 1, source_end=torch.full_like(pads, ids.shape[1] + 4))
    for b in range(ids.shape[0]):
        prompt_ids = ids[b, int(pads[b]):]
        n = prompt_ids.numel()
        want = _eager_features(model, prompt_ids, generated[b], 1, n + 4)
        assert relative_error(features[b, ..., : n + 3], want) <= RELATIVE_ERROR[torch.float32]
        alone = forward_capture(model, prompt_ids, generated[b]).features(source_start=1, source_end=n + 4)[0]
        assert relative_error(features[b, ..., : n + 3], alone) <= RELATIVE_ERROR[torch.float32]


def _efficient_reference(model, prompt_ids, response_ids, values, start, end):
    """(L, H, end - start) float64: eager rows, each projected onto the values of the keys its layer attends (a
    window layer: the row's last `sliding_window` tokens) by reference.efficient_row_reference, averaged."""
    config = model.config
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    n, rows = prompt_ids.numel(), response_ids.numel()
    group = config.num_attention_heads // config.num_key_value_heads
    out = []
    for layer, attention in enumerate(eager_attentions(model, prompt_ids, response_ids)):
        summed = torch.zeros(attention.shape[0], end - start, dtype=torch.float64)
        for h in range(attention.shape[0]):
            for r in range(rows):
                query = n - 1 + r
                first = max(0, query - config.sliding_window + 1) if kinds[layer] == "sliding_attention" else 0
                row = torch.zeros(query + 1, dtype=torch.float64)
                row[first:] = reference.efficient_row_reference(attention[h, query, first : query + 1],
                                                                values[layer][0, h // group, first : query + 1])
                summed[h] += torch.nn.functional.pad(row, (0, end))[start:end]
        out.append(summed / rows)
    return torch.stack(out)


@pytest.mark.parametrize("name", ["mistral_d4", "gpt_oss"])
def test_efficient_features_of_a_variant_model_project_each_row_onto_its_window(name, monkeypatch):
    """attention="efficient": a window row projects onto its window's values (sinks: the layer's own rows, the
    sink mass left out), in one forward and during generation; the 6 rows in chunks of 4."""
    from macs_kernels.apps.at2 import features as features_module

    monkeypatch.setattr(features_module, "ROW_CHUNK", 4)
    model, tokenizer = models(name)
    prompt_ids = encode_prompts(tokenizer, PROMPTS["three"][2])[0][0]
    n = prompt_ids.numel()
    capture = QueryCapture()
    with torch.no_grad(), attach(model, hooks=[capture], backend="torch"):
        out = model.generate(prompt_ids[None], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    response_ids = out[0, n:]
    one_forward = forward_capture(model, prompt_ids, response_ids)
    want = _efficient_reference(model, prompt_ids, response_ids, one_forward.values, 2, n + 3)
    for captured in (one_forward, capture):
        got = captured.features(source_start=2, source_end=n + 3, attention="efficient")[0]
        assert relative_error(got, want) <= 1e-4  # float32 Gram solves against an SVD in float64
    softmax = one_forward.features(source_start=2, source_end=n + 3)[0]
    assert relative_error(softmax, want) > 1e-2  # the projection matters


def test_at2_attributor_explains_a_variant_model():
    """AT2Attributor on a window + softcap model: the one-forward scores of a response equal those of the
    generation that produced it."""
    from macs_kernels.apps.at2 import AT2Attributor
    from macs_kernels.apps.at2.coefficients import model_shape

    model, tokenizer = models("gemma2")
    theta = torch.randn(*model_shape(model), generator=torch.Generator().manual_seed(3))
    attributor = AT2Attributor(model, tokenizer, theta)
    context = "The tower is in Paris. It was built in 1889. Its designer was Gustave Eiffel."
    generated = attributor.explain("Who designed the tower?", context, max_new_tokens=6)
    forward = attributor.explain("Who designed the tower?", context, response_ids=generated.response_ids)
    assert len(generated.sources) == 3 and generated.scores.abs().sum() > 0
    torch.testing.assert_close(forward.scores, generated.scores, rtol=1e-4, atol=1e-6)
