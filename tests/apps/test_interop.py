"""trace_tensors (the interface for other attribution tools) and the inseq adapter."""
import math

import pytest
import torch

from macs_kernels import explain, trace_tensors
from macs_kernels.ops import reference
from tests.helpers import default_model, eager_attentions, eager_macs, qa, tiny_llama

ALPHA = 0.8


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.fixture(scope="module")
def explained(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    return explain(model, tokenizer, qa(0), max_new_tokens=5, backend="torch")


def test_z_scores_and_log_c_equal_explain(model_and_tokenizer, explained):
    model, _ = model_and_tokenizer
    traced = trace_tensors(model, explained.input_ids, explained.generated_ids, backend="torch")
    steps, n = explained.step_log_c.shape
    assert traced.z_scores.shape == traced.log_c.shape == (steps, n)
    assert (traced.z_scores - explained.paper_step_scores).abs().max() <= 1e-5
    assert (traced.log_c - explained.step_log_c).abs().max() <= 1e-4
    assert traced.at2_features is None


def test_pooled_rows_and_at2_features_match_eager_attention(model_and_tokenizer, explained):
    model, _ = model_and_tokenizer
    traced = trace_tensors(model, explained.input_ids, explained.generated_ids, at2=True)
    attentions = eager_attentions(model, explained.input_ids, explained.generated_ids)
    n, steps, layers = len(explained.input_ids), len(explained.generated_ids), len(attentions)
    heads = attentions[0].shape[0]
    assert traced.pooled.shape == (steps, layers, n)
    assert traced.at2_features.shape == (steps, layers, heads, n)
    for k in range(steps):
        query = n - 1 + k
        rows = [layer[:, query, : query + 1] for layer in attentions]
        pooled_ref = torch.stack([reference.layer_log_term_reference(r, n, alpha=1.0).exp() for r in rows])
        assert (traced.pooled[k].double() - pooled_ref).abs().max() <= 1e-5
        features_ref = torch.stack([r[:, :n] for r in rows])
        assert (traced.at2_features[k] - features_ref).abs().max() <= 1e-5
    # The state is the floored pooled rows multiplied over layers.
    rebuilt = torch.log(ALPHA * traced.pooled.double() + 1 - ALPHA).sum(dim=1)
    assert (rebuilt - traced.log_c.double()).abs().max() <= 1e-3


def test_configuration_reaches_the_trace():
    model = tiny_llama()
    prompt, generated = torch.tensor([5, 17, 33, 2, 71, 9, 40]), torch.tensor([12, 50, 3])
    traced = trace_tensors(model, prompt, generated, pooling="mean", redistribute=False, alpha=0.5)
    attentions = eager_attentions(model, prompt, generated)
    n = len(prompt)
    for k in range(len(generated)):
        rows = [layer[:, n - 1 + k, : n + k] for layer in attentions]
        log_c, z = reference.macs_step_reference(rows, n, alpha=0.5, pooling="mean", redistribute=False)
        assert (traced.log_c[k].double() - log_c).abs().max() <= 1e-5
        assert (traced.z_scores[k].double() - z).abs().max() <= 1e-4


def test_bad_input_is_rejected():
    model = tiny_llama()
    prompt = torch.tensor([5, 17, 33])
    with pytest.raises(NotImplementedError, match="efficient"):
        trace_tensors(model, prompt, prompt, attention="efficient")
    with pytest.raises(ValueError, match="generated_ids"):
        trace_tensors(model, prompt, torch.tensor([], dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids"):
        trace_tensors(model, prompt.float(), prompt)
    with pytest.raises(ValueError, match="alpha"):
        trace_tensors(model, prompt, prompt, alpha=0.0)


def test_inseq_method_gives_explains_scores(model_and_tokenizer):
    inseq = pytest.importorskip("inseq", reason="inseq is not installed (see docs/api.md: For other attribution tools)")
    import macs_kernels.apps.integrations.inseq  # noqa: F401 - registers the method

    model, tokenizer = model_and_tokenizer
    assert "macs" in inseq.list_feature_attribution_methods()
    attribution_model = inseq.load_model(model, "macs", tokenizer=tokenizer)
    text = "The capital of France is"
    out = attribution_model.attribute(text, generation_args={"max_new_tokens": 4, "do_sample": False},
                                      show_progress=False)
    sequence = out.sequence_attributions[0]
    prompt_ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    n = len(prompt_ids)
    ids = [token.id for token in sequence.target]
    assert ids[:n] == prompt_ids.tolist()
    # inseq re-tokenizes the generated text, so its targets are not generate's ids: the reference is the
    # independent eager computation over inseq's own tokens, scored as Explanation.step_scores.
    generated = torch.tensor(ids[n:])
    log_ref, _ = eager_macs(model, prompt_ids, generated)
    scores = sequence.target_attributions  # (tokens, steps): step k's scores in column k
    assert scores.shape == (len(ids), len(generated))
    assert (scores[:n].T.double() - reference.log_zscore_reference(log_ref)).abs().max() <= 1e-4
    assert all(math.isnan(v) for v in scores[n:].flatten().tolist())
