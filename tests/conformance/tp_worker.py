"""Run under torchrun by test_conformance.py's tensor-parallel case: the conformance model split over the ranks
(tp_plan="auto", gloo), every engine that runs in-process and every method on a left-padded batch of prompts;
each rank saves what it returned to OUT/rank<r>.pt.

argv: MODEL_FOLDER OUT [sinks]; with `sinks`, the model (gpt-oss, whose transformers config has no attention plan) is
split by SINK_PLAN: q/k/v and the per-head sink logits by heads, o_proj by its inputs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from macs_kernels import explain
from macs_kernels.api.models import load_tokenizer
from macs_kernels.core import support
from tests.conformance.test_conformance import METHODS, NEW_TOKENS, PROMPTS, tensor_parallel_engines

SINK_PLAN = {**{f"model.layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj", "sinks")},
             "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.self_attn": "local_params"}


def main(folder: str, out: Path, sinks: bool) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    split = {"distributed_config": DistributedConfig(tp_plan=SINK_PLAN)} if sinks else {"tp_plan": "auto"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **split).eval()
    tokenizer = load_tokenizer(folder)
    saved = {}
    for engine, options in tensor_parallel_engines():
        for method, config in METHODS.items():
            refusal = support.message(engine, method, "tensor_parallel")
            if refusal is not None:  # refused before work, with the support table's message
                try:
                    explain(model, tokenizer, PROMPTS["three"], max_new_tokens=1, backend="torch", **config, **options)
                except NotImplementedError as error:
                    saved[f"{engine}-{method}"] = str(error)
                continue
            result = explain(model, tokenizer, PROMPTS["three"], max_new_tokens=NEW_TOKENS, backend="torch",
                             **config, **options)
            saved[f"{engine}-{method}"] = [(e.input_ids, e.generated_ids, e.step_log_c) for e in result]
    torch.save(saved, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:] == ["sinks"])
