"""Training AT2's head coefficients against ablations (the authors' recipe, see NOTES).

Two stages, both resumable from a work folder:

1. collect: per question, the default model's greedy response to the QA prompt (up to 32 new tokens, the
   end-of-sequence token dropped), the token features (L*H, n_context) from one forward, and 32 random
   ablations of the context tokens (keep probability 0.5; ablation = attention mask 0, positions unchanged)
   with their target: the sum over response tokens of the logit-probability log p - log(1 - p).
   One safetensors file per question under WORK/examples/.
2. fit: theta (L*H) from 1/(L*H), loss = - Pearson correlation over an example's masks between
   (2m - 1) . (theta . features) and the target; Adam (lr 1e-3), cosine schedule, gradient clip 1.0;
   checkpoint WORK/fit.safetensors after every epoch; theta is L1-normalised at the end.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from macs_kernels.api.generation import eos_ids, generation_kwargs
from macs_kernels.apps.at2.coefficients import model_record, model_shape, save_coefficients, training_record
from macs_kernels.apps.at2.features import response_token_features
from macs_kernels.engines.hf_models import cache_argument

N_MASKS = 32
KEEP_PROBABILITY = 0.5
MAX_NEW_TOKENS = 32


# ---- stage 1: ablation data ------------------------------------------------------------------------
@torch.no_grad()
def greedy_response(model, tokenizer, prompt_ids: torch.Tensor, max_new_tokens: int = MAX_NEW_TOKENS) -> torch.Tensor:
    """Greedy continuation of prompt_ids (N,) without its end-of-sequence token: (T,) int64 (T may be 0)."""
    device = next(model.parameters()).device
    ids = prompt_ids.to(device)[None]
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         **generation_kwargs(model, tokenizer, max_new_tokens, {}))
    response = out[0, prompt_ids.numel():].cpu()
    eos = eos_ids(model, tokenizer)
    for i, token in enumerate(response.tolist()):
        if token in eos:
            return response[:i]
    return response


@torch.no_grad()
def logit_prob_targets(model, prompt_ids, response_ids, keep, context_tokens, *, batch_size: int = 8,
                       measure: str = "logit_prob") -> torch.Tensor:
    """(M,) float32: for each keep mask (M, n_context) bool, sum over response tokens of log p - log(1 - p)
    (measure="log_prob": of log p) with the dropped context tokens hidden from attention (positions unchanged).

    The tokens before the context see no ablation: their keys and values are computed once and shared.
    """
    import copy

    from transformers import DynamicCache

    device = next(model.parameters()).device
    n, t = prompt_ids.numel(), response_ids.numel()
    ids = torch.cat([prompt_ids, response_ids]).to(device)[None]
    positions = torch.arange(n + t, device=device)[None]
    target = response_ids.to(device).view(1, t, 1)
    if measure not in ("logit_prob", "log_prob"):
        raise ValueError(f"measure must be 'logit_prob' or 'log_prob', got {measure!r}")
    c0, c1 = context_tokens
    prefix = DynamicCache(config=model.config)
    if c0 > 0:
        model(input_ids=ids[:, :c0], position_ids=positions[:, :c0], **cache_argument(model, prefix), use_cache=True,
              logits_to_keep=1)
    results = []
    for chunk in keep.split(batch_size):
        m = chunk.shape[0]
        mask = torch.ones(m, n + t, dtype=torch.long, device=device)
        mask[:, c0:c1] = chunk.to(device).long()
        cache = copy.deepcopy(prefix)
        if c0 > 0:
            cache.batch_repeat_interleave(m)
        logits = model(input_ids=ids[:, c0:].expand(m, -1), attention_mask=mask, **cache_argument(model, cache),
                       position_ids=positions[:, c0:].expand(m, -1), use_cache=True,
                       logits_to_keep=t + 1).logits[:, :t].double()
        chosen = logits.gather(2, target.expand(m, t, 1)).squeeze(2)
        # log p = logit - logsumexp of all; log p - log(1 - p) = logit - logsumexp of the OTHER tokens,
        # which avoids the cancellation in 1 - p.
        others = torch.logsumexp(
            logits if measure == "log_prob" else logits.scatter(2, target.expand(m, t, 1), float("-inf")), dim=2)
        results.append((chosen - others).sum(dim=1).float().cpu())
    return torch.cat(results)


def collect_example(model, tokenizer, sample, *, n_masks: int = N_MASKS, keep_probability: float = KEEP_PROBABILITY,
                    max_new_tokens: int = MAX_NEW_TOKENS, seed: int = 0, batch_size: int = 8) -> dict | None:
    """The ablation data of one QASample (None when the response is empty)."""
    from macs_kernels.apps.evaluation.alignment import align_qa

    alignment = align_qa(tokenizer, sample.question, sample.context)
    prompt_ids = torch.tensor(alignment.input_ids)
    response_ids = greedy_response(model, tokenizer, prompt_ids, max_new_tokens)
    if response_ids.numel() == 0:
        return None
    features = response_token_features(model, prompt_ids, response_ids, alignment.context_tokens)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + sample.index)
    keep = torch.rand(n_masks, alignment.n_context, generator=generator) < keep_probability
    outputs = logit_prob_targets(model, prompt_ids, response_ids, keep, alignment.context_tokens, batch_size=batch_size)
    return {
        "features": features.contiguous(), "masks": keep.to(torch.uint8), "outputs": outputs,
        "prompt_ids": prompt_ids, "response_ids": response_ids,
        "context_tokens": torch.tensor(alignment.context_tokens),
    }


def example_path(work: Path, index: int) -> Path:
    return Path(work) / "examples" / f"{index:05d}.safetensors"


def collect(model, tokenizer, samples, work, *, progress: bool = True, **kwargs) -> list[Path]:
    """collect_example for every sample not already in WORK/examples (resumable); returns the files."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    paths = []
    for sample in tqdm(samples, desc="AT2 ablations", disable=not progress):
        path = example_path(work, sample.index)
        if not path.exists() and not path.with_suffix(".empty").exists():
            data = collect_example(model, tokenizer, sample, **kwargs)
            path.parent.mkdir(parents=True, exist_ok=True)
            if data is None:
                path.with_suffix(".empty").touch()
                continue
            staging = path.with_suffix(".tmp")
            save_file(data, staging, metadata={"index": str(sample.index)})
            os.replace(staging, path)  # a killed run leaves no half-written example
        if path.exists():
            paths.append(path)
    return paths


def load_examples(paths) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(path) for path in paths]


# ---- stage 2: fitting the coefficients --------------------------------------------------------------
def pearson_loss(theta: torch.Tensor, example: dict) -> torch.Tensor:
    """- Pearson correlation over the masks of (2m - 1) . (theta . features) and the targets."""
    scores = theta @ example["features"]
    predicted = (2.0 * example["masks"].float() - 1.0) @ scores
    actual = example["outputs"].float()
    p, a = predicted - predicted.mean(), actual - actual.mean()
    return -(p * a).sum() / (p.norm() * a.norm()).clamp_min(1e-12)


def mean_loss(theta: torch.Tensor, examples) -> float:
    with torch.no_grad():
        return float(torch.stack([pearson_loss(theta, e) for e in examples]).mean())


def fit(examples, *, epochs: int = 100, lr: float = 1e-3, batch_size: int = 16, seed: int = 0,
        checkpoint: Path | None = None, progress: bool = True) -> torch.Tensor:
    """theta (L*H,) float32, L1-normalised. `checkpoint`: saved after each epoch, resumed from if present."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    if not examples:
        raise ValueError("no training examples")
    size = examples[0]["features"].shape[0]
    theta = torch.full((size,), 1.0 / size, requires_grad=True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total = epochs * steps_per_epoch
    start_epoch = 0
    if checkpoint is not None and Path(checkpoint).exists():
        state = load_file(checkpoint)
        if state["theta"].shape != (size,):
            raise ValueError(f"checkpoint {checkpoint} holds {tuple(state['theta'].shape)} coefficients, not ({size},)")
        with torch.no_grad():
            theta.copy_(state["theta"])
        optimizer.state[theta] = {"step": state["step"], "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        start_epoch = int(state["epoch"])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(start_epoch):  # the same shuffles as an uninterrupted run
        torch.randperm(len(examples), generator=generator)
    bar = tqdm(range(start_epoch, epochs), desc="AT2 fit", disable=not progress)
    for epoch in bar:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for b in range(steps_per_epoch):
            step = epoch * steps_per_epoch + b
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
            batch = [examples[i] for i in order[b * batch_size:(b + 1) * batch_size]]
            loss = torch.stack([pearson_loss(theta, e) for e in batch]).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([theta], 1.0)
            optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if checkpoint is not None:
            state = optimizer.state[theta]
            save_file({"theta": theta.detach().clone(), "step": state["step"].clone(), "exp_avg": state["exp_avg"],
                       "exp_avg_sq": state["exp_avg_sq"], "epoch": torch.tensor(epoch + 1)},
                      Path(checkpoint).with_suffix(".tmp"))
            os.replace(Path(checkpoint).with_suffix(".tmp"), checkpoint)
    theta = theta.detach()
    return theta / theta.abs().sum()


# ---- both stages ----------------------------------------------------------------------------------
def train_coefficients(model, tokenizer, samples, *, work, out=None, n_masks: int = 32, epochs: int = 100,
                       lr: float = 1e-3, batch_size: int = 16, max_new_tokens: int = 32, seed: int = 0,
                       progress: bool = True, model_name: str | None = None,
                       data_name: str = "") -> tuple[torch.Tensor, dict]:
    """Collect ablations for `samples` (QASample list) under WORK, fit theta, save it to `out` if given.

    Resumable: collected examples and the fit checkpoint in WORK are reused. Returns (theta (L, H), metadata
    of strings);
    the metadata records the model (model_record; `model_name` overrides its name), the data (`data_name`) and
    its questions (training_record: an evaluation holds them out).
    """
    work = Path(work)
    paths = collect(model, tokenizer, samples, work, n_masks=n_masks, max_new_tokens=max_new_tokens, seed=seed,
                    progress=progress)
    examples = load_examples(paths)
    checkpoint = work / f"fit_e{epochs}_lr{lr}_b{batch_size}_n{len(examples)}.safetensors"
    theta = fit(examples, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, checkpoint=checkpoint,
                progress=progress).view(*model_shape(model))
    record = model_record(model)
    # Strings, as a coefficient file stores and returns them.
    metadata = {name: str(value) for name, value in (record | training_record(samples) | {
        "model": model_name or record["model"], "data": data_name,
        "layers": theta.shape[0], "heads": theta.shape[1],
        "examples": len(examples), "masks": n_masks, "epochs": epochs, "lr": lr, "sources": "token",
        "samples": f"{samples[0].index}..{samples[-1].index}" if samples else "",
    }).items()}
    if out is not None:
        save_coefficients(out, theta, metadata)
    return theta, metadata
