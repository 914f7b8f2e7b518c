"""Float64 references, written for clarity, one sequence at a time.

Tests and benchmarks both compare against these functions; they share no code with the backends
(no masks-as-biases, no gathers, no fused forms), so an error in a backend cannot hide here too.
Every function takes plain tensors and returns float64 tensors on the CPU.
"""
from __future__ import annotations

import math

import torch

from macs_kernels.ops._checks import DEFAULT_ALPHA


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)


def softmax_row_reference(q: torch.Tensor, keys: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query's softmax over the given keys. q: (D,), keys: (n, D) -> (probabilities (n,), lse scalar)."""
    scores = (_f64(keys) @ _f64(q)) * scale
    lse = torch.logsumexp(scores, dim=0)
    return torch.exp(scores - lse), lse


def pooled_row_reference(
    rows: torch.Tensor, n_input: int, *, pooling: str = "max", redistribute: bool = True
) -> torch.Tensor:
    """m' of one layer: rows (H, K) of one query over its K attended keys, the N = n_input inputs first, then
    the generated tokens, whose mass is spread over the inputs when `redistribute`. Returns (N,) float64."""
    rows = _f64(rows)
    inputs = rows[:, :n_input]
    if redistribute:
        inputs = inputs + rows[:, n_input:].sum(dim=1, keepdim=True) / n_input
    return {"max": inputs.amax(dim=0), "mean": inputs.mean(dim=0), "min": inputs.amin(dim=0)}[pooling]


def layer_log_term_reference(
    rows: torch.Tensor, n_input: int, *, alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True
) -> torch.Tensor:
    """log(alpha * m' + 1 - alpha) of one layer, from that layer's rows (see pooled_row_reference).
    Negative pooled values (efficient attention) clamp to 0."""
    pooled = pooled_row_reference(rows, n_input, pooling=pooling, redistribute=redistribute)
    return torch.log(alpha * pooled.clamp_min(0.0) + (1.0 - alpha))


def zscore_reference(log_c: torch.Tensor) -> torch.Tensor:
    """z-scores of c = exp(log_c) over one row (population standard deviation; zeros when it is 0)."""
    log_c = _f64(log_c)
    top = log_c.max()
    if not math.isfinite(top.item()):
        return torch.zeros_like(log_c)
    c = torch.exp(log_c - top)
    std = c.std(unbiased=False)
    if std.item() == 0.0:
        return torch.zeros_like(c)
    return (c - c.mean()) / std


def log_zscore_reference(log_c: torch.Tensor) -> torch.Tensor:
    """Reference of explanation.log_zscores, row by row: z-scores of the finite log c values (population
    standard deviation; zeros when it is 0), -inf entries kept as -inf."""
    log_c = _f64(log_c)
    if log_c.dim() > 1:
        return torch.stack([log_zscore_reference(row) for row in log_c])
    finite = torch.isfinite(log_c)
    out = log_c.clone()
    if finite.any():
        values = log_c[finite]
        std = values.std(unbiased=False)
        out[finite] = (values - values.mean()) / std if std.item() > 0 else torch.zeros_like(values)
    return out


def best_runs_reference(z: torch.Tensor, length: int) -> torch.Tensor:
    """Each token's best copied run, by brute force over the (steps, N) z-scores `z`: every diagonal of k =
    min(length, steps, N) cells (step t + j, token i + j for j < k) is worth its smallest z-score, an underflowed
    (-inf) cell counting as its row's lowest finite one, and each of its k tokens keeps the best diagonal it lies
    on. Returns (N,) float64."""
    z = _f64(z)
    steps, n = z.shape
    k = min(length, steps, n)
    filled = z.clone()
    for row in filled:
        finite = torch.isfinite(row)
        row[~finite] = row[finite].min() if finite.any() else 0.0
    best = torch.full((n,), -math.inf, dtype=torch.float64)
    for t in range(steps - k + 1):
        for i in range(n - k + 1):
            value = min(filled[t + j, i + j].item() for j in range(k))
            for j in range(k):
                best[i + j] = max(best[i + j].item(), value)
    return best


def macs_step_reference(
    rows_per_layer, n_input: int, *, alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """MACS of one forward pass: rows_per_layer is a sequence of (H, K) rows, one per layer.

    Returns (log_c (N,), z (N,)), both float64.
    """
    log_c = torch.zeros(n_input, dtype=torch.float64)
    for rows in rows_per_layer:
        log_c = log_c + layer_log_term_reference(
            rows, n_input, alpha=alpha, pooling=pooling, redistribute=redistribute
        )
    return log_c, zscore_reference(log_c)


def _ints(values, batch=None) -> list[int]:
    """A list of ints from a tensor, a sequence or one int (repeated over `batch` when given)."""
    tensor = torch.as_tensor(values)
    return [int(v) for v in (tensor.flatten() if batch is None else tensor.expand(batch)).tolist()]


def _row_ranges(batch, input_start, input_end, kv_len):
    """(b, start, end, length) per item; an int range holds for every item (zip would stop after the first)."""
    return zip(range(batch), *(_ints(values, batch) for values in (input_start, input_end, kv_len)))


def macs_update_rows_reference(
    rows, log_c, *, input_start, input_end, kv_len, alpha=DEFAULT_ALPHA, pooling="max", redistribute=True
) -> torch.Tensor:
    """Reference of ops.macs_update_rows: rows (B, H, S) -> the updated log_c (B, N_max), float64."""
    out = _f64(log_c).clone()
    for b, start, end, length in _row_ranges(rows.shape[0], input_start, input_end, kv_len):
        term = layer_log_term_reference(
            rows[b, :, start:length], end - start, alpha=alpha, pooling=pooling, redistribute=redistribute
        )
        out[b, : end - start] += term
    return out


def macs_update_reference(
    q, k_cache, log_c, *, input_start, input_end, kv_len, scale, alpha=DEFAULT_ALPHA, pooling="max", redistribute=True
) -> torch.Tensor:
    """Reference of ops.macs_update: q (B, H, D), k_cache (B, H_kv, S, D) -> updated log_c (B, N_max), float64."""
    batch, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    rows = torch.zeros(batch, heads, k_cache.shape[2], dtype=torch.float64)
    for b, start, _, length in _row_ranges(batch, input_start, input_end, kv_len):
        for h in range(heads):
            rows[b, h, start:length] = softmax_row_reference(q[b, h], k_cache[b, h // group, start:length], scale)[0]
    return macs_update_rows_reference(
        rows, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len,
        alpha=alpha, pooling=pooling, redistribute=redistribute,
    )


def macs_pool_reference(
    q, k_cache, *, input_start, input_end, kv_len, scale, pooling="max", redistribute=True
) -> torch.Tensor:
    """Reference of ops.macs_pool: q (B, H, R, D), k_cache (B, H_kv, S, D), ranges (B, R) -> m' (B, R, N_max)
    float64, N_max the largest N, zeros past each row's N."""
    batch, heads, rows, _ = q.shape
    group = heads // k_cache.shape[1]
    ranges = [torch.as_tensor(t).expand(batch, rows).tolist() for t in (input_start, input_end, kv_len)]
    n_max = max(end - start for starts, ends in zip(ranges[0], ranges[1]) for start, end in zip(starts, ends))
    out = torch.zeros(batch, rows, n_max, dtype=torch.float64)
    for b in range(batch):
        for r in range(rows):
            start, end, length = (ranges[i][b][r] for i in range(3))
            probabilities = torch.stack([
                softmax_row_reference(q[b, h, r], k_cache[b, h // group, start:length], scale)[0]
                for h in range(heads)
            ])
            out[b, r, : end - start] = pooled_row_reference(
                probabilities, end - start, pooling=pooling, redistribute=redistribute
            )
    return out


def macs_zscore_reference(log_c, n_input) -> torch.Tensor:
    """Reference of ops.macs_zscore: per row, z-scores over its first n_input[b] entries, zeros after."""
    out = torch.zeros(log_c.shape, dtype=torch.float64)
    for b, n in enumerate(torch.as_tensor(n_input).tolist()):
        out[b, :n] = zscore_reference(log_c[b, :n])
    return out


def decode_attention_reference(q, k_cache, v_cache, *, kv_start, kv_len, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ops.decode_attention's (out (B, H, D), lse (B, H)), float64."""
    batch, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(batch, heads, v_cache.shape[-1], dtype=torch.float64)
    lse = torch.zeros(batch, heads, dtype=torch.float64)
    for b, start, _, length in _row_ranges(batch, kv_start, kv_len, kv_len):
        for h in range(heads):
            p, lse[b, h] = softmax_row_reference(q[b, h], k_cache[b, h // group, start:length], scale)
            out[b, h] = p @ _f64(v_cache[b, h // group, start:length])
    return out, lse


def _column_basis(values: torch.Tensor, rcond: float) -> torch.Tensor | None:
    """Orthonormal basis (n, k) of the column space of X = [values, 1] from its SVD; None when n <= D + 1."""
    values = _f64(values)
    x = torch.cat([values, torch.ones(values.shape[0], 1, dtype=torch.float64)], dim=1)
    if x.shape[0] <= x.shape[1]:
        return None
    basis, singular, _ = torch.linalg.svd(x, full_matrices=False)
    return basis[:, singular > singular[0] * math.sqrt(rcond)]


def efficient_row_reference(p: torch.Tensor, values: torch.Tensor, rcond: float = 1e-10, basis=None) -> torch.Tensor:
    """One row's efficient attention: p (n,) projected onto the column space of X = [values, 1] (n, D+1).

    Built from the SVD of X (an orthonormal basis of its column space), never from X^T X. Singular values
    below sqrt(rcond) * the largest are dropped (the backends drop eigenvalues of X^T X below rcond * the
    largest). A row with n <= D + 1 keys is returned as is. `basis`: _column_basis(values, rcond), if known.
    """
    basis = _column_basis(values, rcond) if basis is None else basis
    p = _f64(p)
    return p.clone() if basis is None else basis @ (basis.T @ p)


def norm_row_reference(p: torch.Tensor, values: torch.Tensor, o_weight_head: torch.Tensor) -> torch.Tensor:
    """One head's norm-weighted row: p (K,) weighted by ||W_O^h v_j|| for values (K, D) and the head's slice of
    the output projection o_weight_head (E, D), renormalised (Kobayashi et al. 2020). Each transformed value
    vector is formed and measured, no Gram matrix."""
    weighted = _f64(p) * (_f64(values) @ _f64(o_weight_head).T).norm(dim=-1)
    return weighted / weighted.sum()


def efficient_attention_reference(
    p, v_cache, *, kv_len, kv_start=None, causal=False, rcond=1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ops.efficient_attention: p (B, H, R, S), v_cache (B, H_kv, S, D) ->
    (a_eff (B, H, R, S), residual (B, H, R)), float64; row r of a causal call attends [kv_start, kv_len - R + r + 1).
    """
    batch, heads, rows, keys = p.shape
    group = heads // v_cache.shape[1]
    kv_start = torch.as_tensor(0 if kv_start is None else kv_start).expand(batch)
    kv_len = torch.as_tensor(kv_len).expand(batch)
    a_eff = torch.zeros(batch, heads, rows, keys, dtype=torch.float64)
    residual = torch.zeros(batch, heads, rows, dtype=torch.float64)
    bases = {}  # the query heads of one KV head share their keys' basis
    for b, start, _, length in _row_ranges(batch, kv_start, kv_len, kv_len):
        for h in range(heads):
            for r in range(rows):
                end = length - rows + r + 1 if causal else length
                values = _f64(v_cache[b, h // group, start:end])
                if (b, h // group, end) not in bases:
                    bases[b, h // group, end] = _column_basis(values, rcond)
                row_p = _f64(p[b, h, r, start:end])
                row = efficient_row_reference(row_p, values, rcond, bases[b, h // group, end])
                a_eff[b, h, r, start:end] = row
                error = torch.cat([row @ values - row_p @ values, (row.sum() - row_p.sum())[None]]).norm()
                norm = torch.cat([row_p @ values, row_p.sum()[None]]).norm()
                residual[b, h, r] = error / norm if norm > 0 else error
    return a_eff, residual


def attention_features_reference(
    q, k_cache, *, source_start, source_end, kv_len, scale, kv_start=None, n_rows=None, window=None, softcap=None,
    sinks=None,
) -> torch.Tensor:
    """Reference of ops.attention_features: q (B, H, R, D), k_cache (B, H_kv, S, D) -> (B, H, N_max) float64.

    Valid row r < n_rows[b] attends [kv_start, kv_len - n_rows + r + 1) (a window: its last `window` keys of
    those; softcap, sinks (H,): the variant's logits, variant_row_reference); its probabilities on keys
    [source_start, source_end) are added up per head.
    """
    batch, heads, rows, _ = q.shape
    group = heads // k_cache.shape[1]
    starts, ends, lengths = (_ints(values, batch) for values in (source_start, source_end, kv_len))
    kv_starts = _ints(0 if kv_start is None else kv_start, batch)
    counts = _ints(rows if n_rows is None else n_rows, batch)
    out = torch.zeros(batch, heads, max(e - s for s, e in zip(starts, ends)), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for r in range(counts[b]):
                end = lengths[b] - counts[b] + r + 1
                attend = kv_starts[b] if window is None else max(kv_starts[b], end - window)
                p = variant_row_reference(q[b, h, r], k_cache[b, h // group, kv_starts[b]:end], scale,
                                          attend_start=attend - kv_starts[b], softcap=softcap,
                                          sink=None if sinks is None else sinks[h])
                stop = min(ends[b], end)
                if stop > starts[b]:
                    out[b, h, : stop - starts[b]] += p[starts[b] - kv_starts[b]: stop - kv_starts[b]]
    return out


def variant_row_reference(q, keys, scale, *, attend_start=0, softcap=None, sink=None) -> torch.Tensor:
    """One query's probabilities over keys (n, D) as a layer with an attention variant computes them: logits
    capped to softcap * tanh(s / softcap), keys before attend_start (outside the window) not attended, a sink
    logit in the denominator only. Returns (n,) float64, zeros before attend_start."""
    scores = (_f64(keys) @ _f64(q)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores[:attend_start] = float("-inf")
    logits = scores if sink is None else torch.cat([scores, _f64(sink).view(1)])
    return torch.softmax(logits, dim=0)[: len(scores)]


def variant_pool_reference(q, k_tokens, v_tokens, *, input_start, input_end, kv_len, scale, window=None, softcap=None,
                           sinks=None, pooling="max", redistribute=True) -> tuple[torch.Tensor, torch.Tensor]:
    """m' (B, R, N_max) and attention outputs (B, R, H, D), float64, of q (B, H, R, D) over every token's keys and
    values k_tokens, v_tokens (B, H_kv, S, D), ranges (B, R) in tokens: row (b, r) attends tokens
    [max(input_start, kv_len - window), kv_len); inputs outside the window get 0 (then the spread)."""
    batch, heads, rows, _ = q.shape
    group = heads // k_tokens.shape[1]
    ranges = [torch.as_tensor(t).expand(batch, rows).tolist() for t in (input_start, input_end, kv_len)]
    n_max = max(end - start for starts, ends in zip(ranges[0], ranges[1]) for start, end in zip(starts, ends))
    pooled = torch.zeros(batch, rows, n_max, dtype=torch.float64)
    out = torch.zeros(batch, rows, heads, v_tokens.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for r in range(rows):
            start, end, length = (ranges[i][b][r] for i in range(3))
            attend = start if window is None else max(start, length - window)
            probabilities = torch.stack([
                variant_row_reference(q[b, h, r], k_tokens[b, h // group, start:length], scale,
                                      attend_start=attend - start, softcap=softcap,
                                      sink=None if sinks is None else sinks[h])
                for h in range(heads)
            ])
            pooled[b, r, : end - start] = pooled_row_reference(
                probabilities, end - start, pooling=pooling, redistribute=redistribute
            )
            for h in range(heads):
                out[b, r, h] = probabilities[h] @ _f64(v_tokens[b, h // group, start:length])
    return pooled, out


@torch.no_grad()
def teacher_forced_macs(model, input_ids, generated_ids, **config):
    """(step log c, step z-scores) (steps, N) float64 of a generation recomputed independently of any tracer (the
    oracle every engine's rows are compared with): one eager forward with output_attentions over the whole sequence
    (1-D `input_ids` then `generated_ids`, on the model's device); the row of step k is the query at position
    N - 1 + k over its causal prefix. Needs a model with `set_attn_implementation` (transformers')."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        full = torch.cat([input_ids, generated_ids]).unsqueeze(0)
        attentions = model(full[:, :-1] if len(generated_ids) else full, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    n = len(input_ids)
    log_rows, z_rows = [], []
    for k in range(len(generated_ids)):
        query = n - 1 + k
        rows = [layer[0, :, query, : query + 1] for layer in attentions]
        log_c, z = macs_step_reference(rows, n, **config)
        log_rows.append(log_c)
        z_rows.append(z)
    return torch.stack(log_rows), torch.stack(z_rows)
