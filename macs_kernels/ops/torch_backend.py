"""Vectorised PyTorch implementations of the ops: they run on any device, and each is its operator's
default kernel (ops/<op>.py declares `torch.ops.macs_kernels.<op>` from the function's type hints).

Arguments arrive validated and positional in the operator's order; index tensors are (B,) (macs_pool:
(B, R)) int64 on the data's device.
Nothing here materialises more than one (B, H, S) row block per call: the O(S^2) attention matrix
never exists.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Pooling over heads (dim 1); `out=` lets a caller write the pooled row in place.
_POOL = {
    "max": lambda x, **out: torch.amax(x, dim=1, **out),
    "mean": lambda x, **out: torch.mean(x, dim=1, **out),
    "min": lambda x, **out: torch.amin(x, dim=1, **out),
}


def _column(index: torch.Tensor) -> torch.Tensor:
    return index.view(-1, 1)


def grouped_scores(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, D) . k (B, H_kv, S, D) -> float32 scores (B, H, S); query head h reads KV head h // G."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    # Scaling the queries, not the scores: D values per row instead of S.
    q_grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float().mul(scale)
    scores = torch.matmul(q_grouped, k_cache.float().transpose(-1, -2))
    return scores.reshape(batch, heads, -1)


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


def attended_softmax(scores, kv_start, kv_len, lse=None, *, softcap=None, sinks=None):
    """Probabilities over keys [kv_start, kv_len) (zero elsewhere) and their natural-log lse: scores (B, H, [R,]
    S) float32 (written over) with (B, [R]) ranges, lse (B, H, [R]).

    The layer's own softmax (`ops.Variant`): logits capped (cap_logits_) and sink logits in the denominator
    (sink_lse)."""
    cap_logits_(scores, softcap)
    positions = torch.arange(scores.shape[-1], device=scores.device)
    outside = (positions < kv_start.unsqueeze(-1)) | (positions >= kv_len.unsqueeze(-1))
    scores.masked_fill_(outside.unsqueeze(1), float("-inf"))
    if lse is None:
        lse = sink_lse(scores, sinks)
    return scores.sub_(lse.float().unsqueeze(-1)).exp_(), lse


def macs_update_rows(
    rows: Tensor, log_c: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, alpha: float, pooling: str,
    redistribute: bool,
) -> None:
    batch, heads, keys = rows.shape
    n_max = log_c.shape[1]
    rows = rows.float()
    n_input = input_end - input_start
    offsets = torch.arange(n_max, device=rows.device)
    input_keys = (_column(input_start) + offsets).clamp_max(keys - 1)
    inputs = rows.gather(2, input_keys[:, None, :].expand(batch, heads, n_max))
    if redistribute:
        positions = torch.arange(keys, device=rows.device)
        generated = (positions >= _column(input_end)) & (positions < _column(kv_len))
        spill = (rows * generated[:, None, :]).sum(dim=-1, keepdim=True)
        inputs = inputs + spill / n_input.view(-1, 1, 1)
    term = log_floor(_POOL[pooling](inputs), alpha)
    log_c.add_(term.masked_fill_(offsets >= _column(n_input), 0.0))


def log_floor(pooled, alpha):
    """MACS's floor and log, log(alpha * m' + 1 - alpha), of pooled m' (any shape; a new tensor, pooled is kept:
    callers keep the rows before the floor); alpha a float or a tensor that broadcasts (one alpha per row).
    The one torch form of the formula: every engine's rows and this backend's update ops take it from here."""
    # Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
    return pooled.clamp_min(0.0).mul_(alpha).add_(1.0 - alpha).log_()


def macs_pool_dense(q, k_cache, out, *, n_input, scale, pooling, redistribute):
    """`macs_pool` when keys [0, n_input) are every item's inputs (an unpadded batch with a growing cache) and
    the rows attend every slot causally: one row per item (q (B, H, D), out (B, N_max)) attends [0, S); a block
    of R rows (q (B, H, R, D), out (B, R, N_max), an assisted-decoding verify pass) has row r attend
    [0, S - R + 1 + r). n_input is a Python int, so there is no gather and no host sync: about a third of the
    general path's kernel launches, which is what a decode step pays per layer on a CPU."""
    _pool_dense_rows(_dense_rows(q, k_cache, scale), out, n_input, pooling, redistribute)


def _dense_rows(q, k_cache, scale):
    """Softmax rows (B, H, [R,] S) float32 of `macs_pool_dense`'s causal ranges."""
    scores = grouped_scores(q, k_cache, scale) if q.dim() == 3 else _causal_block_scores(q, k_cache, scale)
    return torch.softmax(scores, dim=-1)


def _block_scores(q, k_cache, scale):
    """q (B, H, R, D) . k (B, H_kv, S, D) -> float32 scores (B, H, R, S); query head h reads KV head h // G."""
    batch, heads, rows, dim = q.shape
    kv_heads, keys = k_cache.shape[1], k_cache.shape[2]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * rows, dim).float().mul(scale)
    return torch.matmul(grouped, k_cache.float().transpose(-1, -2)).view(batch, heads, rows, keys)


def _causal_block_scores(q, k_cache, scale):
    """`_block_scores`, -inf past row r's causal range [0, S - R + 1 + r)."""
    rows, keys = q.shape[2], k_cache.shape[2]
    scores = _block_scores(q, k_cache, scale)
    if rows > 1:  # only the last R - 1 keys lie past some row's range: mask that (R, R - 1) corner
        past_range = torch.ones(rows, rows - 1, dtype=torch.bool, device=q.device).triu_()
        scores[..., keys - rows + 1:].masked_fill_(past_range, float("-inf"))
    return scores


def _pool_dense_rows(rows, out, n_input, pooling, redistribute):
    """Rows (B, H, [R,] S) of keys whose first n_input are the inputs -> m' into out (B, [R,] N_max)."""
    # A decode step pays per kernel launch on a CPU: the spread (add's alpha) and the pooling (out=) are one
    # kernel each.
    inputs = rows[..., :n_input]
    if redistribute and rows.shape[-1] > n_input:
        inputs = torch.add(inputs, rows[..., n_input:].sum(dim=-1, keepdim=True), alpha=1.0 / n_input)
    _POOL[pooling](inputs, out=out[..., :n_input])
    if out.shape[-1] > n_input:
        out[..., n_input:].zero_()


def grouped_output(probabilities, v_cache, dtype):
    """p (B, H, [R,] S) . v (B, H_kv, S, D) -> (B, H, [R,] D) in `dtype`, the query heads of a group sharing V."""
    batch, kv_heads, keys = probabilities.shape[0], v_cache.shape[1], probabilities.shape[-1]
    out = torch.matmul(probabilities.reshape(batch, kv_heads, -1, keys), v_cache.float())
    return out.reshape(*probabilities.shape[:-1], -1).to(dtype)


def decode_attention_dense(q, k_cache, v_cache, pooled, *, n_input, scale, pooling, redistribute):
    """`decode_attention` writing `macs_pool_dense`'s m' into pooled under its conditions, one row per item
    (q (B, H, D) -> (B, H, D)) or a causal block (q (B, H, R, D) -> (B, H, R, D)): K is read once."""
    rows = _dense_rows(q, k_cache, scale)
    _pool_dense_rows(rows, pooled, n_input, pooling, redistribute)
    return grouped_output(rows, v_cache, q.dtype)


def macs_update(
    q: Tensor, k_cache: Tensor, log_c: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, scale: float,
    alpha: float, pooling: str, redistribute: bool, lse: Tensor | None,
) -> None:
    scores = grouped_scores(q, k_cache, scale)
    probabilities, _ = attended_softmax(scores, input_start, kv_len, lse)
    macs_update_rows(probabilities, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute)


def macs_pool(
    q: Tensor, k_cache: Tensor, out: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, scale: float,
    pooling: str, redistribute: bool, lse: Tensor | None, score_start: Tensor | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> None:
    """q (B, H, R, D), ranges (B, R), out (B, R, N_max): see ops.macs_pool.

    The layer's attention variant, in key slots (what `macs_pool_variant` makes of an ops.Variant): the row
    attends [input_start, kv_len) and its N inputs are [score_start, input_end) (default input_start; a
    sliding window starts later than its inputs, which may precede slot 0); softcap; sinks (H,)."""
    scores = _block_scores(q, k_cache, scale)
    probabilities, _ = attended_softmax(scores, input_start, kv_len, lse, softcap=softcap, sinks=sinks)
    windowed = score_start is not None
    _pool_rows(probabilities, out, score_start if windowed else input_start, input_end, kv_len, pooling,
               redistribute, windowed=windowed)


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
    return tuple(bound - key_offset for bound in (attend, input_start, input_end, kv_len))


def macs_pool_variant(q, k_cache, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse=None, *,
                      key_offset=0, window=None, softcap=None, sinks=None, kernel=macs_pool):
    """`macs_pool` of a layer whose attention is a variant (`ops.Variant`: window, softcap, sinks) over a cache
    whose slot 0 holds token key_offset (an int or (B, R)); ranges in token positions. `kernel`: a macs_pool
    kernel taking the variant arguments (the CUDA extension's runs through here too)."""
    attend, start, end, length = window_ranges(input_start, input_end, kv_len, key_offset, window)
    kernel(q, k_cache, out, attend, end, length, scale, pooling, redistribute, lse,
           None if window is None else start, softcap, sinks)


def gather_pages(k_pages: Tensor, block_table: Tensor, keys: int) -> Tensor:
    """The first `keys` keys of each item from a paged cache: k_pages (P, page_size, H_kv, D) and block_table
    (B, pages) (key j of item b in page block_table[b, j // page_size], slot j % page_size) -> (B, H_kv,
    keys, D). Entries past an item's keys may be anything (-1 for unused): only the pages that hold one of
    the first `keys` keys are read, and those of a shorter item are clamped into range (their keys are
    never attended)."""
    page_size = k_pages.shape[1]
    used = block_table[:, : -(-keys // page_size)].long().clamp(0, k_pages.shape[0] - 1)
    pages = k_pages[used]  # (B, pages, page_size, H_kv, D)
    return pages.flatten(1, 2)[:, :keys].transpose(1, 2)


def macs_pool_paged(
    q: Tensor, k_pages: Tensor, block_table: Tensor, out: Tensor, input_start: Tensor, input_end: Tensor,
    kv_len: Tensor, scale: float, pooling: str, redistribute: bool, lse: Tensor | None,
    score_start: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> None:
    """macs_pool over a paged cache: the pages the rows attend, gathered into one (B, H_kv, S, D) block
    (S = the longest row's kv_len), then macs_pool (score_start, softcap, sinks: the layer's variant as
    macs_pool takes it)."""
    keys = int(kv_len.max()) if kv_len.numel() else 0
    macs_pool(q, gather_pages(k_pages, block_table, keys), out, input_start, input_end, kv_len, scale, pooling,
              redistribute, lse, score_start, softcap, sinks)


def macs_pool_paged_variant(q, k_pages, block_table, out, *arguments, kernel=macs_pool_paged, **variant):
    """`macs_pool_variant` over a paged cache (its slots are the tokens: key_offset stays 0); `kernel`: a
    macs_pool_paged kernel taking the variant arguments."""
    def keys_in_pages(q, _, out, *rest):
        kernel(q, k_pages, block_table, out, *rest)

    macs_pool_variant(q, None, out, *arguments, kernel=keys_in_pages, **variant)


def _pool_rows(probabilities, out, input_start, input_end, kv_len, pooling, redistribute, windowed=False):
    """m' of rows (B, H, [R,] S) over ranges (B, [R]) into out (B, [R,] N_max): the inputs' probabilities plus
    (when redistributing) the row's mass on generated keys / N, pooled over heads; 0 past each row's N.
    windowed: input slots may lie before slot 0 (a sliding-window cache dropped those tokens): they get 0."""
    keys, n_max = probabilities.shape[-1], out.shape[-1]
    heads_dim = 1
    start, end, length = (index.unsqueeze(-1) for index in (input_start, input_end, kv_len))
    offsets = torch.arange(n_max, device=out.device)
    n_input = end - start
    input_keys = start + offsets
    dropped = (input_keys < 0).unsqueeze(heads_dim) if windowed else None
    input_keys = input_keys.clamp(0 if windowed else None, keys - 1).unsqueeze(heads_dim)
    inputs = probabilities.gather(-1, input_keys.expand(*probabilities.shape[:-1], n_max))
    if windowed:
        inputs.masked_fill_(dropped, 0.0)
    if redistribute:
        positions = torch.arange(keys, device=out.device)
        generated = ((positions >= end) & (positions < length)).unsqueeze(heads_dim)
        spill = (probabilities * generated).sum(dim=-1, keepdim=True)
        inputs = inputs + spill / n_input.unsqueeze(heads_dim)
    out.copy_(_POOL[pooling](inputs).masked_fill_(offsets >= n_input, 0.0))


def macs_zscore(log_c: Tensor, n_input: Tensor) -> Tensor:
    n_max = log_c.shape[1]
    valid = torch.arange(n_max, device=log_c.device) < _column(n_input)
    masked = log_c.masked_fill(~valid, float("-inf"))
    top = masked.amax(dim=1, keepdim=True)
    # z is invariant to scaling c; a row of -inf (all attention underflowed) has no finite top.
    c = torch.exp(masked - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    count = _column(n_input).clamp_min(1).to(c.dtype)
    mean = c.sum(dim=1, keepdim=True) / count
    centred = (c - mean).masked_fill_(~valid, 0.0)
    std = torch.sqrt(centred.square().sum(dim=1, keepdim=True) / count)
    return torch.where(std > 0, centred / std, torch.zeros_like(centred))


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_start: Tensor, kv_len: Tensor, scale: float, log_c: Tensor | None,
    input_end: Tensor | None, alpha: float, pooling: str, redistribute: bool, pooled: Tensor | None,
    score_start: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """See ops.decode_attention; score_start, softcap, sinks: the layer's attention variant in key slots, as
    macs_pool takes them (score_start with pooled only). The output is the layer's (sink mass attends no
    value).

    pooled has no default although it is optional: torch before 2.13 hands a Python kernel its arguments without
    the trailing ones equal to their defaults, and its ADInplaceOrView kernel of this mutating op then indexes the
    missing written argument (IndexError on every call that left pooled at None)."""
    if score_start is not None and log_c is not None:
        raise ValueError("decode_attention: score_start (a sliding window's input columns) comes with pooled, "
                         "not log_c")
    scores = grouped_scores(q, k_cache, scale)
    probabilities, lse = attended_softmax(scores, kv_start, kv_len, softcap=softcap, sinks=sinks)
    if log_c is not None and pooled is None:
        macs_update_rows(probabilities, log_c, kv_start, input_end, kv_len, alpha, pooling, redistribute)
    elif pooled is not None:
        windowed = score_start is not None
        _pool_rows(probabilities, pooled, score_start if windowed else kv_start, input_end, kv_len, pooling,
                   redistribute, windowed=windowed)
    return grouped_output(probabilities, v_cache, q.dtype), lse


def decode_attention_variant(q, k_cache, v_cache, kv_start, kv_len, scale, input_end, pooling, redistribute, pooled,
                             *, key_offset=0, window=None, softcap=None, sinks=None, kernel=decode_attention):
    """`decode_attention` (optionally writing m' into pooled) of a layer whose attention is a variant (see
    `macs_pool_variant`; `kernel`: a decode_attention kernel taking the variant arguments)."""
    end = kv_len if input_end is None else input_end
    attend, start, end, length = window_ranges(kv_start, end, kv_len, key_offset, window)
    return kernel(q, k_cache, v_cache, attend, length, scale, None, None if pooled is None else end, 0.0, pooling,
                  redistribute, pooled, None if window is None or pooled is None else start, softcap, sinks)

