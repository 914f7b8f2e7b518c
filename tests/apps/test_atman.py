"""AtMan: against a brute-force reference (full recompute per suppressed token with an explicit per-head eager
attention, no cache reuse), causality of a suppression, padding through the registered mask function, and
nothing left registered afterwards."""
import pytest
import torch

from macs_kernels.apps.evaluation.baselines import atman
from tests.helpers import tiny_llama

REFERENCE = "test_atman_reference"


def _ids(seed=0, n=12, steps=4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=generator), torch.randint(3, 90, (steps,), generator=generator)


def _model_with_similar_tokens(prompt):
    """A tiny Llama whose input embeddings make prompt[5] a copy of prompt[1] (cosine 1) and prompt[8] a noisy
    copy of prompt[3] (cosine about 0.86): both kinds of conceptual suppression occur."""
    model = tiny_llama(heads=4, kv_heads=2, layers=3, seed=1)
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        weight[prompt[5]] = weight[prompt[1]]
        noise = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(7))
        weight[prompt[8]] = weight[prompt[3]] + 0.6 * noise * weight[prompt[3]].norm() / weight.shape[1] ** 0.5
    return model


def _reference_factors(embeddings, token, factor, threshold):
    factors = []
    for j, row in enumerate(embeddings):
        cos = float(row @ embeddings[token] / (row.norm() * embeddings[token].norm()))
        if j == token:
            factors.append(factor)
        elif threshold is not None and cos >= threshold:
            factors.append((1 - factor) * (1 - cos) + factor)
        else:
            factors.append(1.0)
    return torch.tensor(factors)


def _reference_attention(factors):
    """Eager attention over one whole unpadded sequence, head by head, with key j's shifted score times
    factors[j]; the causal mask is built here, whatever mask transformers passes."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _, heads, length, _ = query.shape
        groups = heads // key.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        outputs = []
        for h in range(heads):
            scores = (query[0, h] @ key[0, h // groups].T) * scaling
            low = scores.masked_fill(~causal, float("inf")).min(-1, keepdim=True).values
            scores = ((scores - low) * factors).masked_fill(~causal, float("-inf"))
            outputs.append(scores.softmax(-1) @ value[0, h // groups])
        return torch.stack(outputs, 1)[None], None

    return attention


def reference_relevance(model, prompt, generated, factor=atman.FACTOR, threshold=atman.THRESHOLD):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    ids = torch.cat([prompt, generated[:-1]])[None]
    n = len(prompt)
    embeddings = model.get_input_embeddings().weight.detach()[ids[0]]

    def cross_entropy(logits):
        return torch.nn.functional.cross_entropy(logits[0, n - 1:], generated, reduction="none")

    with torch.no_grad():
        clean = cross_entropy(model(ids).logits)
        rows = []
        previous = model.config._attn_implementation
        try:
            for token in range(n):
                AttentionInterface.register(REFERENCE, _reference_attention(
                    _reference_factors(embeddings, token, factor, threshold)))
                AttentionMaskInterface.register(REFERENCE, sdpa_mask)
                model.set_attn_implementation(REFERENCE)
                rows.append(cross_entropy(model(ids, use_cache=False).logits) - clean)
                model.set_attn_implementation(previous)
        finally:
            model.set_attn_implementation(previous)
            AttentionInterface._global_mapping.pop(REFERENCE, None)
            AttentionMaskInterface._global_mapping.pop(REFERENCE, None)
    return torch.stack(rows, 1)


@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_relevance_equals_the_brute_force_reference(batch_size):
    prompt, generated = _ids()
    model = _model_with_similar_tokens(prompt)
    embeddings = model.get_input_embeddings().weight.detach()[torch.cat([prompt, generated[:-1]])]
    # The case is exercised: one similar token with an intermediate factor, one with cosine 1.
    factors = atman.suppression_factors(embeddings, 3)
    assert 0.1 < float(factors[8]) < 1 and float(atman.suppression_factors(embeddings, 1)[5]) == pytest.approx(0.1)
    torch.testing.assert_close(factors, _reference_factors(embeddings, 3, 0.1, 0.7), atol=1e-6, rtol=0)
    got = atman.relevance(model, prompt, generated, batch_size=batch_size)
    want = reference_relevance(model, prompt, generated)
    assert got.shape == (len(generated), len(prompt))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # Conceptual suppression on: token 1 and its copy 5 suppress each other, so they score the same.
    torch.testing.assert_close(got[:, 1], got[:, 5])
    assert got.abs().max() > 0.05


def test_without_conceptual_suppression_and_on_a_subset_of_tokens():
    prompt, generated = _ids(2)
    model = _model_with_similar_tokens(prompt)
    got = atman.relevance(model, prompt, generated, threshold=None, factor=0.3, tokens=range(4, 10))
    want = reference_relevance(model, prompt, generated, factor=0.3, threshold=None)
    assert torch.isnan(got[:, :4]).all() and torch.isnan(got[:, 10:]).all()
    torch.testing.assert_close(got[:, 4:10], want[:, 4:10], atol=2e-5, rtol=1e-4)
    # A factor of 1 suppresses nothing.
    assert atman.relevance(model, prompt, generated, factor=1.0, threshold=None).abs().max() < 1e-5


def test_a_suppression_changes_only_later_positions_and_clean_factors_are_the_model():
    prompt, _ = _ids(3, n=14)
    model = tiny_llama(seed=2)
    with torch.no_grad():
        plain = model(prompt[None]).logits[0]
        with atman.suppression(model):
            clean = model(prompt[None], atman_factors=torch.ones(1, len(prompt))).logits[0]
            for token in (0, 6, 13):
                factors = atman.suppression_factors(model.get_input_embeddings()(prompt), token, threshold=None)
                changed = model(prompt[None], atman_factors=factors[None]).logits[0]
                assert torch.equal(changed[:token], clean[:token])
                # Later queries see the suppressed key. (The token's own query may not change: after the shift
                # its key can be the row minimum, 0, in every head; at position 0 it is the only key.)
                assert ((changed[token + 1:] - clean[token + 1:]).abs().amax(-1) > 1e-6).all()
    torch.testing.assert_close(clean, plain, atol=1e-5, rtol=1e-5)


def test_left_padded_batches_stay_correct_through_the_registered_mask():
    model = tiny_llama(seed=4)
    long, _ = _ids(5, n=10)
    short = long[4:]
    batch = torch.stack([long, torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), atman.suppression(model):
        padded = model(batch, attention_mask=mask, position_ids=positions, atman_factors=torch.ones(2, 10)).logits
        alone = model(short[None], atman_factors=torch.ones(1, 6)).logits
    torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=1e-5)


def test_nothing_stays_registered_and_the_model_is_restored():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention, masks = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
    model, fresh = tiny_llama(seed=6), tiny_llama(seed=6)
    prompt, generated = _ids(6)
    atman.relevance(model, prompt, generated)
    with pytest.raises(RuntimeError, match="inside"), atman.suppression(model):
        assert model.config._attn_implementation.startswith("macs_atman")
        raise RuntimeError("inside the block")
    assert set(AttentionInterface._global_mapping) == attention
    assert set(AttentionMaskInterface._global_mapping) == masks
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(prompt[None]).logits, fresh(prompt[None]).logits)


def test_bad_input_is_refused_by_name():
    model = tiny_llama()
    prompt, generated = _ids()
    for kwargs, match in (({"factor": 0.0}, "factor"), ({"threshold": 1.5}, "threshold"),
                          ({"batch_size": 0}, "batch_size"), ({"tokens": [12]}, "tokens")):
        with pytest.raises(ValueError, match=match):
            atman.relevance(model, prompt, generated, **kwargs)
    with pytest.raises(ValueError, match="input_ids"):
        atman.relevance(model, prompt[None], generated)
    with pytest.raises(ValueError, match="atman_factors"), torch.no_grad(), atman.suppression(model):
        model(prompt[None], atman_factors=torch.ones(1, 3))
