"""Norm-weighted attention during generation (`attention="norm"`): each key's attention weighted by the norm of
what its value adds to the head's output, then renormalised.

Attention alone says where a head looks, not how much of what it finds reaches the output: the attention sink
takes most of every row but carries a value vector of almost no norm. Kobayashi et al. (2020, "Attention is
Not Only a Weight") weigh key j's attention p_hj by ||W_O^h v_hj||, the norm of its transformed value vector in
the head's share of the output projection. MACS takes the weighted row p_hj ||W_O^h v_hj|| / sum_k (...) in
place of the softmax row (a distribution over the same keys, so redistribution, pooling and the floor apply
unchanged). On stqa_350 with the default model it raises the best step's AUC-PR by +0.045 over the softmax rows
(docs/evaluation.md).

The norms are a property of each key, not of the query: `NormState` computes them once per key as it enters the
cache, through each head's Gram matrix W_O^h^T W_O^h (D x D: O(H D^2) per key, not O(H D E)), and keeps them
per cache slot: O(H) floats per key and layer.

The weighting is right only where the attention output enters the module's `o_proj`, a plain float nn.Linear over
the heads, unchanged (Llama's layout): `check_projections` refuses other projections before work (adapters,
quantised weights, another name), and `OutputWatch` refuses, at a model's first pass, a model that changes the
output on the way (a norm or a gate before `o_proj`).
"""
from __future__ import annotations

import torch

__all__ = ["NormState", "OutputWatch", "check_projections", "head_grams", "norm_weighted_rows", "value_norms"]

REFUSAL = "attention='norm' is not supported for this model: "


def check_projections(model, modules: dict[int, torch.nn.Module]) -> None:
    """Raise NotImplementedError unless every attention module's `o_proj` is a plain float nn.Linear taking the
    H query heads' outputs (H * D inputs): a wrapped layer (LoRA), a quantised one (its weight without its
    scales) or another layout would be weighed by the wrong matrix."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    for layer, module in modules.items():
        projection, head_dim = getattr(module, "o_proj", None), getattr(module, "head_dim", None)
        if type(projection) is not torch.nn.Linear:
            raise NotImplementedError(
                f"{REFUSAL}layer {layer}'s attention ({type(module).__name__}) has no plain torch.nn.Linear `o_proj` "
                f"(found {type(projection).__name__}): the norms need the output projection's weight"
            )
        weight = projection.weight
        if not weight.is_floating_point() or weight.element_size() < 2:
            raise NotImplementedError(f"{REFUSAL}layer {layer}'s o_proj weight is {weight.dtype} (quantised)")
        if heads is None or head_dim is None or projection.in_features != heads * head_dim:
            raise NotImplementedError(
                f"{REFUSAL}layer {layer}'s o_proj takes {projection.in_features} inputs, not the "
                f"num_attention_heads x head_dim = {heads} x {head_dim} attention outputs"
            )


class OutputWatch:
    """Forward pre-hooks on every `o_proj` that check its input is the attention output the tracer saw (`seen`,
    per layer, the last query's output): a model that normalises or gates the output before `o_proj` (BitNet's
    sub-norm, a gated attention) would be weighed by the wrong vectors. Use as a context manager."""

    def __init__(self, modules: dict[int, torch.nn.Module]):
        self.seen: dict[int, torch.Tensor] = {}
        self._handles = [module.o_proj.register_forward_pre_hook(self._check(layer, module))
                         for layer, module in modules.items()]

    def saw(self, layer: int, output: torch.Tensor) -> None:
        """The attention output (B, S, H, D) the tracer saw for `layer` in this pass: its last query is checked."""
        self.seen[layer] = output[:, -1].reshape(output.shape[0], -1)

    def _check(self, layer: int, module: torch.nn.Module):
        def hook(_projection, args):
            seen = self.seen.pop(layer, None)
            if seen is None:  # a pass the tracer did not score (suspended, or outside generate)
                return
            given = args[0][:, -1].reshape(seen.shape)
            if not torch.allclose(given.float(), seen.float(), rtol=1e-3, atol=1e-5):
                raise NotImplementedError(
                    f"{REFUSAL}{type(module).__name__} changes the attention output before o_proj (layer {layer}), "
                    "so the value norms through o_proj are not what the output depends on"
                )

        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()


def head_grams(o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(H, D, D) float32 Gram matrices W_O^h^T W_O^h of the output projection's weight (E, H * D), whose input
    is the attention output with heads major (transformers' o_proj)."""
    if not isinstance(o_weight, torch.Tensor) or o_weight.dim() != 2 or o_weight.shape[1] % num_heads:
        raise ValueError(f"o_weight must be an (E, H * D) matrix with H = {num_heads}, got "
                         f"{getattr(o_weight, 'shape', o_weight)!r}")
    per_head = o_weight.detach().double().reshape(o_weight.shape[0], num_heads, -1)  # (E, H, D)
    return torch.einsum("ehd,ehf->hdf", per_head, per_head).float()


def value_norms(value: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """value (B, H_kv, S, D), grams (H, D, D) -> (B, H, S) float32: ||W_O^h v_j|| for query head h (its KV head
    h // (H / H_kv)) and key slot j."""
    heads, (batch, kv_heads, slots, dim) = grams.shape[0], value.shape
    if heads % kv_heads or grams.shape[1:] != (dim, dim):
        raise ValueError(f"grams {tuple(grams.shape)} do not fit values {tuple(value.shape)}")
    v = value.float()
    # Query head h = k * G + g reads KV head k: grouped, so the values are never repeated per query head.
    grouped = grams.to(v.device).view(kv_heads, heads // kv_heads, dim, dim)
    squared = torch.einsum("bksd,kgdf,bksf->bkgs", v, grouped, v)
    return squared.clamp_min(0.0).sqrt().reshape(batch, heads, slots)


def norm_weighted_rows(rows: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """rows (B, H, S) softmax rows, norms (B, H, S) -> the rows weighted by the norms and renormalised over the
    keys (zeros stay zeros). A row whose attended keys all carry a zero value stays zero."""
    weighted = rows * norms
    total = weighted.sum(dim=-1, keepdim=True)
    return weighted / torch.where(total > 0, total, 1.0)


class NormState:
    """Per layer, the value norms (B, H, >= S) of every cache slot so far, and the layer's head Gram matrices.

    `update` on every pass of the layer: a sequence's first pass computes every slot's norm, each later pass
    the norm of the one slot it writes (kv_len - 1, where a static cache puts it too); `reorder` follows beam
    search. A sliding-window cache drops keys and a crop (assisted decoding) drops rejected ones: both are
    refused before work (core.support).
    """

    def __init__(self, grams: dict[int, torch.Tensor] | None = None):
        # The Gram matrices depend on the weights only: a tracer passes one dict to every sequence's state.
        self._grams = {} if grams is None else grams
        self._norms: dict[int, torch.Tensor] = {}

    def _layer_grams(self, layer: int, module: torch.nn.Module, head_dim: int) -> torch.Tensor:
        if layer not in self._grams:  # check_projections vetted o_proj before any pass
            weight = module.o_proj.weight
            self._grams[layer] = head_grams(weight, weight.shape[1] // head_dim)
        return self._grams[layer]

    def update(self, layer: int, module: torch.nn.Module, value: torch.Tensor, prefill: bool,
               kv_len: torch.Tensor) -> torch.Tensor:
        """The norms (B, H, S) of layer `layer` (attention module `module`) over the value cache's S slots after
        this pass wrote `value` (B, H_kv, S, D); kv_len (B,): each sequence's slots end (its new key is slot
        kv_len - 1)."""
        grams = self._layer_grams(layer, module, value.shape[3])
        if prefill or layer not in self._norms:
            self._norms[layer] = value_norms(value, grams)
            return self._norms[layer]
        norms, slots = self._norms[layer], value.shape[2]
        if norms.shape[-1] < slots:  # a dynamic cache grows a slot per pass: grow by doubling, not per pass
            norms = torch.nn.functional.pad(norms, (0, max(slots, 2 * norms.shape[-1]) - norms.shape[-1]))
            self._norms[layer] = norms
        index = (kv_len - 1).view(-1, 1, 1, 1).expand(-1, value.shape[1], 1, value.shape[3])
        new = value_norms(value.gather(2, index), grams)  # (B, H, 1)
        norms.scatter_(2, (kv_len - 1).view(-1, 1, 1).expand(-1, norms.shape[1], 1), new)
        return norms[..., :slots]

    def reorder(self, rows: torch.Tensor) -> None:
        """Follow a reorder of the cache's batch rows (beam search): row b now holds the keys of row rows[b]."""
        for layer, norms in self._norms.items():
            self._norms[layer] = norms.index_select(0, rows.to(norms.device))
