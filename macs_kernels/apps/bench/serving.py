"""`macs-kernels bench --serving`: what attribution costs a continuous-batching server, in one process, on
transformers' ContinuousBatchingManager read the way `macs-kernels serve` reads it.

1. Streaming cost per token: one request generates --long-tokens tokens (end of sequence suppressed) with
   attribution on, and its reader takes the rows of each new token since a cursor (`read_rows`), as the
   server does. Recorded per token: the time since the previous token and the time of the row read alone.
   The summary compares the medians around token 64 and around the last token: the read stays O(1) (ratio
   near 1; a reader of all rows so far would grow linearly), while a token's total time grows only with
   the attention over a longer cache, as plain decoding's does.
2. Throughput: --requests concurrent requests (prompt lengths spread evenly over --prompt-lens, random
   tokens, --new-tokens each), attribution off and on, in interleaved repeats (off, on, on, off, ...):
   generated tokens per second of wall and of process CPU time, and the median over repeats of the ratio
   on/off of neighbouring runs (goal >= 0.95x).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from macs_kernels.apps.bench.common import device_stem, environment, pyplot, save_figure, write_csv

COLUMNS = ("kind", "attribution", "repeat", "step", "token_s", "read_s", "requests", "generated", "wall_s", "cpu_s",
           "tok_s", "cpu_tok_s", "loadavg")
EARLY_STEP = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--serving (continuous batching with and without attribution)")
    group.add_argument("--serving", action="store_true", help="run the serving benchmark instead of generate's")
    group.add_argument("--long-tokens", type=int, default=1024, help="tokens of the streamed request (default 1024)")
    group.add_argument("--requests", type=int, default=8, help="concurrent requests for throughput (default 8)")
    group.add_argument("--prompt-lens", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX"),
                       help="prompt lengths of the concurrent requests (default 256 1024)")


def _manager(model, max_new_tokens: int, cache_tokens: int, page_size: int = 64):
    from transformers import GenerationConfig

    from macs_kernels.engines.continuous import batching_config_class

    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = batching_config_class()(page_size=page_size, num_blocks=-(-cache_tokens // page_size) + 1,
                                     max_batch_tokens=256, auto_switch_to_flash=False, use_cuda_graph=False,
                                     use_async_batching=False)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    return manager


def serving_prompts(vocab: int, requests: int, low: int, high: int, generator=None) -> list[list[int]]:
    """The throughput prompts: `requests` prompts of random tokens, lengths spread evenly over [low, high], drawn
    from `generator` (default: a seed-0 one, the draws `bench --serving` makes first; `bench --vllm` reuses them)."""
    import torch

    generator = generator or torch.Generator().manual_seed(0)
    lengths = [round(low + (high - low) * i / max(1, requests - 1)) for i in range(requests)]
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


def _serve(model, tracer, prompts: list[list[int]], new_tokens: int, attribution: bool) -> list[dict]:
    """Run the prompts to completion, each stream read as the server reads it; per token of every request
    (request, step, arrival time, row read seconds)."""
    manager = _manager(model, new_tokens, sum(len(p) + new_tokens for p in prompts))
    records, sent = [], {}
    try:
        for i, prompt in enumerate(prompts):
            request_id = f"bench_{i}"
            if attribution:
                tracer.configure(request_id)
            else:
                tracer.skip(request_id)
            manager.add_request(prompt, request_id=request_id, max_new_tokens=new_tokens, streaming=True)
            sent[request_id] = 0
        finished = 0
        while finished < len(prompts):
            output = manager.get_result(timeout=600)
            if output is None:
                raise RuntimeError("the continuous-batching manager stopped answering")
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            arrived = time.perf_counter()
            tokens = len(output.generated_tokens)
            start = sent[output.request_id]
            read = 0.0
            if attribution and tokens > start:
                began = time.perf_counter()
                tracer.read_rows(output.request_id, start, tokens)
                read = time.perf_counter() - began
            for step in range(start, tokens):
                records.append({"request": output.request_id, "step": step, "arrived": arrived, "read_s": read})
            sent[output.request_id] = tokens
            if output.is_finished():
                finished += 1
                tracer.release(output.request_id)
    finally:
        manager.stop(block=True)
    return records


def run(args) -> int:
    import torch

    from macs_kernels.apps.bench.generate import Spec, load
    from macs_kernels.engines.continuous import attach_continuous

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = "tiny" if args.quick and args.model is None and args.config is None else args.config
    model, _ = load(Spec(args.model, config, dtype, str(device), "plain-sdpa", 1, 1, 2, args.threads))
    model.set_attn_implementation("sdpa")
    long_tokens = min(args.long_tokens, 96) if args.quick else args.long_tokens
    if long_tokens <= EARLY_STEP + 16:
        raise SystemExit(f"--long-tokens must exceed {EARLY_STEP + 16} (the early window is around token 64)")
    low, high = (16, 48) if args.quick else args.prompt_lens
    new_tokens = 4 if args.quick else args.new_tokens or 32
    repeats = 1 if args.quick else args.repeats
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    prompts = serving_prompts(vocab, args.requests, low, high, generator)
    env = environment(device)
    stem = args.name or device_stem("serving", env, device) + ("_quick" if args.quick else "")
    rows = []
    with attach_continuous(model, backend="torch") as tracer:
        stream = _serve(model, tracer, [torch.randint(3, vocab, (128,), generator=generator).tolist()],
                        long_tokens, attribution=True)
        for previous, record in zip(stream, stream[1:]):
            rows.append({"kind": "stream", "attribution": True, "step": record["step"],
                         "token_s": record["arrived"] - previous["arrived"], "read_s": record["read_s"]})
        order = [False, True, True, False]
        for repeat in range(repeats):
            for attribution in order if repeat % 2 == 0 else order[::-1]:
                load_before = os.getloadavg()[0]
                cpu, wall = time.process_time(), time.perf_counter()
                records = _serve(model, tracer, prompts, new_tokens, attribution)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                rows.append({"kind": "throughput", "attribution": attribution, "repeat": repeat,
                             "requests": len(prompts), "generated": len(records), "wall_s": wall, "cpu_s": cpu,
                             "tok_s": len(records) / wall, "cpu_tok_s": len(records) / cpu, "loadavg": load_before})
                print(f"repeat {repeat} attribution {'on ' if attribution else 'off'} {len(records)} tokens "
                      f"{len(records) / wall:7.2f} tok/s {len(records) / cpu:7.2f} tok/CPU-s", flush=True)
    rows = [{column: row.get(column, "") for column in COLUMNS} | env for row in rows]
    write_csv(rows, args.out / f"{stem}.csv")
    summary = summarise(rows, long_tokens)
    write_csv([summary | env | {"model": args.model or config or "SmolLM2-135M-Instruct"}],
              args.out / f"{stem}_summary.csv")
    plot(rows, summary, args.out / f"{stem}.png")
    for key, value in summary.items():
        print(f"{key:34s} {value:.4g}" if isinstance(value, float) else f"{key:34s} {value}")
    print(f"wrote {args.out / stem}.csv, {stem}_summary.csv and {stem}.png")
    return 0


def summarise(rows: list[dict], long_tokens: int) -> dict:
    stream = [row for row in rows if row["kind"] == "stream"]

    def window(field, low, high):
        return statistics.median(row[field] for row in stream if low <= row["step"] < high)

    late = long_tokens - 32
    summary = {
        "long_tokens": long_tokens,
        "token_s_at_64": window("token_s", EARLY_STEP - 16, EARLY_STEP + 16),
        f"token_s_at_{long_tokens}": window("token_s", late, long_tokens),
        "read_s_at_64": window("read_s", EARLY_STEP - 16, EARLY_STEP + 16),
        f"read_s_at_{long_tokens}": window("read_s", late, long_tokens),
    }
    summary["token_ratio_late_vs_64"] = summary[f"token_s_at_{long_tokens}"] / summary["token_s_at_64"]
    summary["read_ratio_late_vs_64"] = summary[f"read_s_at_{long_tokens}"] / summary["read_s_at_64"]
    runs = [row for row in rows if row["kind"] == "throughput"]
    by_repeat = {}
    for row in runs:
        by_repeat.setdefault(row["repeat"], {}).setdefault(row["attribution"], []).append(row)
    paired = [statistics.median(r["cpu_tok_s"] for r in pair[True]) / statistics.median(r["cpu_tok_s"] for r in
              pair[False]) for pair in by_repeat.values() if True in pair and False in pair]
    for attribution in (False, True):
        chosen = [row for row in runs if row["attribution"] == attribution]
        name = "on" if attribution else "off"
        summary[f"tok_s_{name}"] = statistics.median(row["tok_s"] for row in chosen)
        summary[f"cpu_tok_s_{name}"] = statistics.median(row["cpu_tok_s"] for row in chosen)
    summary["throughput_on_vs_off_paired_cpu"] = statistics.median(paired)
    summary["throughput_on_vs_off_wall"] = summary["tok_s_on"] / summary["tok_s_off"]
    return summary


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    stream = [row for row in rows if row["kind"] == "stream"]
    steps = [row["step"] for row in stream]
    left.plot(steps, [1e3 * row["token_s"] for row in stream], label="time per token", linewidth=0.8)
    left.plot(steps, [1e3 * row["read_s"] for row in stream], label="row read (cursor)", linewidth=0.8)
    left.set_xlabel("generated token")
    left.set_ylabel("ms")
    left.set_yscale("log")
    left.set_title(f"one streamed request: read at token {summary['long_tokens']} / at 64 = "
                   f"{summary['read_ratio_late_vs_64']:.2f}x")
    left.legend()
    names = ["off", "on"]
    right.bar(names, [summary[f"cpu_tok_s_{name}"] for name in names], color=["#999999", "#c0392b"])
    right.set_ylabel("generated tokens per CPU second")
    right.set_title(f"{rows[-1]['requests']} concurrent requests: on/off = "
                    f"{summary['throughput_on_vs_off_paired_cpu']:.2f}x (paired)")
    save_figure(figure, path)
