"""Faithfulness by masking context tokens (MACS paper, Appendix A.2).

Masked tokens are removed through the attention mask while every other token keeps its original
position: positions are always passed explicitly. transformers' generate() derives positions from the
attention mask's cumulative sum, which would shift every token after a masked one, so regeneration is
a greedy loop of its own over a DynamicCache.
"""
from __future__ import annotations

import numpy as np
import torch

from .metrics import FRACTIONS, curve_auc, srg

ORDERS = ("mif", "lif")
METRICS = ("perplexity", "mean_logit", "rouge_l")


def masking_order(scores, order: str) -> np.ndarray:
    """Context indices in masking order: "mif" highest score first, "lif" lowest first (ties by position)."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if order == "mif":
        return np.argsort(-scores, kind="mergesort")
    if order == "lif":
        return np.argsort(scores, kind="mergesort")
    raise ValueError(f"unknown order {order!r}; choose one of {ORDERS}")


def masked_positions(order, fraction: float, context_start: int) -> list[int]:
    """Prompt positions of the first round(fraction * n_context) context tokens of `order`."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    count = int(round(fraction * len(order)))
    return sorted(int(context_start + i) for i in order[:count])


def _check_inputs(model, prompt_ids, generated_ids=None):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        # transformers then passes no mask to the attention at all and the masking would silently do nothing.
        raise ValueError(f"attention implementation {implementation!r} has no registered mask function; "
                         "score faithfulness with 'sdpa' or 'eager'")
    for name, ids in (("prompt_ids", prompt_ids), ("generated_ids", generated_ids)):
        if ids is not None and (ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0):
            raise ValueError(f"{name} must be (1, length >= 1), got {tuple(ids.shape)}")


def _attention_mask(length: int, masked, device) -> torch.Tensor:
    mask = torch.ones(1, length, dtype=torch.long, device=device)
    masked = list(masked)
    if masked:
        if min(masked) < 1 or max(masked) >= length:
            # Position 0 masked would leave its own query row with nothing to attend to.
            raise ValueError(f"masked positions must lie in [1, {length}), got {min(masked)}..{max(masked)}")
        mask[0, masked] = 0
    return mask


@torch.no_grad()
def teacher_forced_scores(model, prompt_ids: torch.Tensor, generated_ids: torch.Tensor, masked=()) -> dict:
    """Perplexity and mean logit of the generation with the prompt positions `masked` hidden. One forward.

    prompt_ids (1, N), generated_ids (1, T); position_ids are arange(N + T) whatever is masked.
    Returns {"perplexity": exp(mean NLL of the T tokens), "mean_logit": mean raw logit of those tokens}.
    """
    _check_inputs(model, prompt_ids, generated_ids)
    device = model.device
    prompt_ids, generated_ids = prompt_ids.to(device), generated_ids.to(device)
    n, t = prompt_ids.shape[1], generated_ids.shape[1]
    ids = torch.cat([prompt_ids, generated_ids], dim=1)
    mask = torch.cat([_attention_mask(n, masked, device), torch.ones(1, t, dtype=torch.long, device=device)], dim=1)
    out = model(input_ids=ids, attention_mask=mask,
                position_ids=torch.arange(n + t, device=device)[None], use_cache=False, logits_to_keep=t + 1)
    logits = out.logits[0, :t].float()  # the row before each generated token predicts it
    target = generated_ids[0]
    nll = torch.nn.functional.cross_entropy(logits, target)
    return {
        "perplexity": nll.exp().item(),
        "mean_logit": logits.gather(1, target[:, None]).mean().item(),
    }


@torch.no_grad()
def greedy_generate(model, prompt_ids: torch.Tensor, *, max_new_tokens: int, masked=(),
                    eos_token_id=None) -> torch.Tensor:
    """Greedy continuation of prompt_ids (1, N) with the prompt positions `masked` hidden -> (1, T) ids.

    Token k is fed at position N + k and the mask grows by one attended slot per step, so no position
    moves. Stops after an end-of-sequence id (kept, as generate() keeps it) or max_new_tokens.
    eos_token_id: int or list; default the model's generation_config.
    """
    from transformers import DynamicCache

    _check_inputs(model, prompt_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    stop = set() if eos_token_id is None else {int(e) for e in np.atleast_1d(eos_token_id)}
    device = model.device
    prompt_ids = prompt_ids.to(device)
    n = prompt_ids.shape[1]
    mask = _attention_mask(n, masked, device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=torch.arange(n, device=device)[None],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens = []
    for k in range(max_new_tokens):
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
        if k + 1 == max_new_tokens or int(token) in stop:
            break
        mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=torch.tensor([[n + k]], device=device),
                    past_key_values=cache, use_cache=True)
    return torch.cat(tokens, dim=1)


_ROUGE = None


def rouge_l_f1(reference: str, candidate: str) -> float:
    """ROUGE-L F1 (rouge-score package, no stemming: the tokens as written)."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return float(_ROUGE.score(reference, candidate)["rougeL"].fmeasure)


def faithfulness_curves(model, tokenizer, prompt_ids: torch.Tensor, generated_ids: torch.Tensor,
                        context_tokens: tuple[int, int], scores=None, *, max_new_tokens: int,
                        fractions=FRACTIONS, rng: np.random.Generator | None = None,
                        regenerate: bool = True) -> dict:
    """Masking curves of one sample and their AUCs and SRGs.

    scores: (n_context,) ranking score of the context tokens (the mean step row), or None for the
    Random baseline: then "mif" and "lif" each follow an independent random order drawn from `rng`.
    context_tokens: [start, stop) prompt positions of the context. max_new_tokens: as in the original
    generation. regenerate=False skips ROUGE-L (the expensive part). f = 0 is computed once for both orders.
    Returns {"curves": {order: {metric: [value per fraction]}}, "auc": {order: {metric: auc}},
    "srg": {metric: AUC_lif - AUC_mif}}.
    """
    start, stop = context_tokens
    if not 0 < start < stop <= prompt_ids.shape[1]:
        raise ValueError(f"context_tokens {context_tokens} do not lie inside the prompt of {prompt_ids.shape[1]}")
    if scores is None:
        if rng is None:
            raise ValueError("the random baseline needs an rng")
        orders = {order: rng.permutation(stop - start) for order in ORDERS}
    else:
        if len(scores) != stop - start:
            raise ValueError(f"{len(scores)} scores for {stop - start} context tokens")
        orders = {order: masking_order(scores, order) for order in ORDERS}
    metrics = METRICS if regenerate else METRICS[:2]
    reference = tokenizer.decode(generated_ids[0], skip_special_tokens=True)

    def measure(masked):
        values = teacher_forced_scores(model, prompt_ids, generated_ids, masked)
        if regenerate:
            again = greedy_generate(model, prompt_ids, max_new_tokens=max_new_tokens, masked=masked)
            values["rouge_l"] = rouge_l_f1(reference, tokenizer.decode(again[0], skip_special_tokens=True))
        return values

    unmasked = measure(())
    curves = {order: {m: [] for m in metrics} for order in ORDERS}
    for order in ORDERS:
        for fraction in fractions:
            values = unmasked if fraction == 0 else measure(masked_positions(orders[order], fraction, start))
            for m in metrics:
                curves[order][m].append(values[m])
    auc = {order: {m: curve_auc(curves[order][m], fractions) for m in metrics} for order in ORDERS}
    return {
        "curves": curves,
        "auc": auc,
        "srg": {m: srg(curves["lif"][m], curves["mif"][m], fractions) for m in metrics},
    }
