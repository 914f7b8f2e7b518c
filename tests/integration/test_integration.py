"""MACS through transformers on the real default model, against an independent eager computation."""
import json

import pytest
import torch

import macs_kernels
from macs_kernels import attach, explain, stream
from macs_kernels.core.scores import paper_zscores
from macs_kernels.ops import reference
from tests.helpers import default_model, eager_macs, qa, tiny_llama

Z_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"pooling": "mean"},
        {"pooling": "min"},
        {"alpha": 0.2},
        {"alpha": 1.0},
        {"redistribute": False},
    ],
    ids=["paper", "mean", "min", "alpha0.2", "alpha1", "no-redistribution"],
)
def test_step_scores_match_eager_output_attentions(model_and_tokenizer, config):
    model, tokenizer = model_and_tokenizer
    explanation = explain(model, tokenizer, qa(0), max_new_tokens=6, backend="torch", **config)
    log_ref, z_ref = eager_macs(model, explanation.input_ids, explanation.generated_ids, **config)
    assert explanation.step_scores.shape == (len(explanation.generated_ids), len(explanation.input_ids))
    assert explanation.step_scores.dtype == torch.float32
    assert (explanation.paper_step_scores.double() - z_ref).abs().max() <= Z_TOLERANCE
    finite = torch.isfinite(log_ref)
    assert torch.equal(torch.isfinite(explanation.step_log_c), finite)
    assert torch.allclose(explanation.step_log_c.double()[finite], log_ref[finite], rtol=1e-4, atol=1e-4)
    log_z_ref = reference.log_zscore_reference(log_ref)
    assert (explanation.step_scores.double()[finite] - log_z_ref[finite]).abs().max() <= Z_TOLERANCE


def test_left_padded_batch_rows_equal_their_own_runs(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = [qa(0), "Name a primary colour.", qa(2)]
    batch = explain(model, tokenizer, prompts, max_new_tokens=6, backend="torch")
    assert len({len(e.input_ids) for e in batch}) == 3, "the prompts must differ in length"
    for prompt, item in zip(prompts, batch):
        alone = explain(model, tokenizer, prompt, max_new_tokens=6, backend="torch")
        assert torch.equal(item.input_ids, alone.input_ids)
        assert torch.equal(item.generated_ids, alone.generated_ids)
        assert (item.step_scores - alone.step_scores).abs().max() <= Z_TOLERANCE
        _, z_ref = eager_macs(model, item.input_ids, item.generated_ids)
        assert (item.paper_step_scores.double() - z_ref).abs().max() <= Z_TOLERANCE


def test_batch_items_stop_at_their_own_end_of_sequence(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = ["Say only: yes", qa(0)]
    batch = explain(model, tokenizer, prompts, max_new_tokens=24, backend="torch")
    eos = tokenizer.eos_token_id
    for item in batch:
        ids = item.generated_ids.tolist()
        assert eos not in ids[:-1]
        assert item.step_scores.shape[0] == len(ids) == len(item.generated_tokens)
    assert any(item.generated_ids[-1] == eos for item in batch)
    assert len(batch[0].generated_ids) != len(batch[1].generated_ids)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attaching_changes_neither_tokens_nor_logits(model_and_tokenizer, implementation):
    model, tokenizer = model_and_tokenizer
    ids = tokenizer.apply_chat_template(qa(1), add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=tokenizer.eos_token_id)
    model.set_attn_implementation(implementation)
    try:
        plain = model.generate(**ids, **kwargs)
        with attach(model, backend="torch") as tracer:
            traced = model.generate(**ids, **kwargs)
            assert model.config._attn_implementation.startswith("macs_kernels")
        assert model.config._attn_implementation == implementation, "detaching restores the implementation"
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(plain.sequences, traced.sequences)
    for a, b in zip(plain.logits, traced.logits):
        assert torch.equal(a, b)
    assert len(tracer.passes) == len(traced.logits)


def test_plain_forward_call_is_traced(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad(), attach(model) as tracer:
        logits = model(ids).logits
    with torch.no_grad():
        assert torch.equal(logits, model(ids).logits)
    next_token = logits[0, -1].argmax().reshape(1)
    _, z_ref = eager_macs(model, ids[0], next_token)
    z = paper_zscores(tracer.rows(0)[0])  # the paper's z-scores, as the reference computes them
    assert z.shape == (1, ids.shape[1])
    assert (z.double() - z_ref).abs().max() <= Z_TOLERANCE


def test_sampled_decoding_is_explained(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(3)
    explanation = explain(model, tokenizer, qa(1), max_new_tokens=6, do_sample=True, temperature=1.5, top_k=50)
    _, z_ref = eager_macs(model, explanation.input_ids, explanation.generated_ids)
    assert (explanation.paper_step_scores.double() - z_ref).abs().max() <= Z_TOLERANCE


def test_stream_yields_the_same_rows_as_explain(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    explanation = explain(model, tokenizer, qa(2), max_new_tokens=5)
    streamed = list(stream(model, tokenizer, qa(2), max_new_tokens=5))
    assert [token for token, _ in streamed] == explanation.generated_ids.tolist()
    assert torch.allclose(torch.stack([z for _, z in streamed]), explanation.step_scores)
    first = next(iter(stream(model, tokenizer, qa(2), max_new_tokens=50)))  # stopping early is fine
    assert first[0] == explanation.generated_ids[0]
    assert model.config._attn_implementation == "sdpa"


def test_input_ids_prompt_and_serialisation(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    ids = tokenizer.apply_chat_template(qa(0), add_generation_prompt=True, return_tensors="pt", return_dict=True)
    from_ids = explain(model, tokenizer, input_ids=ids["input_ids"], max_new_tokens=4)
    from_messages = explain(model, tokenizer, qa(0), max_new_tokens=4)
    assert torch.equal(from_ids.input_ids, from_messages.input_ids)
    assert torch.equal(from_ids.step_scores, from_messages.step_scores)
    data = json.loads(from_ids.to_json())
    assert data["generated_ids"] == from_ids.generated_ids.tolist()
    torch.testing.assert_close(torch.tensor(data["step_scores"]), from_ids.step_scores, rtol=0, atol=6e-5)  # 4 decimals
    torch.testing.assert_close(torch.tensor(data["step_log_c"]), from_ids.step_log_c, rtol=1e-6, atol=0)  # 7 digits
    assert data["config"]["alpha"] == 0.8 and data["config"]["pooling"] == "max"
    page = from_ids.to_html()
    assert page.startswith("<!doctype html>") and "step_scores" in page and "<script" in page


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_keep_a_float32_state(model_and_tokenizer, dtype):
    from macs_kernels.api.models import load_model

    model, tokenizer = model_and_tokenizer
    # Its own copy: converting the shared model there and back would round every later test's weights.
    half, _ = load_model(dtype=dtype)
    explanation = explain(half, tokenizer, qa(0), max_new_tokens=3)
    reference = explain(model, tokenizer, input_ids=explanation.input_ids, max_new_tokens=1)
    assert explanation.step_log_c.dtype == torch.float32 == explanation.step_scores.dtype
    assert torch.isfinite(explanation.step_scores).all()
    # The first step depends only on the prompt: half precision ranks the same top tokens as float32.
    top_half = set(explanation.step_scores[0].topk(5).indices.tolist())
    top_full = set(reference.step_scores[0].topk(5).indices.tolist())
    assert len(top_half & top_full) >= 3


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_tiny_models_with_and_without_gqa(heads, kv_heads):
    model = tiny_llama(heads=heads, kv_heads=kv_heads)
    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 41, 7]])
    with torch.no_grad(), attach(model) as tracer:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    generated = out[0, ids.shape[1]:]
    _, z_ref = eager_macs(model, ids[0], generated)
    z = paper_zscores(tracer.rows(0)[0])  # the paper's z-scores, as the reference computes them
    assert (z.double() - z_ref).abs().max() <= Z_TOLERANCE


def test_nan_in_attention_raises():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN in an attention row"):
        with torch.no_grad(), attach(model):
            model(torch.tensor([[1, 2, 3, 4]]))
    assert model.config._attn_implementation == "sdpa"


def test_alpha_one_underflow_is_legitimate():
    # A peaked attention makes alpha = 1 terms underflow to log(0) = -inf: allowed, and z stays finite.
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(400.0)
        with attach(model, alpha=1.0) as tracer:
            model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]))
    log_c = tracer.rows(0)[0]
    z = paper_zscores(log_c)
    assert torch.isinf(log_c).any()
    assert torch.isfinite(z).all()


def test_bad_input_is_rejected_before_generation(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    calls = []
    original = model.generate
    model.generate = lambda *a, **k: calls.append(1)
    try:
        cases = [
            (dict(prompt=""), ValueError, "prompt is empty"),
            (dict(prompt=[]), ValueError, "empty"),
            (dict(prompt="hi", max_new_tokens=0), ValueError, "max_new_tokens"),
            (dict(prompt="hi", alpha=0.0), ValueError, "alpha"),
            (dict(prompt="hi", alpha=1.5), ValueError, "alpha"),
            (dict(prompt="hi", pooling="median"), ValueError, "pooling"),
            (dict(prompt="hi", attention="sparse"), ValueError, "attention"),
            (dict(prompt="hi", backend="tpu"), ValueError, "backend"),
            (dict(prompt="hi", backend="cuda"), macs_kernels.ops.BackendUnavailable, "cuda"),
            (dict(prompt=None, input_ids=torch.ones(2, 3, dtype=torch.long)), ValueError, "shape"),
            (dict(prompt=None, input_ids=torch.ones(3)), TypeError, "int64"),
            (dict(prompt=None, input_ids=torch.ones(0, dtype=torch.long)), ValueError, "empty"),
            (dict(prompt=None), ValueError, "exactly one"),
        ]
        for kwargs, error, message in cases:
            prompt = kwargs.pop("prompt")
            with pytest.raises(error, match=message):
                explain(model, tokenizer, prompt, **kwargs)
    finally:
        model.generate = original
    assert not calls
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_architectures_are_named():
    with pytest.raises(TypeError, match="not a transformers model"):
        with attach(torch.nn.Linear(2, 2)):
            pass
    legacy = tiny_llama()
    type(legacy)._supports_attention_backend = False
    try:
        with pytest.raises(TypeError, match="AttentionInterface"):
            with attach(legacy):
                pass
    finally:
        del type(legacy)._supports_attention_backend


def test_the_cache_is_read_under_either_transformers_name():
    """transformers 5.24 hands the cache over as `cache`, earlier releases as `past_key_values`."""
    import types

    from macs_kernels.engines.hf_models import passed_cache, returned_cache

    new, old = object(), object()
    assert passed_cache({"cache": new}) is new and passed_cache({"past_key_values": old}) is old
    assert passed_cache({"cache": None, "past_key_values": old}) is old and passed_cache({}) is None
    assert returned_cache(types.SimpleNamespace(cache=new)) is new
    assert returned_cache(types.SimpleNamespace(past_key_values=old)) is old
    with torch.no_grad():
        output = tiny_llama()(torch.tensor([[3, 4, 5]]), use_cache=True)
    assert returned_cache(output).get_seq_length() == 3


def test_right_padding_is_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match="left padding"):
        with torch.no_grad(), attach(model):
            model(torch.tensor([[1, 2, 3, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
