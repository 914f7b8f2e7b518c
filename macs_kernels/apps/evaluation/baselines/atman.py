"""AtMan (Deiseroth et al., NeurIPS 2023): relevance of a prompt token = how much the target's cross-entropy rises
when the model's attention to that token is suppressed.

Suppression follows the authors' text code (Aleph-Alpha/AtMan, atman-magma: manipulate_attention.py,
conceptual_suppression.py, logit_parsing.py), in every layer and head:
- pre-softmax scores of a query row are shifted so that their minimum over the visible keys is 0, then the
  column of each suppressed key is multiplied by its factor (0.1 for the token itself). The shift makes the
  multiplication a suppression even for negative scores and leaves unsuppressed rows unchanged (softmax is
  shift-invariant). The authors take the minimum over the whole row, future keys included; over the visible
  keys only, a token's suppression cannot reach the positions before it (causality, which the tests check).
- conceptual suppression: every other position j of the input (prompt and generated prefix) whose input
  embedding has cosine similarity >= threshold (0.7, the value of the authors' evaluation script; their
  Explainer's default is 0.6) with token i's is suppressed too, by (1 - f)(1 - cos) + f.
- relevance of token i for generated token k = CE_k(suppressed) - CE_k(clean), CE_k = -log p(token k | its
  teacher-forced prefix). The authors' logit_parsing returns clean - suppressed; the sign here makes
  "suppressing it hurts the answer" positive, which is what a ranking of important tokens wants.

Cost: one forward per suppressed token over the part of the sequence its suppression can change. Keys and
values of positions before the earliest suppressed position are those of the clean pass (a query there sees
no suppressed key), so they come from the clean pass's KV cache; suppressions run in batches that share
the recomputed suffix of their earliest member.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from macs_kernels.engines.hf_models import cache_argument, returned_cache

FACTOR = 0.1
THRESHOLD = 0.7
KWARG = "atman_factors"
_names = itertools.count()


def _suppressed_attention(calls: set):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, atman_factors=None,
                  **kwargs):
        """query (B, H, S_q, D); key, value (B, H_kv, S_kv, D); atman_factors (B, S_kv): per-key factor."""
        calls.add(module.layer_idx)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        s_q, s_kv = query.shape[2], key.shape[2]
        if attention_mask is None:  # an unpadded sequence: the queries are the last S_q positions
            rows = torch.arange(s_kv - s_q, s_kv, device=query.device)
            visible = (torch.arange(s_kv, device=query.device)[None] <= rows[:, None])[None, None]
        elif attention_mask.dtype == torch.bool:
            visible = attention_mask
        else:
            raise TypeError(f"AtMan's attention expects a boolean mask (sdpa_mask), got {attention_mask.dtype}")
        scores = torch.matmul(query, key.transpose(-1, -2)).float() * (scaling or query.shape[-1] ** -0.5)
        if atman_factors is not None:
            if atman_factors.shape != (query.shape[0], s_kv):
                raise ValueError(f"{KWARG} must be (batch, keys) = {(query.shape[0], s_kv)}, "
                                 f"got {tuple(atman_factors.shape)}")
            low = scores.masked_fill(~visible, float("inf")).amin(-1, keepdim=True)
            scores = (scores - low) * atman_factors[:, None, None, :].float()
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        # A padding query sees no key: zero weights, not softmax's NaN (which 0 * NaN would spread to its keys).
        weights = torch.where(visible.any(-1, keepdim=True), weights, 0.0).to(value.dtype)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), None

    return attention


@contextlib.contextmanager
def suppression(model):
    """Within the block, model(..., atman_factors=F) multiplies the shifted pre-softmax score of key j by
    F[b, j] in every layer and head (F (batch, keys) float; ones = the clean model).

    The attention function and its mask function (transformers' sdpa_mask, so that attention stays causal
    and padded) are registered under a fresh name for this block only; the model's own attention
    implementation is restored and both names unregistered on exit. Yields the set of layer indices the
    function was called for (to check that the model's attention goes through it).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = f"macs_atman_{next(_names)}"
    calls: set[int] = set()
    previous = model.config._attn_implementation
    AttentionInterface.register(name, _suppressed_attention(calls))
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
        yield calls
    finally:
        model.set_attn_implementation(previous)
        del AttentionInterface._global_mapping[name]
        del AttentionMaskInterface._global_mapping[name]


def suppression_factors(embeddings: torch.Tensor, token: int, *, factor: float = FACTOR,
                        threshold: float | None = THRESHOLD) -> torch.Tensor:
    """(S,) float32 key factors that suppress `token` of a sequence with input embeddings (S, E).

    The token itself gets `factor`; with a threshold, every other position whose embedding has cosine
    similarity cos >= threshold with it gets (1 - factor) * (1 - cos) + factor; all others 1.
    """
    factors = torch.ones(embeddings.shape[0], dtype=torch.float32)
    if threshold is not None:
        cos = torch.nn.functional.cosine_similarity(embeddings[token][None].float(), embeddings.float(), dim=-1)
        cos = cos.clamp(-1, 1).cpu()
        similar = cos >= threshold
        factors[similar] = (1 - factor) * (1 - cos[similar]) + factor
    factors[token] = factor
    return factors


def _check(input_ids, generated_ids, factor, threshold, batch_size):
    input_ids, generated_ids = torch.as_tensor(input_ids), torch.as_tensor(generated_ids)
    for name, ids in (("input_ids", input_ids), ("generated_ids", generated_ids)):
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)} "
                             f"and dtype {ids.dtype}")
    if not factor > 0:
        raise ValueError(f"factor must be positive (the authors' default 0.1 suppresses), got {factor}")
    if threshold is not None and not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1] or None (no conceptual suppression), got {threshold}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return input_ids.long(), generated_ids.long()


@torch.no_grad()
def relevance(model, input_ids, generated_ids, *, factor: float = FACTOR, threshold: float | None = THRESHOLD,
              tokens=None, batch_size: int = 8) -> torch.Tensor:
    """(steps, N) float32: AtMan relevance of each prompt token (N = len(input_ids)) for each generated token.

    Row k: CE of generated_ids[k] given its teacher-forced prefix with the token suppressed, minus the clean
    CE (positive: the token supports the answer). tokens: the prompt positions to score (default all N);
    the other columns are NaN. batch_size: suppressions per forward.
    """
    input_ids, generated_ids = _check(input_ids, generated_ids, factor, threshold, batch_size)
    n, steps = len(input_ids), len(generated_ids)
    tokens = list(range(n)) if tokens is None else [int(t) for t in tokens]
    if any(not 0 <= t < n for t in tokens):
        raise ValueError(f"tokens must be prompt positions in [0, {n}), got {tokens}")
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, generated_ids[:-1]]).to(device)
    length = len(ids)
    targets = generated_ids.to(device)
    embeddings = model.get_input_embeddings()(ids)
    factors = {t: suppression_factors(embeddings, t, factor=factor, threshold=threshold) for t in tokens}
    # The earliest position a suppression changes (factor 1 suppresses nothing: the token's own position).
    starts = {t: min([t, *(factors[t] != 1).nonzero()[:, 0].tolist()]) for t in tokens}
    result = torch.full((steps, n), float("nan"))

    def cross_entropy(logits):  # logits (B, steps, V) -> (B, steps)
        return torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), targets[None].expand(len(logits), -1), reduction="none")

    with suppression(model) as calls:
        clean = model(ids[None], use_cache=True, logits_to_keep=steps, **{KWARG: torch.ones(1, length, device=device)})
        if calls != set(range(model.config.num_hidden_layers)):
            raise ValueError(f"{type(model).__name__}'s attention does not go through transformers' "
                             "AttentionInterface in every layer: AtMan cannot suppress tokens in it")
        clean_ce = cross_entropy(clean.logits)[0]
        layers = returned_cache(clean).layers
        ordered = sorted(tokens, key=starts.get)
        for batch in (ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)):
            start, size = starts[batch[0]], len(batch)
            cache = None
            if start > 0:
                from transformers import DynamicCache

                cache = DynamicCache(config=model.config)
                for index, layer in enumerate(layers):
                    cache.update(layer.keys[:, :, :start].expand(size, -1, -1, -1),
                                 layer.values[:, :, :start].expand(size, -1, -1, -1), index)
            out = model(ids[start:][None].expand(size, -1), **cache_argument(model, cache), use_cache=cache is not None,
                        position_ids=torch.arange(start, length, device=device)[None].expand(size, -1),
                        logits_to_keep=steps, **{KWARG: torch.stack([factors[t] for t in batch]).to(device)})
            result[:, batch] = (cross_entropy(out.logits) - clean_ce).T.cpu()
    return result
