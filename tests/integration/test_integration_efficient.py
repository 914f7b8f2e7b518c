"""explain(..., attention="efficient") end to end: rows from the incremental Gram state equal the
non-incremental op (itself checked against an SVD reference) applied to eager attention rows."""
import torch

from macs_kernels import explain, ops
from macs_kernels.engines.hf_models import returned_cache
from macs_kernels.ops import reference
from tests.helpers import default_model, qa

Z_TOLERANCE = 1e-4


@torch.no_grad()
def _efficient_reference(model, input_ids, generated_ids):
    """Step (log_c, z-scores) from eager softmax rows projected by ops.efficient_attention (no Gram state)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        full = torch.cat([input_ids, generated_ids]).unsqueeze(0)[:, :-1]
        out = model(full, output_attentions=True, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
    n, steps = len(input_ids), len(generated_ids)
    log_rows, z_rows = [], []
    queries = torch.arange(n - 1, n - 1 + steps)
    per_layer = []
    for layer, attention in enumerate(out.attentions):
        values = returned_cache(out).layers[layer].values
        rows = attention[:, :, queries, :]  # (1, H, steps, S)
        a_eff, _ = ops.efficient_attention(rows, values, kv_len=full.shape[1], causal=True, backend="torch")
        per_layer.append(a_eff[0])
    for k in range(steps):
        rows = [layer_rows[:, k, : n + k] for layer_rows in per_layer]
        log_c, z = reference.macs_step_reference(rows, n)
        log_rows.append(log_c)
        z_rows.append(z)
    return torch.stack(log_rows), torch.stack(z_rows)


def test_efficient_rows_match_the_op_and_differ_from_softmax():
    model, tokenizer = default_model()
    efficient = explain(model, tokenizer, qa(0), max_new_tokens=4, attention="efficient", backend="torch")
    softmax = explain(model, tokenizer, qa(0), max_new_tokens=4, backend="torch")
    assert torch.equal(efficient.generated_ids, softmax.generated_ids)
    assert efficient.config["attention"] == "efficient"
    _, z_ref = _efficient_reference(model, efficient.input_ids, efficient.generated_ids)
    assert (efficient.paper_step_scores.double() - z_ref).abs().max() <= Z_TOLERANCE
    # The z-scores of both are dominated by the attention sink (the first token); the log domain shows
    # how far the rows moved.
    assert (efficient.step_log_c - softmax.step_log_c).abs().max() > 0.1


def test_efficient_attention_on_a_left_padded_batch():
    model, tokenizer = default_model()
    prompts = [qa(1), "Name a primary colour."]
    batch = explain(model, tokenizer, prompts, max_new_tokens=3, attention="efficient", backend="torch")
    for prompt, item in zip(prompts, batch):
        alone = explain(model, tokenizer, prompt, max_new_tokens=3, attention="efficient", backend="torch")
        assert torch.equal(item.generated_ids, alone.generated_ids)
        assert (item.step_scores - alone.step_scores).abs().max() <= Z_TOLERANCE
        assert torch.isfinite(item.step_scores).all()


def test_efficient_attention_on_the_triton_backend_equals_torch():
    import pytest

    pytest.importorskip("triton")
    from macs_kernels.ops.triton import LAUNCHES

    model, tokenizer = default_model()
    prompt = "Name the capital of France."
    reference = explain(model, tokenizer, prompt, max_new_tokens=2, attention="efficient", backend="torch")
    LAUNCHES.clear()
    traced = explain(model, tokenizer, prompt, max_new_tokens=2, attention="efficient", backend="triton")
    layers = model.config.num_hidden_layers
    # Every layer of both passes: the back-projection and the pooled update ran as Triton kernels.
    assert LAUNCHES["_efficient_back_projection_kernel"] == 2 * layers
    assert LAUNCHES["_pool_kernel"] == 2 * layers
    assert torch.equal(traced.generated_ids, reference.generated_ids)
    assert (traced.step_scores - reference.step_scores).abs().max() <= Z_TOLERANCE
    assert torch.allclose(traced.step_log_c, reference.step_log_c, rtol=1e-4, atol=1e-4)
