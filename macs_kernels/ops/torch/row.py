"""The attention row of a layer in torch: the one home of its formulas, whatever holds the keys.

A scored query row goes through the same steps in every layout (a batch-major cache with per-row ranges,
continuous batching's packed key tensor, a paged cache, beams that share their input keys):

1. scores: q . k * scale in float32, query head h reading KV head h // G (`grouped_queries`, `key_scores`,
   `grouped_scores`);
2. the layer's variant (`ops.Variant`): a sliding window's first attended key (`window_start`; in a cache that
   dropped the tokens that slid out, `window_ranges` turns token positions into key slots), keys outside the
   attended range masked (`outside_range`), logits capped (`cap_logits_`), sink logits in the denominator
   (`sink_lse`);
3. the softmax (`softmax`, or `attended_softmax` for steps 2 and 3 at once) and the attention output
   (`grouped_output`);
4. MACS's pooled row m': each input's probability (`input_slots`, `input_probabilities`) plus the row's mass on
   generated keys spread over its N inputs (`generated_mass`, `spread`), pooled over heads (`POOLS`);
   `pooled_inputs` does all of step 4 for rows given by ranges;
5. the floor and the log (`log_floor`).

The layouts (torch_backend: ranges and the dense fast paths; torch_packed: packed segments and pages;
torch_beams: beams sharing their input keys) only gather the keys each row reads and call these.
Shapes: B items, H query heads, H_kv KV heads (G = H / H_kv), [R] rows per item where a caller has them, S key
slots, D head dimension, N_max the longest row's input count.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Pooling over heads (dim 1); `out=` lets a caller write the pooled row in place.
POOLS = {
    "max": lambda x, **out: torch.amax(x, dim=1, **out),
    "mean": lambda x, **out: torch.mean(x, dim=1, **out),
    "min": lambda x, **out: torch.amin(x, dim=1, **out),
}


# ---- 1. scores ------------------------------------------------------------------------------------
def grouped_queries(q: Tensor, kv_heads: int, scale: float) -> Tensor:
    """q (B, H, [R,] D) -> float32 q * scale as (B, H_kv, G [* R], D): the rows that read one KV head side by
    side, so that one product per KV head scores them all."""
    # Scaling the queries, not the scores: D values per row instead of S.
    return q.reshape(q.shape[0], kv_heads, -1, q.shape[-1]).float().mul(scale)


def key_scores(grouped: Tensor, keys: Tensor, out: Tensor | None = None) -> Tensor:
    """grouped queries (..., H_kv, X, D) (`grouped_queries`) . keys (..., H_kv, S, D) -> float32 (..., H_kv, X, S),
    into out (a view is fine) when given."""
    return torch.matmul(grouped, keys.float().transpose(-1, -2), out=out)


def grouped_scores(q: Tensor, keys: Tensor, scale: float) -> Tensor:
    """q (B, H, [R,] D) . keys (B, H_kv, S, D) -> float32 scores (B, H, [R,] S); query head h reads KV head h // G."""
    scores = key_scores(grouped_queries(q, keys.shape[1], scale), keys)
    return scores.view(*q.shape[:-1], keys.shape[-2])


# ---- 2. the layer's variant -------------------------------------------------------------------------
def window_start(start, end, window):
    """The first key a row ending at `end` (exclusive) attends when it may attend from `start`: a sliding window
    of `window` keys starts at end - window (tensors, broadcast; no window: start)."""
    return start if window is None else torch.maximum(start, end - window)


def window_ranges(input_start, input_end, kv_len, key_offset=0, window=None):
    """A row's ranges in token positions -> the same in key slots of a cache that holds tokens from key_offset on
    (a sliding-window layer's), with the attended start: (attend_start, input_start, input_end, kv_len) slots.

    The row attends tokens [max(input_start, kv_len - window), kv_len); input tokens before that get no
    attention, and their slots may lie before slot 0 (not in the cache at all)."""
    attend = window_start(input_start, kv_len, window)
    bounds = (attend, input_start, input_end, kv_len)
    if isinstance(key_offset, int) and key_offset == 0:
        return bounds
    return tuple(bound - key_offset for bound in bounds)


def outside_range(keys: int, start: Tensor, end: Tensor) -> Tensor:
    """(*start.shape, keys) bool: True at the key slots outside [start, end) (start and end broadcast)."""
    positions = torch.arange(keys, device=end.device)
    return (positions < start.unsqueeze(-1)) | (positions >= end.unsqueeze(-1))


def cap_logits_(scores: Tensor, softcap: float | None) -> Tensor:
    """Gemma 2's logit cap, softcap * tanh(s / softcap), in place (no cap when softcap is None)."""
    return scores if softcap is None else scores.div_(softcap).tanh_().mul_(softcap)


def sink_lse(scores: Tensor, sinks: Tensor | None, head_dim: int = 1) -> Tensor:
    """The softmax's natural-log normaliser over the last dimension of scores, with gpt-oss's per-head sink
    logits sinks (H,) (heads at `head_dim`) in the denominator only, so the probabilities sum to less than 1."""
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is None:
        return lse
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    return torch.logaddexp(lse, sinks.float().view(shape))


# ---- 3. softmax and output --------------------------------------------------------------------------
def softmax(scores: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Probabilities over the last dimension of float32 scores (B, H, ...) (-inf: not attended), a new tensor:
    torch's softmax (one kernel), or with sink logits sinks (H,) in its denominator (`sink_lse`)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    return torch.exp(scores - sink_lse(scores, sinks).unsqueeze(-1))


def attended_softmax(scores, kv_start, kv_len, lse=None, *, softcap=None, sinks=None):
    """Probabilities over keys [kv_start, kv_len) (zero elsewhere) and their natural-log lse: scores (B, H, [R,]
    S) float32 (written over) with (B, [R]) ranges, lse (B, H, [R]) (computed when not given).

    The layer's own softmax (`ops.Variant`): logits capped (cap_logits_) and sink logits in the denominator
    (sink_lse)."""
    cap_logits_(scores, softcap)
    scores.masked_fill_(outside_range(scores.shape[-1], kv_start, kv_len).unsqueeze(1), float("-inf"))
    if lse is None:
        lse = sink_lse(scores, sinks)
    return scores.sub_(lse.float().unsqueeze(-1)).exp_(), lse


def grouped_output(probabilities: Tensor, values: Tensor, dtype: torch.dtype | None = None,
                   out: Tensor | None = None) -> Tensor:
    """probabilities (B, H, [R,] S) . values (B, H_kv, S, D) -> (B, H, [R,] D), the query heads of a group sharing
    V: float32 (into out, a view is fine, when given), or in `dtype`."""
    batch, kv_heads, keys, dim = probabilities.shape[0], values.shape[1], probabilities.shape[-1], values.shape[-1]
    grouped = torch.matmul(probabilities.reshape(batch, kv_heads, -1, keys), values.float(),
                           out=None if out is None else out.view(batch, kv_heads, -1, dim))
    result = grouped.view(*probabilities.shape[:-1], dim)
    return result if dtype is None else result.to(dtype)


# ---- 4. the pooled row m' ---------------------------------------------------------------------------
def input_slots(input_start: Tensor, n_max: int, keys: int, windowed: bool = False):
    """Where each row's inputs lie among `keys` slots, input i at input_start + i (input_start (B, [R])): (slots
    (B, [R,] N_max) clamped into the rows, and with `windowed` the inputs before slot 0 (a sliding-window cache
    dropped those tokens: they get 0), else None). Entries past a row's N are not inputs."""
    slots = input_start.unsqueeze(-1) + torch.arange(n_max, device=input_start.device)
    dropped = (slots < 0) if windowed else None
    # Without a window a slot before 0 comes only from an unchecked range: clamped as the kernels clamp it.
    return slots.clamp(0, keys - 1), dropped


def input_probabilities(rows: Tensor, slots) -> Tensor:
    """(B, H, [R,] N_max): the probabilities of rows (B, H, [R,] S) on the inputs at `slots` (`input_slots`)."""
    index, dropped = slots
    inputs = rows.gather(-1, index.unsqueeze(1).expand(*rows.shape[:-1], index.shape[-1]))
    return inputs if dropped is None else inputs.masked_fill_(dropped.unsqueeze(1), 0.0)


def generated_mass(rows: Tensor, generated: Tensor) -> Tensor:
    """(B, H, [R,] 1): each row's probability on its generated keys, generated (B, [R,] S) bool (a row with ranges:
    slots [input_end, kv_len), ~outside_range(S, input_end, kv_len))."""
    return (rows * generated.unsqueeze(1)).sum(dim=-1, keepdim=True)


def spread(inputs: Tensor, mass: Tensor, n_input) -> Tensor:
    """Redistribution: each input's probability (..., N_max) plus an N-th of its row's mass on generated keys
    (..., 1); n_input: an int (one N for every row: one kernel) or a tensor that broadcasts against mass."""
    if isinstance(n_input, int):
        return torch.add(inputs, mass, alpha=1.0 / n_input)
    return inputs + mass / n_input


def pooled_inputs(rows, input_start, input_end, kv_len, n_max, pooling, redistribute, windowed=False):
    """m' of rows (B, H, [R,] S) with (B, [R]) ranges in their slots: (pooled (B, [R,] N_max), past_inputs
    (B, [R,] N_max) True past each row's N, where pooled holds anything). windowed: see `input_slots`."""
    n_input = (input_end - input_start).unsqueeze(-1)
    inputs = input_probabilities(rows, input_slots(input_start, n_max, rows.shape[-1], windowed))
    if redistribute:
        generated = ~outside_range(rows.shape[-1], input_end, kv_len)
        inputs = spread(inputs, generated_mass(rows, generated), n_input.unsqueeze(1))
    past_inputs = torch.arange(n_max, device=rows.device) >= n_input
    return POOLS[pooling](inputs), past_inputs


# ---- 5. floor and log -------------------------------------------------------------------------------
def log_floor(pooled, alpha):
    """MACS's floor and log, log(alpha * m' + 1 - alpha), of pooled m' (any shape; a new tensor, pooled is kept:
    callers keep the rows before the floor); alpha a float or a tensor that broadcasts (one alpha per row).
    The one torch form of the formula: every engine's rows and the torch update ops take it from here."""
    # Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
    return pooled.clamp_min(0.0).mul_(alpha).add_(1.0 - alpha).log_()
