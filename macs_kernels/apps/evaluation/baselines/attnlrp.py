"""AttnLRP (Achtibat et al., ICML 2024) for transformers 5.x: relevance of each prompt token for each generated token.

LRP is computed as Gradient x Input on a network whose backward pass is modified by rules; the forward values
are unchanged. The rules are those of the authors' package `lxt` (2.1, `lxt.efficient`, model map `attnLRP`),
which does not import under transformers 5 and patches classes globally. Here they are applied to ONE model
instance with forward hooks that are removed afterwards (nothing global is touched):

- RMSNorm: identity rule, i.e. the rsqrt scale is treated as a constant in the backward pass;
- gated MLP: identity rule on the activation (its backward is act(x) / x), uniform rule on the gate * up
  product (each factor gets half the relevance: the product's gradient is halved);
- attention: uniform rule on the matmuls: gradients on the query and key halved twice (q.k^T, then the
  softmax-weighted sum with v), on the value halved once; the softmax itself keeps its true gradient.
  The scaling is applied to the q/k/v projection outputs: RoPE and the cache are linear in them, so this is
  the same as scaling at the attention function's inputs, which is where lxt applies it.

Variant "cp-lrp" (lxt's `cp_LRP` map, Ali et al. 2022) stops the gradient through the queries, keys and the
MLP gate instead; the network is then linear in the input embeddings along the gradient path, so relevance
is exactly conserved (sums to the target logit). AttnLRP loses some relevance at the softmax by design.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.autograd import Function

VARIANTS = ("attnlrp", "cp-lrp")
# Architectures whose decoder is Llama's: RMSNorm weight * x * rsqrt(mean(x^2) + eps), gated MLP
# down(act(gate(x)) * up(x)), attention through q/k/v/o projections with RoPE.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class _ScaleGradient(Function):
    """Identity forward; the backward multiplies the gradient by a constant (the uniform rule)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _GradientSlope(Function):
    """Forward value y (an elementwise function of x, computed elsewhere); backward grad * slope to x.

    With slope = y / x this is the identity rule: Gradient x Input passes each element's relevance through.
    """

    @staticmethod
    def forward(ctx, x, y, slope):
        ctx.save_for_backward(slope)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def _scaled(factor):
    def hook(module, args, output):
        return _ScaleGradient.apply(output, factor)
    return hook


def _detached(module, args, output):
    return output.detach()


def _halve_input(module, args):
    return (_ScaleGradient.apply(args[0], 0.5), *args[1:])


def _identity_rule(module, args, output):
    x = args[0]
    # act(0) = 0 for SiLU: a slope of 0 there (any finite value would do; the relevance x * grad is 0).
    slope = output / torch.where(x == 0, torch.ones_like(x), x)
    return _GradientSlope.apply(x, output.detach(), slope.detach())


def _norm_rule(module, args, output):
    x = args[0]
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    slope = (module.weight.float() * scale).to(output.dtype)
    return _GradientSlope.apply(x, output.detach(), slope.detach())


def _decoder_modules(model):
    """(norms, attentions, mlps) of a Llama-like model; raises if the model is not one."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"AttnLRP rules are implemented for {SUPPORTED_MODEL_TYPES}, not model_type {model_type!r}")
    norms, attentions, mlps = [], [], []
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            norms.append(module)
        elif all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            attentions.append(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            mlps.append(module)
    layers = model.config.num_hidden_layers
    if (len(norms), len(attentions), len(mlps)) != (2 * layers + 1, layers, layers):
        raise ValueError(
            f"expected {2 * layers + 1} RMSNorms, {layers} attentions and {layers} gated MLPs in this "
            f"{model_type} model, found {len(norms)}, {len(attentions)} and {len(mlps)}"
        )
    return norms, attentions, mlps


@contextlib.contextmanager
def lrp_rules(model, variant: str = "attnlrp"):
    """Apply the LRP rules of `variant` to this model instance's backward pass for the duration of the block.

    Only forward hooks on this instance's modules are added, and all are removed on exit: classes, other
    instances and transformers' registries are untouched.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown LRP variant {variant!r}; choose one of {VARIANTS}")
    if model.training:
        raise ValueError("AttnLRP needs the model in eval mode (dropout active); call model.eval() first")
    norms, attentions, mlps = _decoder_modules(model)
    handles = []
    try:
        for norm in norms:
            handles.append(norm.register_forward_hook(_norm_rule))
        for attention in attentions:
            if variant == "attnlrp":
                handles.append(attention.q_proj.register_forward_hook(_scaled(0.25)))
                handles.append(attention.k_proj.register_forward_hook(_scaled(0.25)))
                handles.append(attention.v_proj.register_forward_hook(_scaled(0.5)))
            else:
                handles.append(attention.q_proj.register_forward_hook(_detached))
                handles.append(attention.k_proj.register_forward_hook(_detached))
        for mlp in mlps:
            if variant == "attnlrp":
                handles.append(mlp.act_fn.register_forward_hook(_identity_rule))
                handles.append(mlp.down_proj.register_forward_pre_hook(_halve_input))
            else:
                handles.append(mlp.gate_proj.register_forward_hook(_detached))
        yield model
    finally:
        for handle in handles:
            handle.remove()


class Attribution(NamedTuple):
    """relevance (steps, N + steps - 1): row k over every position of step k's input (prompt, then the generated
    tokens before k; zero past them). target_logits (steps,): the logit of generated token k at its step."""

    relevance: torch.Tensor
    target_logits: torch.Tensor


def _check_ids(input_ids, generated_ids) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, generated_ids = torch.as_tensor(input_ids), torch.as_tensor(generated_ids)
    for name, ids in (("input_ids", input_ids), ("generated_ids", generated_ids)):
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)} "
                             f"and dtype {ids.dtype}")
    # clone(): ids made under torch.inference_mode (generate's output) cannot enter an autograd graph.
    return input_ids.long().clone(), generated_ids.long().clone()


def attribution(model, input_ids, generated_ids, *, variant: str = "attnlrp") -> Attribution:
    """AttnLRP relevance of every input position for each generated token, teacher-forced.

    input_ids (N,) prompt ids, generated_ids (steps,) the generated ids. One forward over prompt +
    generated[:-1] (causal, so each step's logit sees exactly its own prefix), then one backward per step
    from that step's target logit; relevance = (input embeddings * gradient).sum(-1). The model's parameters
    get no .grad.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("AttnLRP needs gradients: call it outside torch.inference_mode()")
    input_ids, generated_ids = _check_ids(input_ids, generated_ids)
    n, steps = len(input_ids), len(generated_ids)
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, generated_ids[:-1]])[None].to(device)
    positions = torch.arange(steps, device=device)
    rows = torch.zeros(steps, ids.shape[1], dtype=torch.float32)
    with torch.enable_grad(), lrp_rules(model, variant):
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeddings, use_cache=False, logits_to_keep=steps).logits[0]
        targets = logits[positions, generated_ids.to(device)]
        for k in range(steps):
            (grad,) = torch.autograd.grad(targets[k], embeddings, retain_graph=k < steps - 1)
            rows[k, : n + k] = (embeddings.detach() * grad).float().sum(-1)[0, : n + k].cpu()
    return Attribution(rows, targets.detach().float().cpu())


def relevance(model, input_ids, generated_ids, *, variant: str = "attnlrp") -> torch.Tensor:
    """(steps, N) float32: AttnLRP relevance of each prompt token (N = len(input_ids)) for each generated token.

    Row k explains generated_ids[k] from its teacher-forced prefix (prompt + generated_ids[:k]); the target is
    that token's logit. See `attribution` for the relevance of the generated prefix and the target logits.
    """
    return attribution(model, input_ids, generated_ids, variant=variant).relevance[:, : len(input_ids)]
