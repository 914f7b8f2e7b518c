"""AttnLRP: against an independent float64 implementation of the rules, exact conservation of its CP-LRP
variant, nothing left patched afterwards, and (slow, needs lxt's own venv) equality with lxt 2.1 itself."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from macs_kernels.apps.evaluation.baselines import attnlrp
from tests.helpers import default_model, qa, tiny_llama

LXT_PYTHON = os.environ.get("MACS_KERNELS_LXT_PYTHON", "/opt/lxt-venv/bin/python")


def _ids(seed=0, n=11, steps=4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=generator), torch.randint(3, 90, (steps,), generator=generator)


def _gradient_scaled(x, factor):
    """x's value, with the gradient multiplied by factor (how the reference writes the uniform rule)."""
    return x.detach() + factor * (x - x.detach())


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) / half)
    angles = positions[:, None].double() * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_relevance(model, input_ids, generated_ids, variant):
    """The tiny Llama's forward written out in float64 from its weights, the rules as detach arithmetic:
    row k = (embeddings * d logit_k / d embeddings).sum(-1) over step k's own prefix."""
    config = model.config
    weights = {name: p.detach().double() for name, p in model.named_parameters()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    theta = config.rope_parameters["rope_theta"]
    constant = variant == "cp-lrp"

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps).detach()

    rows = []
    for k, target in enumerate(generated_ids.tolist()):
        ids = torch.cat([input_ids, generated_ids[:k]])
        length = len(ids)
        embeddings = weights["model.embed_tokens.weight"][ids].clone().requires_grad_(True)
        h = embeddings
        positions = torch.arange(length)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for layer in range(config.num_hidden_layers):
            w = {name.split(f"model.layers.{layer}.")[1]: p for name, p in weights.items()
                 if name.startswith(f"model.layers.{layer}.")}
            x = norm(h, w["input_layernorm.weight"])
            q = (x @ w["self_attn.q_proj.weight"].T).view(length, heads, head_dim).transpose(0, 1)
            key = (x @ w["self_attn.k_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
            v = (x @ w["self_attn.v_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
            q, key = _rope(q, positions, theta), _rope(key, positions, theta)
            if constant:
                q, key = q.detach(), key.detach()
            else:
                q, key, v = _gradient_scaled(q, 0.25), _gradient_scaled(key, 0.25), _gradient_scaled(v, 0.5)
            key = key.repeat_interleave(heads // kv_heads, 0)
            v = v.repeat_interleave(heads // kv_heads, 0)
            scores = (q @ key.transpose(1, 2)) / head_dim ** 0.5
            attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            h = h + (attention @ v).transpose(0, 1).reshape(length, -1) @ w["self_attn.o_proj.weight"].T
            x = norm(h, w["post_attention_layernorm.weight"])
            gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
            if constant:
                product = torch.nn.functional.silu(gate.detach()) * up
            else:
                # Identity rule: SiLU's backward is silu(g) / g.
                activated = gate * (torch.nn.functional.silu(gate) / gate).detach()
                product = _gradient_scaled(activated * up, 0.5)
            h = h + product @ w["mlp.down_proj.weight"].T
        logit = norm(h[-1], weights["model.norm.weight"]) @ weights["lm_head.weight"][target]
        (grad,) = torch.autograd.grad(logit, embeddings)
        rows.append((embeddings * grad).sum(-1)[: len(input_ids)])
    return torch.stack(rows)


@pytest.mark.parametrize("variant", attnlrp.VARIANTS)
def test_relevance_equals_an_independent_float64_implementation_of_the_rules(variant):
    model = tiny_llama(heads=4, kv_heads=2, layers=3)
    prompt, generated = _ids()
    got = attnlrp.relevance(model, prompt, generated, variant=variant)
    want = reference_relevance(model, prompt, generated, variant)
    assert got.shape == (len(generated), len(prompt))
    scale = want.abs().amax(-1, keepdim=True)
    assert torch.allclose(got.double() / scale, want / scale, atol=2e-5), (got, want)
    # The rules matter: plain Gradient x Input (no hooks) differs from them by far more than the tolerance.
    plain = _gradient_x_input(model, prompt, generated)
    assert (plain.double() - want).abs().max() > 100 * 2e-5 * scale.max()


def _gradient_x_input(model, prompt, generated):
    ids = torch.cat([prompt, generated[:-1]])[None]
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings).logits[0, len(prompt) - 1:]
    rows = []
    for k, target in enumerate(generated.tolist()):
        (grad,) = torch.autograd.grad(logits[k, target], embeddings, retain_graph=True)
        rows.append((embeddings * grad).sum(-1)[0, : len(prompt)])
    return torch.stack(rows)


def test_cp_lrp_conserves_the_target_logit_and_attnlrp_reports_its_own_figure():
    model = tiny_llama(heads=4, kv_heads=2, layers=3)
    prompt, generated = _ids(1, n=9, steps=5)
    cp = attnlrp.attribution(model, prompt, generated, variant="cp-lrp")
    # Plain tensors: nothing holds on to the autograd graph.
    assert not cp.relevance.requires_grad and not cp.target_logits.requires_grad
    assert torch.allclose(cp.relevance.sum(-1), cp.target_logits, rtol=1e-4, atol=1e-5)
    # Row k covers the prompt and the k generated tokens before it, nothing later.
    for k in range(len(generated)):
        assert torch.all(cp.relevance[k, len(prompt) + k:] == 0)
    lrp = attnlrp.attribution(model, prompt, generated)
    # Same target logits (the forward is unchanged); AttnLRP does not conserve exactly (softmax rule).
    assert torch.allclose(lrp.target_logits, cp.target_logits)
    full = torch.cat([prompt, generated[:-1]])[None]
    with torch.no_grad():
        plain = model(full).logits[0, len(prompt) - 1:].gather(1, generated[:, None])[:, 0]
    assert torch.allclose(lrp.target_logits, plain, atol=1e-6)


@pytest.mark.parametrize("architecture", ["Mistral", "Qwen2"])
def test_other_llama_like_architectures_conserve_under_cp_lrp(architecture):
    import transformers

    config = getattr(transformers, f"{architecture}Config")(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config).eval()
    prompt, generated = _ids(3, n=10, steps=3)
    # Qwen2's q/k/v biases start at zero, so nothing absorbs relevance here either.
    cp = attnlrp.attribution(model, prompt, generated, variant="cp-lrp")
    assert torch.allclose(cp.relevance.sum(-1), cp.target_logits, rtol=1e-4, atol=1e-5)


def test_nothing_stays_patched_and_the_model_keeps_its_gradients():
    import transformers.models.llama.modeling_llama as llama
    from transformers import AttentionInterface

    classes = {cls: cls.forward for cls in (llama.LlamaMLP, llama.LlamaRMSNorm, llama.LlamaAttention,
                                            torch.nn.Dropout, torch.nn.Linear)}
    registry = dict(AttentionInterface._global_mapping)
    model, fresh = tiny_llama(seed=3), tiny_llama(seed=3)
    prompt, generated = _ids(2)
    before = _gradient_x_input(model, prompt, generated)
    attnlrp.relevance(model, prompt, generated)
    attnlrp.relevance(model, prompt, generated, variant="cp-lrp")
    assert {cls: cls.forward for cls in classes} == classes
    assert dict(AttentionInterface._global_mapping) == registry
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert "forward" not in vars(module)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(_gradient_x_input(model, prompt, generated), before)
    assert torch.equal(_gradient_x_input(fresh, prompt, generated), before)


def test_bad_input_is_refused_by_name():
    model = tiny_llama()
    prompt, generated = _ids()
    with pytest.raises(ValueError, match="generated_ids"):
        attnlrp.relevance(model, prompt, generated[None])
    with pytest.raises(ValueError, match="input_ids"):
        attnlrp.relevance(model, prompt.float(), generated)
    with torch.inference_mode():
        made_in_inference_mode = generated.clone()
        with pytest.raises(RuntimeError, match="inference_mode"):
            attnlrp.relevance(model, prompt, generated)
    assert attnlrp.relevance(model, prompt, made_in_inference_mode).shape == (len(generated), len(prompt))
    with pytest.raises(ValueError, match="variant"):
        attnlrp.relevance(model, prompt, generated, variant="lrp")
    model.train()
    with pytest.raises(ValueError, match="eval"):
        attnlrp.relevance(model, prompt, generated)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=97)).eval()
    with pytest.raises(ValueError, match="gpt2"):
        attnlrp.relevance(gpt2, prompt, generated)


def _lxt(model_dir, prompt, generated, variant, tmp_path):
    if not Path(LXT_PYTHON).is_file():
        pytest.skip(f"no lxt venv at {LXT_PYTHON} (set MACS_KERNELS_LXT_PYTHON; set-up in tests/apps/lxt_worker.py)")
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(json.dumps({"model": str(model_dir), "input_ids": prompt.tolist(),
                                   "generated_ids": generated.tolist(), "variant": variant}))
    worker = Path(__file__).with_name("lxt_worker.py")
    done = subprocess.run([LXT_PYTHON, str(worker), str(request), str(result)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(result.read_text())


def _assert_equals_lxt(ours, theirs):
    """Relative |d| per step row (|d| / max |relevance| of lxt's row) <= 1e-3, over each step's whole input."""
    assert len(theirs["relevance"]) == len(ours.relevance)
    worst = 0.0
    for k, row in enumerate(theirs["relevance"]):
        want = torch.tensor(row, dtype=torch.float64)
        got = ours.relevance[k, : len(row)].double()
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    assert torch.allclose(ours.target_logits.double(), torch.tensor(theirs["target_logits"], dtype=torch.float64),
                          rtol=1e-4, atol=1e-4)
    assert worst <= 1e-3, worst
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("variant", attnlrp.VARIANTS)
def test_equals_lxt_on_a_tiny_model(variant, tmp_path):
    model = tiny_llama(heads=4, kv_heads=2, layers=3, seed=5)
    model.save_pretrained(tmp_path / "model")
    prompt, generated = _ids(4, n=15, steps=5)
    theirs = _lxt(tmp_path / "model", prompt, generated, variant, tmp_path)
    worst = _assert_equals_lxt(attnlrp.attribution(model, prompt, generated, variant=variant), theirs)
    print(f"tiny model, {variant}: max relative |d| vs lxt {worst:.2e}", file=sys.stderr)


@pytest.mark.slow
def test_equals_lxt_on_the_default_model(tmp_path):
    from macs_kernels.api.explanation import encode_prompts
    from macs_kernels.api.models import default_model_path

    model, tokenizer = default_model()
    ids, _, _ = encode_prompts(tokenizer, qa(0))
    prompt = ids[0]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    generated = out[0, len(prompt):]
    theirs = _lxt(default_model_path(), prompt, generated, "attnlrp", tmp_path)
    ours = attnlrp.attribution(model, prompt, generated)
    worst = _assert_equals_lxt(ours, theirs)
    conservation = (ours.relevance.sum(-1) / ours.target_logits).tolist()
    print(f"default model: max relative |d| vs lxt {worst:.2e}; conservation per step "
          f"{[round(c, 3) for c in conservation]}", file=sys.stderr)
