"""Compiled static-cache generation with attribution, side by side with plain (issue 47): one JSON line per figure.

- rows: max |d log c| of each returned sequence's rows against the teacher-forced eager reference
  (`ops.reference.teacher_forced_macs`) under generate's own compile of a static cache, per backend a user can
  name (None, triton, cuda) and prompt length, on a 4-layer float32 GQA model and a 16-layer bfloat16 one. One
  static cache per model and backend, sized for the longest prompt, so each compiles its decode step once (the
  graphs counted so far show it). "cuda-unrefused" runs the cuda kernels inside the compiled steps, which the
  registry refuses there (`registry.COMPILE_UNSAFE`, issue 47) until a GPU shows them exact: its rows are that
  evidence.
- speed: tokens/s and peak memory of plain compiled vs attributed compiled generate on a Llama-3.2-1B shape
  (bfloat16, random weights), best of `--repeats` after a warm-up call, with dynamo's frames, graph breaks and
  recompiles of each; and their ratios.

    python benchmarks/bench_compiled.py --out gpu-results          # on a GPU (the .ci/gpu preset `compiled`)
    python benchmarks/bench_compiled.py --dry-run --out /tmp/x     # CPU: the same stages at toy sizes

On a CPU, transformers compiles a static cache only when its compile_config asks for all devices: the dry run
asks, with dynamo's eager backend (it checks the stages' names and graphs, not inductor's code).
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.generation.configuration_utils import CompileConfig

from macs_kernels import attach
from macs_kernels.apps.bench.generate import ARCHITECTURES
from macs_kernels.engines.hf_models import cache_argument
from macs_kernels.ops import registry, why_unavailable
from macs_kernels.ops.reference import teacher_forced_macs

ROW_MODELS = {  # name -> (layers, dtype)
    "4-layer-fp32": (4, torch.float32),
    "16-layer-bf16": (16, torch.bfloat16),
}
# (label, backend, whether the registry's refusal of compiled cuda kernels is set aside)
BACKENDS = ((None, None, False), ("triton", "triton", False), ("cuda", "cuda", False), ("cuda-unrefused", "cuda", True))


def emit(record: dict, sink) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    sink.write(line + "\n")
    sink.flush()


def compile_config(dry_run: bool) -> dict:
    """generate's compile arguments: its own defaults on a GPU; on a CPU (dry run) dynamo's eager backend, asked for
    on every device."""
    if not dry_run:
        return {}
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    return {"compile_config": config}


def row_model(layers: int, dtype, device, dry_run: bool):
    torch.manual_seed(0)
    hidden, heads = (32, 4) if dry_run else (256, 8)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=0, eos_token_id=None, initializer_range=0.2)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def rows_stage(args, device, sink) -> None:
    new_tokens = 12 if not args.dry_run else 4
    prompts = args.prompts
    for name in args.models:
        model = row_model(*ROW_MODELS[name], device, args.dry_run)
        for label, backend, unrefused in BACKENDS:
            record = dict(stage="rows", model=name, backend=str(label))
            reason = None if backend is None else why_unavailable(backend, device)
            if reason is not None:
                emit(record | dict(status="unavailable", why=reason), sink)
                continue
            # One cache for every prompt: the decode step compiles once per backend, later prompts replay it.
            cache = StaticCache(model.config, max_cache_len=max(prompts) + new_tokens + 1)
            torch._dynamo.reset()
            counters.clear()
            for prompt in prompts:
                ids = torch.randint(3, 512, (1, prompt), generator=torch.Generator().manual_seed(prompt)).to(device)
                cache.reset()  # a cache passed in is a conversation's past: each prompt starts afresh
                with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                    warnings.simplefilter("always")
                    started = time.perf_counter()
                    refusals = mock.patch.dict(registry.COMPILE_UNSAFE, clear=True) if unrefused else nullcontext()
                    try:
                        with refusals, attach(model, backend=backend) as tracer:
                            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                                 do_sample=False, pad_token_id=0, **cache_argument(model, cache),
                                                 **compile_config(args.dry_run))
                    except Exception as error:  # noqa: BLE001 - a figure that failed is reported, not hidden
                        emit(record | dict(prompt=prompt, status="failed", why=f"{type(error).__name__}: {error}"),
                             sink)
                        continue
                    seconds = time.perf_counter() - started
                generated = out[0, prompt:]
                log_c = tracer.rows(0)[0]
                reference, _ = teacher_forced_macs(model, ids[0], generated)
                reference = reference[: log_c.shape[0]].cpu()
                emit(record | dict(
                    prompt=prompt, status="ok", steps=log_c.shape[0], kernels=tracer.backend,
                    max_abs_diff=float((log_c.double() - reference).abs().max()),
                    reference_range=float(reference.max() - reference.min()), seconds=round(seconds, 2),
                    graphs_so_far=counters["stats"]["unique_graphs"],
                    graph_breaks_so_far=sum(counters["graph_break"].values()),
                    warnings=sorted({str(w.message)[:160] for w in caught if "macs_kernels" in str(w.message)}),
                ), sink)
        del model


def _timed_generate(model, ids, new_tokens: int, attributed: bool, dry_run: bool) -> float:
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0, cache_implementation="static", **compile_config(dry_run))
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        if attributed:
            with attach(model):
                model.generate(ids, **kwargs)
        else:
            model.generate(ids, **kwargs)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def speed_stage(args, device, sink) -> None:
    fields = dict(ARCHITECTURES["Llama-3.2-1B" if not args.dry_run else "tiny"])
    fields.pop("model_type")
    if args.dry_run:
        fields["num_hidden_layers"] = 12  # past dynamo's recompile limit, as the GPU's 16 layers are
    torch.manual_seed(0)
    dtype = torch.bfloat16 if not args.dry_run else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(dtype).eval()
    prompt, new_tokens = (1024, 128) if not args.dry_run else (32, 8)
    ids = torch.randint(3, fields["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for method, attributed in (("plain", False), ("attributed", True)):
        torch._dynamo.reset()
        counters.clear()
        warm = _timed_generate(model, ids, new_tokens, attributed, args.dry_run)
        compiled = dict(frames=counters["frames"]["total"], graph_breaks=sum(counters["graph_break"].values()),
                        graphs=counters["stats"]["unique_graphs"])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        best = min(_timed_generate(model, ids, new_tokens, attributed, args.dry_run) for _ in range(args.repeats))
        record = dict(stage="speed", method=method, model="Llama-3.2-1B" if not args.dry_run else "tiny-12-layer",
                      prompt=prompt, new_tokens=new_tokens, first_call_s=round(warm, 2), best_s=round(best, 3),
                      tokens_per_s=round(new_tokens / best, 2), **compiled,
                      recompiles_after_warmup=counters["stats"]["unique_graphs"] - compiled["graphs"],
                      peak_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
        results[method] = record
        emit(record, sink)
    plain, attributed = results["plain"], results["attributed"]
    emit(dict(stage="speed-ratio", tokens_per_s=round(attributed["tokens_per_s"] / plain["tokens_per_s"], 3),
              peak_memory=None if plain["peak_bytes"] is None else round(attributed["peak_bytes"] /
                                                                          plain["peak_bytes"], 4),
              same_frames=attributed["frames"] == plain["frames"], graph_breaks=attributed["graph_breaks"]), sink)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, dynamo's eager backend")
    parser.add_argument("--stages", nargs="+", default=["rows", "speed"], choices=["rows", "speed"],
                        help="in the order given")
    parser.add_argument("--models", nargs="+", default=list(ROW_MODELS), choices=list(ROW_MODELS),
                        help="the rows stage's models")
    parser.add_argument("--prompts", type=int, nargs="+", default=None, help="rows stage (default 300 1200 4000)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if args.prompts is None:
        args.prompts = [24, 40] if args.dry_run else [300, 1200, 4000]
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on a CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / ("compiled_dry_run.jsonl" if args.dry_run else "compiled.jsonl"), "a") as sink:
        for stage in args.stages:
            (rows_stage if stage == "rows" else speed_stage)(args, device, sink)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
