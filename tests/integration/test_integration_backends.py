"""explain() with the Triton and CUDA backends equals the torch backend, and the kernels really run.

Triton runs in its interpreter on CPU with the real default model. The CUDA backend needs a GPU and the
compiled extension, or its emulation on the CPU (MACS_KERNELS_CUDA_EMULATION=1); there the model is
random-initialised with the default model's shape (weights do not travel to GPU machines) and traced through
attach() on token ids (no tokenizer travels either).
"""
import pytest
import torch

from macs_kernels import explain
from tests.helpers import default_model
from tests.ops.cases import CUDA_BACKEND_DEVICE, launched_kernels, split_kernels_launched, why_no_cuda_backend
from tests.tolerances import RELATIVE_ERROR, relative_error


def _compare(model, tokenizer, backend, prompt, max_new_tokens=3, **config):
    reference = explain(model, tokenizer, prompt, max_new_tokens=max_new_tokens, backend="torch")
    traced = explain(model, tokenizer, prompt, max_new_tokens=max_new_tokens, backend=backend, **config)
    assert traced.config["backend"] == backend
    assert torch.equal(traced.generated_ids, reference.generated_ids)
    assert (traced.step_scores - reference.step_scores).abs().max() <= 1e-4
    assert torch.allclose(traced.step_log_c, reference.step_log_c, rtol=1e-4, atol=1e-4)


def test_torch_fused_decode_matches_the_wrapped_attention(monkeypatch):
    """fused_decode=True on the torch backend: decode steps skip sdpa (a spy counts its calls), read K once,
    and give the same tokens, logits within float rounding, and the same scores; unpadded and padded."""
    from transformers import AttentionInterface

    from macs_kernels import attach
    from tests.helpers import qa

    model, tokenizer = default_model()
    _compare(model, tokenizer, "torch", qa(0), max_new_tokens=4, fused_decode=True)
    calls = []
    original = AttentionInterface._global_mapping["sdpa"]
    counted = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counted)
    encoded = tokenizer(["Name a colour.", "Name the capital of France, please."], padding=True,
                        padding_side="left", return_tensors="pt")
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=tokenizer.eos_token_id)
    runs = {}
    for fused in (False, True):
        calls.clear()
        with torch.no_grad(), attach(model, fused_decode=fused) as tracer:
            out = model.generate(**encoded, **kwargs)
        runs[fused] = (out, [tracer.rows(b) for b in range(2)], len(calls))
    layers = model.config.num_hidden_layers
    assert runs[False][2] == 4 * layers and runs[True][2] == layers  # fused: sdpa on the prefill only
    assert torch.equal(runs[False][0].sequences, runs[True][0].sequences)
    for a, b in zip(runs[False][0].logits, runs[True][0].logits):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    for (log_a, z_a), (log_b, z_b) in zip(runs[False][1], runs[True][1]):
        assert (z_a - z_b).abs().max() <= 1e-4
        assert torch.allclose(log_a, log_b, rtol=1e-4, atol=1e-4)


def test_triton_backend_equals_torch_backend_and_really_runs():
    pytest.importorskip("triton")
    from macs_kernels.ops.triton import LAUNCHES

    model, tokenizer = default_model()
    LAUNCHES.clear()
    _compare(model, tokenizer, "triton", "Name the capital of France.")
    layers = model.config.num_hidden_layers
    # Prefill: macs_update per layer; two decode steps: the fused split-KV decode per layer.
    assert LAUNCHES, "no Triton kernel ran: the backend fell back silently"
    assert LAUNCHES["_split_kv_kernel"] >= 3 * layers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "pipelined"), (torch.bfloat16, "mma")],
                         ids=["float32-pipelined", "bfloat16-mma"])
def test_cuda_backend_equals_torch_backend_on_a_model_of_the_default_shape(dtype, kernel):
    """Generation traced on the cuda backend, in float32 (the pipelined split kernel at D 64) and bf16 (the
    tensor-core one; the launched kernels' names say so), gives the torch backend's tokens and rows: on a GPU, or on
    the CPU where the emulation runs the kernels (MACS_KERNELS_CUDA_EMULATION=1; the torch backend never calls the
    operators, so it stays the independent side). In bf16 the two backends' attention outputs round differently, so
    the rows agree to bf16's tolerance."""
    if why_no_cuda_backend():
        pytest.skip(why_no_cuda_backend())
    from transformers import AutoConfig, AutoModelForCausalLM

    from macs_kernels import attach, ops
    from macs_kernels.apps.bench import ARCHITECTURES

    device = torch.device(CUDA_BACKEND_DEVICE)
    torch.manual_seed(0)
    shape = dict(ARCHITECTURES["SmolLM2-135M"])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    prompts = torch.randint(3, config.vocab_size, (2, 40), device=device)
    mask = torch.ones_like(prompts)
    mask[1, :7] = 0  # a left-padded second row
    runs, launched = {}, {}
    ops.resolve_backend("cuda", device)  # the backend's self-checks (float32 kernels) before the launches counted
    for backend in ("torch", "cuda"):
        with torch.no_grad(), attach(model, backend=backend) as tracer, launched_kernels() as names:
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        runs[backend], launched[backend] = (out, [tracer.rows(b) for b in range(2)]), split_kernels_launched(names)
    assert launched == {"torch": set(), "cuda": {kernel}}, launched
    assert torch.equal(runs["torch"][0], runs["cuda"][0])
    for (log_torch, z_torch), (log_cuda, z_cuda) in zip(runs["torch"][1], runs["cuda"][1]):
        if dtype == torch.float32:
            assert (z_cuda - z_torch).abs().max() <= 1e-4
            assert torch.allclose(log_cuda, log_torch, rtol=1e-4, atol=1e-4)
        else:
            assert relative_error(z_cuda, z_torch) < RELATIVE_ERROR[dtype]
            assert relative_error(log_cuda, log_torch) < RELATIVE_ERROR[dtype]
