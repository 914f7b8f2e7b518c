"""Run under torchrun by tests/distributed/test_tensor_parallel.py: every entry point on the default model split
over the tensor-parallel group (tp_plan="auto", gloo), each rank saving what it returned to OUT/rank<r>.pt.

argv: OUT MODE, MODE in {explain, all}: "explain" runs greedy explain on one prompt and a left-padded batch;
"all" adds sampling, stream, attach around generate, trace_tensors (with AT2 features) and pooling/attention
variants.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import macs_kernels
from macs_kernels.api.models import default_model_path, load_tokenizer
from macs_kernels.api.prompts import qa_messages
from tests.helpers import QUESTIONS


def main(out: Path, mode: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    rank = dist.get_rank()
    prompts = [qa_messages(*QUESTIONS[i]) for i in range(2)]
    saved = {}

    def keep(name, explanation):
        saved[name] = dict(input_ids=explanation.input_ids, generated_ids=explanation.generated_ids,
                           step_log_c=explanation.step_log_c)

    keep("greedy", macs_kernels.explain(model, tokenizer, prompts[0], max_new_tokens=5))
    for b, item in enumerate(macs_kernels.explain(model, tokenizer, prompts, max_new_tokens=4)):
        keep(f"batch{b}", item)
    if mode == "all":
        torch.manual_seed(3)
        keep("sampled", macs_kernels.explain(model, tokenizer, prompts[1], max_new_tokens=4, do_sample=True,
                                             top_k=20))
        keep("mean_pool", macs_kernels.explain(model, tokenizer, prompts[0], max_new_tokens=3, pooling="mean"))
        keep("efficient", macs_kernels.explain(model, tokenizer, prompts[0], max_new_tokens=3, attention="efficient"))
        keep("fused", macs_kernels.explain(model, tokenizer, prompts[1], max_new_tokens=3, fused_decode=True))
        streamed = list(macs_kernels.stream(model, tokenizer, prompts[1], max_new_tokens=3))
        saved["stream"] = dict(token_ids=torch.tensor([t for t, _ in streamed]))
        greedy = saved["greedy"]
        traced = macs_kernels.trace_tensors(model, greedy["input_ids"], greedy["generated_ids"], at2=True)
        saved["trace"] = dict(log_c=traced.log_c, pooled=traced.pooled, at2_features=traced.at2_features)
        encoded = tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
        with macs_kernels.attach(model) as tracer, torch.no_grad():
            generated = model.generate(**encoded, max_new_tokens=3, do_sample=False)
        saved["attach"] = dict(step_log_c=tracer.rows(0)[0], generated_ids=generated[0, encoded["input_ids"].shape[1]:])
    torch.save(saved, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
