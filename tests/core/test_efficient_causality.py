"""Efficient attention on the default model (SmolLM2-135M, float32): the part of an attention row in the
null space of its keys' [V, 1] does nothing, the rest is what the prediction depends on.

A custom eager attention (registered with transformers' AttentionInterface) computes softmax rows and can
replace a layer's rows by their efficient rows (causal prefixes), or shift one row along a given direction.
"""
import pytest
import torch

from macs_kernels import ops

NAME = "macs_efficient_causality_test"
PLAN = {"replace": (), "shift": None}  # what the attention below does on the next forward pass


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = query.shape[1] // key.shape[1]
    scores = query.float() @ key.float().repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    queries, keys = scores.shape[-2:]
    causal = torch.ones(queries, keys, dtype=torch.bool, device=scores.device).tril(keys - queries)
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    if module.layer_idx in PLAN["replace"]:
        p, _ = ops.efficient_attention(p, value, kv_len=keys, causal=True, backend="torch")
    if PLAN["shift"] is not None and PLAN["shift"][0] == module.layer_idx:
        p = p.clone()
        p[0, :, -1] += PLAN["shift"][1]
    out = p @ value.float().repeat_interleave(group, dim=1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def model_and_ids():
    models = pytest.importorskip("macs_kernels.api.models")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model, tokenizer = models.load_model(None, dtype=torch.float32, attn_implementation=NAME)
    except FileNotFoundError as error:
        pytest.skip(f"default model unavailable: {error}")
    text = (
        "Answer the question based on the following text. Question: where did the expedition spend the winter? "
        "Context: In 1910 the expedition sailed south from New Zealand, reached the ice shelf in January and "
        "built a hut on the shore of a small bay. The ponies and dogs were landed, depots were laid towards "
        "the pole, and the party spent the long winter in the hut, reading, lecturing and repairing sledges, "
        "before setting out again in the spring when the light returned to the southern sky. Two of the "
        "scientists walked to a penguin colony in midwinter darkness to collect eggs, a journey of five weeks "
        "in temperatures far below freezing, and returned exhausted but with three eggs for the museum."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] > 2 * 65, "rows need more than D + 1 = 65 keys to have a null space"
    return model, ids


def _log_probs(model, ids, replace=(), shift=None, capture_values=None):
    """Last position's log-probabilities; capture_values=layer also returns that layer's values (H, S, D)."""
    PLAN["replace"], PLAN["shift"] = replace, shift
    captured = {}
    if capture_values is not None:
        handle = model.model.layers[capture_values].self_attn.v_proj.register_forward_hook(
            lambda module, args, output: captured.setdefault("v", output)
        )
    try:
        with torch.no_grad():
            log_probs = torch.log_softmax(model(ids, use_cache=False).logits[0, -1].double(), dim=-1)
    finally:
        PLAN["replace"], PLAN["shift"] = (), None
        if capture_values is not None:
            handle.remove()
    if capture_values is None:
        return log_probs
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    values = captured["v"][0].view(ids.shape[1], config.num_key_value_heads, head_dim).transpose(0, 1)
    group = config.num_attention_heads // config.num_key_value_heads
    return log_probs, values.double().repeat_interleave(group, dim=0)


def test_efficient_rows_leave_the_prediction_unchanged_and_the_rest_moves_it(model_and_ids):
    model, ids = model_and_ids
    layers = model.config.num_hidden_layers
    layer = layers // 2
    reference, values = _log_probs(model, ids, capture_values=layer)
    # Every row of every layer replaced at once (errors would compound across layers).
    delta = (_log_probs(model, ids, replace=tuple(range(layers))) - reference).abs().max().item()
    assert delta <= 1e-4, delta

    # Shift the middle layer's last rows (every head) by the same amount along two directions: one in
    # the left null space of [V, 1] (from torch.linalg.pinv) changes nothing, the other moves the prediction.
    x = torch.cat([values, torch.ones(values.shape[:-1] + (1,), dtype=torch.float64)], dim=-1)
    z = torch.randn(values.shape[:2], dtype=torch.float64)
    null = z - (x @ (torch.linalg.pinv(x) @ z[..., None]))[..., 0]
    moved = z - null  # the component of z in the column space of X: it changes the output
    deltas = []
    for direction in (null, moved):
        shift = (0.05 * direction / direction.norm(dim=-1, keepdim=True)).float()
        deltas.append((_log_probs(model, ids, shift=(layer, shift)) - reference).abs().max().item())
    assert deltas[0] <= 1e-4 and deltas[1] > 1e-2, deltas
