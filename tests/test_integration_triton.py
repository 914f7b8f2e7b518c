"""explain(..., backend="triton") on the real model, in the Triton interpreter on CPU."""
import pytest
import torch

from macs_kernels import explain
from tests.helpers import default_model

pytest.importorskip("triton")


def test_triton_backend_equals_torch_backend_and_really_runs():
    from macs_kernels.ops.triton import LAUNCHES

    model, tokenizer = default_model()
    prompt = "Name the capital of France."
    reference = explain(model, tokenizer, prompt, max_new_tokens=3, backend="torch")
    LAUNCHES.clear()
    traced = explain(model, tokenizer, prompt, max_new_tokens=3, backend="triton")
    layers = model.config.num_hidden_layers
    # Prefill: macs_update per layer; two decode steps: the fused decode kernel per layer.
    assert LAUNCHES, "no Triton kernel ran: the backend fell back silently"
    assert sum(count for name, count in LAUNCHES.items() if "decode" in name or "split" in name) >= 2 * layers
    assert traced.config["backend"] == "triton"
    assert torch.equal(traced.generated_ids, reference.generated_ids)
    assert (traced.step_scores - reference.step_scores).abs().max() <= 1e-4
    assert torch.allclose(traced.step_log_c, reference.step_log_c, rtol=1e-4, atol=1e-4)
