"""Faithfulness by masking context tokens (MACS paper, Appendix A.2).

Masked tokens are removed through the attention mask while every other token keeps its original
position: positions are always passed explicitly. transformers' generate() derives positions from the
attention mask's cumulative sum, which would shift every token after a masked one, so regeneration is
a greedy loop of its own over a DynamicCache. All masked variants of one sample run as one batch whose prompt
prefill serves both the teacher forcing and the regeneration: half the forward work of running them apart.
"""
from __future__ import annotations

import numpy as np
import torch

from macs_kernels.apps.evaluation.metrics import FRACTIONS, curve_auc, srg
from macs_kernels.engines.hf_models import cache_argument

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


def _attention_masks(length: int, masked_sets, device) -> torch.Tensor:
    """(len(masked_sets), length) attention mask: row i hides the prompt positions of masked_sets[i]."""
    mask = torch.ones(len(masked_sets), length, dtype=torch.long, device=device)
    for row, masked in enumerate(masked_sets):
        masked = list(masked)
        if masked:
            if min(masked) < 1 or max(masked) >= length:
                # Position 0 masked would leave its own query row with nothing to attend to.
                raise ValueError(f"masked positions must lie in [1, {length}), got {min(masked)}..{max(masked)}")
            mask[row, masked] = 0
    return mask


@torch.no_grad()
def masked_variants(model, prompt_ids: torch.Tensor, generated_ids: torch.Tensor | None, masked_sets, *,
                    regenerate_tokens: int = 0, eos_token_id=None) -> tuple[list[dict], list[torch.Tensor]]:
    """Each set of hidden prompt positions as one row of a batch that shares one prefill of the prompt.

    prompt_ids (1, N); generated_ids (1, T) or None. Positions are the original ones whatever is masked:
    the prompt at arange(N), token k after it at N + k.
    Returns (scores, regenerations):
    - scores, per set (when generated_ids is given): {"perplexity": exp(mean NLL of the T tokens by teacher
      forcing), "mean_logit": mean raw logit of those tokens};
    - regenerations, per set (when regenerate_tokens > 0): the greedy continuation (1, T_i), ended after an
      end-of-sequence id (kept, as generate() keeps it; eos_token_id: int or list, default the model's
      generation_config) or regenerate_tokens. The batch runs on until every row has ended; rows never mix.
    """
    import copy

    from transformers import DynamicCache

    _check_inputs(model, prompt_ids, generated_ids)
    if generated_ids is None and regenerate_tokens < 1:
        raise ValueError("nothing to do: give generated_ids or regenerate_tokens >= 1")
    device = model.device
    rows, n = len(masked_sets), prompt_ids.shape[1]
    mask = _attention_masks(n, masked_sets, device)
    cache = DynamicCache(config=model.config)
    prefill = model(input_ids=prompt_ids.to(device).expand(rows, -1), attention_mask=mask,
                    position_ids=torch.arange(n, device=device).expand(rows, -1),
                    **cache_argument(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    scores, regenerations = [], []
    if generated_ids is not None:
        target = generated_ids.to(device)[0].expand(rows, -1)
        t = target.shape[1]
        # float64: a float32 log-softmax over a 49k vocabulary is off by up to 2e-4 in the NLL.
        logits = prefill[:, None].double()  # the last prompt row predicts the first generated token
        if t > 1:
            forced = model(input_ids=target[:, :-1], attention_mask=torch.cat([mask, mask.new_ones(rows, t - 1)], 1),
                           position_ids=torch.arange(n, n + t - 1, device=device).expand(rows, -1),
                           **cache_argument(model, copy.deepcopy(cache) if regenerate_tokens else cache),
                           use_cache=True)
            logits = torch.cat([logits, forced.logits.double()], dim=1)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(1)
        target_logits = logits.gather(2, target[..., None])[..., 0].mean(1)
        scores = [{"perplexity": value.exp().item(), "mean_logit": logit.item()}
                  for value, logit in zip(nll, target_logits)]
    if regenerate_tokens:
        if eos_token_id is None:
            eos_token_id = model.generation_config.eos_token_id
        stop = torch.tensor([] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist(), dtype=torch.long,
                            device=device)
        tokens, lengths, logits = [], torch.full((rows,), regenerate_tokens, device=device), prefill
        for k in range(regenerate_tokens):
            token = logits.argmax(dim=-1, keepdim=True)
            tokens.append(token)
            lengths = torch.where(torch.isin(token[:, 0], stop) & (lengths > k + 1), k + 1, lengths)
            if k + 1 == regenerate_tokens or bool((lengths <= k + 1).all()):
                break
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = torch.full((rows, 1), n + k, device=device)
            logits = model(input_ids=token, attention_mask=mask, position_ids=positions, **cache_argument(model, cache),
                           use_cache=True).logits[:, -1]
        tokens = torch.cat(tokens, dim=1)
        regenerations = [tokens[row:row + 1, :length] for row, length in enumerate(lengths.tolist())]
    return scores, regenerations


def teacher_forced_scores(model, prompt_ids: torch.Tensor, generated_ids: torch.Tensor, masked=()) -> dict:
    """Perplexity and mean logit of generated_ids (1, T) after prompt_ids (1, N) with the prompt positions
    `masked` hidden (masked_variants of one set)."""
    return masked_variants(model, prompt_ids, generated_ids, [masked])[0][0]


def greedy_generate(model, prompt_ids: torch.Tensor, *, max_new_tokens: int, masked=(),
                    eos_token_id=None) -> torch.Tensor:
    """Greedy continuation (1, T) of prompt_ids (1, N) with the prompt positions `masked` hidden
    (masked_variants of one set)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    return masked_variants(model, prompt_ids, None, [masked], regenerate_tokens=max_new_tokens,
                           eos_token_id=eos_token_id)[1][0]


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
    # Every variant of this sample in one batch; f = 0 is the same for both orders.
    variants = {(order, fraction): () if fraction == 0 else tuple(masked_positions(orders[order], fraction, start))
                for order in ORDERS for fraction in fractions}
    masked_sets = list(dict.fromkeys(variants.values()))
    values, again = masked_variants(model, prompt_ids, generated_ids, masked_sets,
                                    regenerate_tokens=max_new_tokens if regenerate else 0)
    if regenerate:
        reference = tokenizer.decode(generated_ids[0], skip_special_tokens=True)
        for value, ids in zip(values, again):
            value["rouge_l"] = rouge_l_f1(reference, tokenizer.decode(ids[0], skip_special_tokens=True))
    by_set = dict(zip(masked_sets, values))
    curves = {order: {m: [by_set[variants[order, fraction]][m] for fraction in fractions] for m in metrics}
              for order in ORDERS}
    auc = {order: {m: curve_auc(curves[order][m], fractions) for m in metrics} for order in ORDERS}
    return {
        "curves": curves,
        "auc": auc,
        "srg": {m: srg(curves["lif"][m], curves["mif"][m], fractions) for m in metrics},
    }
