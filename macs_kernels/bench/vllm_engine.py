"""`macs-kernels bench --vllm`: vLLM with MACS attribution against the same engine without it (run it in vLLM's
environment).

    macs-kernels bench --vllm                 # default model, 8 requests, prompts 256-1024, 32 new tokens, 3 repeats
    macs-kernels bench --vllm --repeats 1 --requests 4 --prompt-lens 64 256 --new-tokens 8      # quick
    VLLM_PLUGINS=none macs-kernels bench --vllm --vllm-modes off   # vLLM without the plugin loaded at all

One engine (vLLM's default multiprocessing engine, eager, float32, prefix caching off so that every run
prefills its prompts) serves every run, after one warm-up run of the whole workload: prompts of random token
ids spread evenly over the length range, greedy, end of sequence ignored, all requests submitted at once.
"off" runs them as plain requests, "on" with SamplingParams.extra_args["attribution"] (and reads every
request's rows back through collective_rpc, timed apart). Modes alternate (off, on, on, off, ...).
Throughput is generated tokens per second of wall time and per second of CPU time of the engine core
process (user + system, all threads: on a machine shared with other work, wall time measures the neighbours
too). Appends one row per run to <--out>/vllm_cpu_throughput.csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import time

FIELDS = ["plugin", "mode", "repeat", "requests", "prompt_min", "prompt_max", "new_tokens", "wall_s", "engine_cpu_s",
          "tokens_per_s", "tokens_per_cpu_s", "read_s", "engine_rss_mib", "load_before", "load_after"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--vllm (vLLM with and without attribution; also --model, --requests, "
                                      "--prompt-lens, --new-tokens, --repeats, --out)")
    group.add_argument("--vllm", action="store_true", help="run the vLLM benchmark (in vLLM's environment)")
    group.add_argument("--vllm-modes", nargs="+", default=["off", "on"], choices=["off", "on"],
                       help="modes to alternate (default: off on)")


def run(args) -> int:
    import psutil
    import torch
    from vllm import LLM, SamplingParams

    from .. import vllm as macs_vllm
    from ..models import default_model_path

    new_tokens, repeats = args.new_tokens or 32, args.repeats

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    plugin = "none" if os.environ.get("VLLM_PLUGINS") not in (None, "macs_kernels") else "macs_kernels"
    options = {"worker_extension_cls": macs_vllm.WORKER_EXTENSION} if plugin == "macs_kernels" else {}
    llm = LLM(str(args.model or default_model_path()), dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=args.requests, enable_prefix_caching=False, **options)
    if "on" in args.vllm_modes:
        macs_vllm.attach(llm)
    low, high = args.prompt_lens
    generator = torch.Generator().manual_seed(0)
    lengths = [low + (high - low) * i // max(1, args.requests - 1) for i in range(args.requests)]
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=generator).tolist()} for n in lengths]
    engine = [child for child in psutil.Process().children(recursive=True)]

    def cpu_seconds():
        return sum(sum(p.cpu_times()[:2]) for p in engine)

    order = []
    for repeat in range(repeats):
        modes = args.vllm_modes if repeat % 2 == 0 else args.vllm_modes[::-1]
        order += [(repeat, mode) for mode in modes]
    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    out = args.out / "vllm_cpu_throughput.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.exists()
    with out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        if new_file:
            writer.writeheader()
        for repeat, mode in order:
            extra = macs_vllm.attribution() if mode == "on" else None
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            load_before = os.getloadavg()[0]
            cpu, start = cpu_seconds(), time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            read = 0.0
            if mode == "on":
                start = time.perf_counter()
                rows = macs_vllm.rows(llm, [o.request_id for o in outputs], release=True)
                read = time.perf_counter() - start
                assert all(r.shape[0] == new_tokens for r in rows.values())
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            row = dict(plugin=plugin, mode=mode, repeat=repeat, requests=args.requests, prompt_min=low,
                       prompt_max=high, new_tokens=new_tokens, wall_s=round(wall, 3), engine_cpu_s=round(cpu, 3),
                       tokens_per_s=round(tokens / wall, 3), tokens_per_cpu_s=round(tokens / cpu, 3),
                       read_s=round(read, 4),
                       engine_rss_mib=round(sum(p.memory_info().rss for p in engine) / 2**20, 1),
                       load_before=load_before, load_after=os.getloadavg()[0])
            writer.writerow(row)
            handle.flush()
            print(row, flush=True)

    return 0
