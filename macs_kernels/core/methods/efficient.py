"""Efficient attention during generation: incremental Gram matrices and efficient rows from them.

The efficient row of a softmax row p is its projection onto the span of its keys' X = [V, 1] (see
ops.efficient_attention). The tracer keeps one `GramState` per generation: per layer, on each forward
pass, `append` the new value rows (pads marked invalid), then `efficient_rows` for the last query's
softmax row, then ops.macs_update_rows with the result. The Gram matrix is then never recomputed: each
step adds T rank-1 terms, O(T H_kv D^2), instead of O(S H_kv D^2).
"""
from __future__ import annotations

import torch

from macs_kernels.ops.efficient_attention import check_efficient_args
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch.efficient import DEFAULT_RCOND, augmented

__all__ = ["DEFAULT_RCOND", "GramState", "efficient_rows"]


class GramState:
    """Per layer, the float64 Gram matrices X^T X (B, H_kv, D+1, D+1) of X = [V, 1] over each sequence's
    valid keys so far.

    Allocated at a layer's first `append` from the values' shape and device. The state must see exactly
    the keys that `efficient_rows` later attends ([kv_start, kv_len) of the cache): append every attended
    slot at a sequence's first pass (pads and a static cache's unused slots invalid), then each new token's
    slot, and `reorder` it with the cache (beam search). A sliding-window layer drops keys from its cache,
    and a crop (assisted decoding) drops rejected ones, which this state cannot follow.
    """

    def __init__(self, num_layers: int):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self._grams: list[torch.Tensor | None] = [None] * num_layers
        self._tokens: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return len(self._grams)

    def append(self, layer_idx: int, v_new: torch.Tensor, valid: torch.Tensor) -> None:
        """Add the keys v_new (B, H_kv, T, D) whose valid (B, T) entry is True: a rank-T update, in place."""
        if not 0 <= layer_idx < len(self._grams):
            raise IndexError(f"layer_idx {layer_idx} is outside [0, {len(self._grams)})")
        if not isinstance(v_new, torch.Tensor) or v_new.dim() != 4 or not v_new.is_floating_point():
            raise ValueError(f"v_new must be a float (B, H_kv, T, D) tensor, got {getattr(v_new, 'shape', v_new)!r}")
        batch, kv_heads, steps, dim = v_new.shape
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (batch, steps):
            raise ValueError(
                f"valid must be a bool tensor of shape ({batch}, {steps}), got {getattr(valid, 'shape', valid)!r}"
            )
        gram = self._grams[layer_idx]
        if gram is None:
            gram = torch.zeros(batch, kv_heads, dim + 1, dim + 1, dtype=torch.float64, device=v_new.device)
            self._grams[layer_idx] = gram
            self._tokens[layer_idx] = torch.zeros(batch, dtype=torch.int64, device=v_new.device)
        elif gram.shape[:2] != (batch, kv_heads) or gram.shape[-1] != dim + 1 or gram.device != v_new.device:
            raise ValueError(
                f"layer {layer_idx} holds ({gram.shape[0]}, {gram.shape[1]}) x D={gram.shape[-1] - 1} on "
                f"{gram.device}; v_new is {tuple(v_new.shape)} on {v_new.device}"
            )
        x = augmented(v_new, torch.float64) * valid.to(v_new.device)[:, None, :, None]
        gram.add_(x.transpose(-1, -2) @ x)
        self._tokens[layer_idx].add_(valid.to(v_new.device).sum(dim=1))

    def reorder(self, rows: torch.Tensor) -> None:
        """Follow a reorder of the cache's batch rows (beam search): row b now holds the keys of row rows[b]."""
        for layer, gram in enumerate(self._grams):
            if gram is not None:
                self._grams[layer] = gram.index_select(0, rows.to(gram.device))
                self._tokens[layer] = self._tokens[layer].index_select(0, rows.to(gram.device))

    def started(self, layer_idx: int) -> bool:
        """Whether anything was appended to layer `layer_idx` yet."""
        return self._grams[layer_idx] is not None

    def gram(self, layer_idx: int) -> torch.Tensor:
        """(B, H_kv, D+1, D+1) float64 Gram matrix of layer `layer_idx` (the state's own tensor)."""
        if self._grams[layer_idx] is None:
            raise RuntimeError(f"nothing was appended to layer {layer_idx} yet")
        return self._grams[layer_idx]

    def tokens(self, layer_idx: int) -> torch.Tensor:
        """(B,) int64: valid keys appended to layer `layer_idx` so far."""
        self.gram(layer_idx)
        return self._tokens[layer_idx]


def efficient_rows(p_last, v_cache, gram, kv_start, kv_len, rcond=DEFAULT_RCOND, backend=None):
    """Efficient rows of p_last (B, H, S) or (B, H, R, S) over keys [kv_start, kv_len), from a given Gram.

    gram: (B, H_kv, D+1, D+1) float64 X^T X over exactly those keys (a GramState's), used instead of
    recomputing it. Same result as ops.efficient_attention(p, v_cache, kv_len=..., kv_start=...)
    (non-causal: all R rows attend every key), which computes the Gram matrix itself.
    Returns (a_eff shaped like p_last, residual (B, H) or (B, H, R)).
    """
    if not isinstance(p_last, torch.Tensor) or p_last.dim() not in (3, 4):
        raise ValueError(f"p_last must be a (B, H, S) or (B, H, R, S) tensor, got {getattr(p_last, 'shape', p_last)!r}")
    single = p_last.dim() == 3
    p = p_last.unsqueeze(2) if single else p_last
    kv_start, kv_len = check_efficient_args(p, v_cache, kv_start, kv_len, rcond)
    width = v_cache.shape[3] + 1
    expected = (p.shape[0], v_cache.shape[1], width, width)
    if not isinstance(gram, torch.Tensor) or tuple(gram.shape) != expected or gram.dtype != torch.float64:
        raise ValueError(f"gram must be a float64 tensor of shape {expected}, got {getattr(gram, 'shape', gram)!r}")
    if gram.device != p.device:
        raise ValueError(f"gram is on {gram.device} but p is on {p.device}")
    a_eff, residual = kernel(backend, p.device, "efficient_attention")(
        p, v_cache, kv_start=kv_start, kv_len=kv_len, causal=False, rcond=float(rcond), gram=gram
    )
    return (a_eff.squeeze(2), residual.squeeze(2)) if single else (a_eff, residual)
