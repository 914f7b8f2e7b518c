"""AT2 on held-out questions: trained coefficients against uniform ones (= average attention over heads).

    python benchmarks/at2_eval.py                      # stqa questions 250-349, packaged coefficients
    python benchmarks/at2_eval.py --range 250:260 --quick
Writes benchmarks/results/at2_eval.json (or --out). Reuses (and extends) the ablation work folder of
training: held-out questions get the same collected data (greedy response, token features, 32 random
token ablations with their logit-probability targets), never used to train.

Metrics, each per question, then mean with a 95% Student-t interval over questions (and for the paired
difference trained - uniform):
- Pearson loss on the 32 token ablations (the training objective; lower is better);
- LDS: Spearman correlation between the predicted effect m . scores and the actual logit-probability
  target over the 32 ablations (token sources; higher is better);
- top-k log-prob drop, k = 1, 3, 5, with SENTENCE sources (the explanation default): the k sentences with
  the highest scores are hidden through the attention mask and the drop in the response's summed
  log-probability is measured (higher = the scores found what the response relied on). When a context has
  at most k sentences, all are hidden (both methods then tie).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KS = (1, 3, 5)


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr

    value = spearmanr(np.asarray(a), np.asarray(b)).statistic
    return float(value) if np.isfinite(value) else 0.0


def evaluate_example(model, tokenizer, sample, example, thetas) -> dict:
    from macs_kernels.apps.at2.sources import aggregate, make_sources, source_index
    from macs_kernels.apps.at2.train import logit_prob_targets, pearson_loss
    from macs_kernels.apps.evaluation.alignment import align_qa

    alignment = align_qa(tokenizer, sample.question, sample.context)
    context_tokens = tuple(example["context_tokens"].tolist())
    assert context_tokens == alignment.context_tokens and example["prompt_ids"].tolist() == alignment.input_ids
    sentences = make_sources(alignment, sample.context, "sentence")
    index = source_index(sentences, context_tokens)
    masks = example["masks"].float()
    result = {"index": sample.index, "n_sentences": len(sentences), "n_context": context_tokens[1] - context_tokens[0]}
    keeps = [torch.ones(result["n_context"], dtype=torch.bool)]
    for name, theta in thetas.items():
        token_scores = theta @ example["features"]
        result[f"pearson_loss_{name}"] = float(pearson_loss(theta, example))
        result[f"lds_{name}"] = _spearman(masks @ token_scores, example["outputs"])
        order = torch.argsort(aggregate(example["features"], index, len(sentences)).T @ theta, descending=True)
        for k in KS:
            keep = torch.ones(result["n_context"], dtype=torch.bool)
            for s in order[:k].tolist():
                keep[index == s] = False
            keeps.append(keep)
    log_probs = logit_prob_targets(model, example["prompt_ids"], example["response_ids"], torch.stack(keeps),
                                   context_tokens, measure="log_prob").tolist()
    at = 1
    for name in thetas:
        for k in KS:
            result[f"top{k}_drop_{name}"] = log_probs[0] - log_probs[at]
            at += 1
    return result


def summarise(rows, names) -> dict:
    from macs_kernels.apps.evaluation.metrics import mean_ci

    metrics = ["pearson_loss", "lds", *(f"top{k}_drop" for k in KS)]
    summary = {}
    for metric in metrics:
        entry = {}
        for name in names:
            mean, low, high = mean_ci([r[f"{metric}_{name}"] for r in rows])
            entry[name] = {"mean": mean, "ci95": [low, high]}
        mean, low, high = mean_ci([r[f"{metric}_{names[0]}"] - r[f"{metric}_{names[1]}"] for r in rows])
        entry[f"{names[0]}_minus_{names[1]}"] = {"mean": mean, "ci95": [low, high]}
        summary[metric] = entry
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/stqa_350.json"))
    parser.add_argument("--range", default="250:350")
    parser.add_argument("--coefficients", type=Path, default=None, help="default: the packaged file")
    parser.add_argument("--work", type=Path, default=None,
                        help="ablation work folder (default ~/.cache/macs_kernels/at2)")
    parser.add_argument("--masks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="4 masks, 8 new tokens: a smoke run")
    parser.add_argument("--collect-only", action="store_true",
                        help="only collect the held-out ablations (resumable; e.g. while training runs)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "at2_eval.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from macs_kernels.api.models import cache_dir, load_model
    from macs_kernels.apps.at2 import DEFAULT_COEFFICIENTS, load_coefficients
    from macs_kernels.apps.at2.train import collect, load_examples
    from macs_kernels.apps.evaluation.data import load_qa, parse_range

    model, tokenizer = load_model()
    path = args.coefficients or DEFAULT_COEFFICIENTS
    if not args.collect_only:
        theta, metadata = load_coefficients(path, model)
    samples = load_qa(args.data, range=parse_range(args.range))
    masks, tokens = (4, 8) if args.quick else (args.masks, 32)
    work = args.work or cache_dir() / "at2"
    if args.quick:
        work = work / "quick"
    paths = collect(model, tokenizer, samples, work, n_masks=masks, max_new_tokens=tokens)
    if args.collect_only:
        print(f"collected {len(paths)} held-out questions under {work}")
        return 0
    size = theta.numel()
    thetas = {"at2": theta.flatten(), "uniform": torch.full((size,), 1.0 / size)}
    by_index = {int(p.stem): p for p in paths}
    rows = []
    for sample in tqdm([s for s in samples if s.index in by_index], desc="AT2 eval"):
        example = load_examples([by_index[sample.index]])[0]
        rows.append(evaluate_example(model, tokenizer, sample, example, thetas))
    report = {
        "data": str(args.data), "range": args.range, "coefficients": str(path), "coefficient_metadata": metadata,
        "questions": len(rows), "skipped_empty_responses": len(samples) - len(rows), "masks": masks,
        "max_new_tokens": tokens, "summary": summarise(rows, list(thetas)), "per_question": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for metric, entry in report["summary"].items():
        line = "  ".join(f"{name} {v['mean']:+.4f} [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"
                         for name, v in entry.items())
        print(f"{metric:13s} {line}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
