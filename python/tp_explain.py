"""Explain a generation with the model split over a tensor-parallel group.

    torchrun --nproc-per-node 3 python/tp_explain.py [--model PATH_OR_ID] [--question Q --context C]

Each rank holds a slice of the attention heads (tp_plan="auto"); every rank returns the same rows, and rank 0
prints them. CPU (gloo) or GPU (NCCL: torchrun picks the backend from the device). The query and KV head counts
must divide by the number of ranks (the default model's 9 / 3 heads: 1 or 3 ranks).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import macs_kernels
from macs_kernels import qa_messages
from macs_kernels.api.models import default_model_path, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--question", default="Who wrote Hamlet?")
    parser.add_argument("--context", default="Hamlet is a tragedy written by William Shakespeare around 1600.")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = args.model or default_model_path()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    tokenizer = load_tokenizer(path)
    explanation = macs_kernels.explain(model, tokenizer, qa_messages(args.question, args.context),
                                       max_new_tokens=args.max_new_tokens)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks; answer: {explanation.text!r}")
        print("top prompt tokens:", [(text, round(score, 2)) for _, text, score in explanation.top_k(5)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
