"""`macs-kernels bench`: generation throughput and peak memory of plain generate, MACS and the eager
output_attentions way of computing the same scores. Results go to --out (default: the working directory),
so it runs the same from an installed package as from a checkout.

For each prompt length, batch size and generation mode (--modes, default greedy), every method generates the
same number of new tokens (end-of-sequence suppressed) from the same random prompt:

- plain-sdpa (plain-fa2 where flash-attn is installed on a GPU): `model.generate`, no attribution;
- macs-<backend>: the same generate inside `macs_kernels.attach` (every backend that runs natively on
  the device: never the Triton interpreter); macs-torch-fused: the torch backend with fused_decode=True
  (it computes decode attention itself, reading K once, instead of calling sdpa); macs-auto (on request,
  --methods): the backend and fused_decode that attach chooses by itself, the `backend` column names it;
- output-attentions (batch 1 only): eager attention, `generate(output_attentions=True)`, then MACS
  computed from the returned attention rows, as attention-based attribution tools do today. It keeps
  every step's attentions: at 2k tokens the prefill's alone take 30 x 9 x 2k^2 x 4 bytes = 4.4 GB on the
  default model. Where that would not fit the device, the row says so (status) instead of running.
- output-attentions-rerun (batch 1 only): the public MACS implementation's way: no KV cache, every step
  re-runs the whole sequence through eager attention with output_attentions=True and scores the last row
  of every layer. Each of its steps costs a full forward, so only its first RERUN_STEPS steps are timed.

Generation modes: greedy; static (greedy with cache_implementation="static", which generate compiles on an
accelerator: torch.compile, CUDA graphs; the `compiled` column says whether it did, `timed_compiles` how many
graphs dynamo compiled during the timed run, 0 when the warm-up took them all); beam4 (num_beams=4, the best
beam returned); prompt-lookup (prompt_lookup_num_tokens=3, greedy, batch 1 only as transformers requires).
Each non-greedy mode is timed for plain and MACS, and its ratios are to plain-sdpa in the same mode (the
output_attentions methods run greedy only). Tokens count per returned sequence: beam search's 4 beams per sequence
are its cost, not extra tokens.

--profile runs every measurement once more under torch.profiler: profiled_ms_per_token is the GPU kernels' time
(on a CPU: the CPU time of the profiled ops) of that whole generate, prefill included, over its B x new tokens.

Prefill tokens/s = B x N / (time to the first new token); decode tokens/s = B x (new - 1) / the rest
(for the output-attentions methods the rest includes scoring). End-to-end tokens/s = B x new / (prefill +
decode time), the decode time of output-attentions-rerun extrapolated from its timed steps. The same with
the process's CPU time instead of wall time (decode_cpu_tok_s) is what to compare on a shared,
oversubscribed machine. Timings come from the benchmark's own process (the model loaded once), every
method of a cell back to back: a shared machine's speed drifts by up to 2x between fresh processes, so only
neighbouring runs compare. Peak memory: CUDA max_memory_allocated on a GPU; on the CPU the peak RSS of a
fresh process per measurement (the weights included, the same for every method) run with fixed glibc malloc
thresholds (MALLOC_ENV: without them the peak varies by up to 15% between repeats of the same method; with
them decode is ~30% slower, so that process's timings are not used). Repeats are interleaved (every method
of a cell, in rotated order, before the next repeat) and summarised by medians; decode_cpu_vs_plain_paired
is the median over repeats of the ratio to plain in the same repeat.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from macs_kernels.apps.bench.common import PACKAGE_DIR, device_stem, environment, pyplot, save_figure, write_csv

CPU_LENGTHS = (256, 512, 1024, 2048)
GPU_LENGTHS = (1024, 4096, 16384, 32768)
QUICK_LENGTHS = (48, 96)
BATCHES = (1, 8)
OUTPUT_ATTENTIONS = "output-attentions"
RERUN = "output-attentions-rerun"
EAGER_METHODS = (OUTPUT_ATTENTIONS, RERUN)  # batch 1 only: their attentions alone take GBs per sequence
RERUN_STEPS = 4
GREEDY = "greedy"
STATIC = "static"
# generate kwargs of each mode (on top of greedy's: do_sample=False, EOS suppressed by min_new_tokens).
MODES = {GREEDY: {}, STATIC: {"cache_implementation": "static"}, "beam4": {"num_beams": 4},
         "prompt-lookup": {"prompt_lookup_num_tokens": 3}}
SINGLE_SEQUENCE_MODES = ("prompt-lookup",)  # transformers' assisted decoding takes batch 1 only
# --config runs without --lengths / --modes: issue 42's side-by-side grid (a 4k context with 64 new tokens
# and room to spare), eager and compiled static cache.
CONFIG_LENGTHS = (512, 2048, 3936)
CONFIG_MODES = (GREEDY, STATIC)
AUTO = "macs-auto"


def engine_backends() -> tuple[str, ...]:
    """The backends that run generate's attention, from their declarations (read when needed: they import torch)."""
    from macs_kernels.ops.backends import ENGINE_BACKENDS

    return ENGINE_BACKENDS


# Shapes of real architectures for --config (no weights travel to a GPU machine; random weights cost
# the same). A config.json path or folder works too.
ARCHITECTURES = {
    "Llama-3.1-8B": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "SmolLM2-135M": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # --quick: seconds on two CPU cores.
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
    ),
}

COLUMNS = (
    "machine", "device", "python", "torch", "transformers", "triton", "threads", "commit", "loadavg",
    "model", "dtype", "mode", "method", "batch", "prompt_len", "new_tokens", "repeat", "status",
    "prefill_s", "decode_s", "decode_steps", "prefill_cpu_s", "decode_cpu_s", "prefill_tok_s", "decode_tok_s",
    "decode_cpu_tok_s", "e2e_tok_s", "peak_mem_bytes", "memory", "isolated", "backend", "compiled",
    "timed_compiles", "mem_at_start_bytes", "profiled", "profiled_s", "profiled_ms_per_token",
)
SUMMARY_COLUMNS = (
    "machine", "device", "torch", "transformers", "commit", "model", "dtype", "mode", "method", "batch", "prompt_len",
    "new_tokens", "repeats", "backend", "compiled", "prefill_tok_s", "decode_tok_s", "decode_cpu_tok_s", "e2e_tok_s",
    "peak_mem_bytes", "profiled", "profiled_ms_per_token", "prefill_vs_plain", "decode_vs_plain", "decode_cpu_vs_plain",
    "decode_cpu_vs_plain_paired", "e2e_vs_plain", "mem_vs_plain", "profiled_vs_plain", "decode_vs_output_attentions",
    "decode_cpu_vs_output_attentions", "e2e_vs_output_attentions", "mem_vs_output_attentions",
    "decode_vs_output_attentions_rerun", "e2e_vs_output_attentions_rerun", "mem_vs_output_attentions_rerun",
)
# Ratio columns: (prefix, median field). profiled_ms_per_token is empty in runs without --profile.
RATIOS = (("prefill", "prefill_tok_s"), ("decode", "decode_tok_s"), ("decode_cpu", "decode_cpu_tok_s"),
          ("e2e", "e2e_tok_s"), ("mem", "peak_mem_bytes"), ("profiled", "profiled_ms_per_token"))


# ---- one measurement ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """One (model, method, batch, prompt length, mode) measurement; JSON-able so a fresh process can run it."""

    model: str | None
    config: str | None
    dtype: str
    device: str
    method: str
    batch: int
    prompt_len: int
    new_tokens: int
    threads: int | None = None
    mode: str = GREEDY
    profile: bool = False


def methods_for(device) -> list[str]:
    """Every method that runs natively on `device`, plain first."""
    import importlib.util

    import torch

    from macs_kernels.ops.registry import why_unavailable

    device = torch.device(device)
    methods = ["plain-sdpa"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        methods.append("plain-fa2")
    # why_unavailable would accept the Triton interpreter on a CPU: a test tool, not a contender.
    for backend in engine_backends():
        if (backend == "torch" or device.type == "cuda") and why_unavailable(backend, device) is None:
            methods.append(f"macs-{backend}")
    methods.append("macs-torch-fused")  # the torch backend computing decode attention itself
    return methods + list(EAGER_METHODS)


def check_methods(methods: list[str]) -> None:
    """Refuse, before any model loads, a method that the benchmark does not know."""
    known = ["plain-sdpa", "plain-fa2", *(f"macs-{b}" for b in engine_backends()), "macs-torch-fused", AUTO,
             *EAGER_METHODS]
    unknown = [method for method in methods if method not in known]
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: choose from {', '.join(known)}")


def applies(method: str, mode: str, batch: int) -> bool:
    """Whether a (method, mode, batch) cell is measured: the output_attentions ways score greedy batch-1 rows
    only, assisted decoding takes one sequence."""
    if method in EAGER_METHODS:
        return mode == GREEDY and batch == 1
    return batch == 1 or mode not in SINGLE_SEQUENCE_MODES


def load(spec: Spec):
    """(model, pad id) for a spec: weights from --model (default model when neither is given) or a
    random-initialised model of --config's shape."""
    import torch

    dtype = getattr(torch, spec.dtype)
    implementation = "eager" if spec.method in EAGER_METHODS else (
        "flash_attention_2" if spec.method == "plain-fa2" else "sdpa")
    if spec.config is None:
        from macs_kernels.api.generation import pad_id
        from macs_kernels.api.models import load_model

        model, tokenizer = load_model(spec.model, dtype=dtype, device=spec.device, attn_implementation=implementation)
        return model, pad_id(model, tokenizer)
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.config in ARCHITECTURES:
        fields = dict(ARCHITECTURES[spec.config])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(spec.config)
    torch.manual_seed(0)
    with torch.device(spec.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=implementation)
    return model.eval(), 0


def prompt_ids(vocab_size: int, batch: int, length: int, device):
    """A fixed random prompt (the same for every method), away from the low ids where special tokens live."""
    import torch

    generator = torch.Generator().manual_seed(length)
    low = min(1000, vocab_size // 4)
    return torch.randint(low, vocab_size, (1, length), generator=generator).expand(batch, -1).to(device)


def _synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _scores_from_attentions(attentions, n_input: int, config) -> None:
    """MACS from per-step tuples of per-layer attentions (generate(output_attentions=True)'s layout), as
    attention-based tools compute it."""
    import torch

    from macs_kernels.ops.torch import backend as torch_backend

    batch = attentions[0][0].shape[0]
    index = lambda value: torch.full((batch,), value, dtype=torch.long, device=attentions[0][0].device)  # noqa: E731
    for step in attentions:
        keys = step[0].shape[-1]
        log_c = torch.zeros(batch, n_input, device=step[0].device)
        for layer in step:
            torch_backend.macs_update_rows(
                layer[:, :, -1, :], log_c, input_start=index(0), input_end=index(n_input), kv_len=index(keys),
                alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
            )
        torch_backend.macs_zscore(log_c, index(n_input))


def _generate(model, ids, spec: Spec, pad: int):
    """((prefill, decode) wall seconds, (prefill, decode) process CPU seconds, decode steps) of one generate
    in spec.mode."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from macs_kernels.core.config import MacsConfig
    from macs_kernels.engines.generate import attach

    first_token = []

    class MarkFirstToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not first_token:
                _synchronize(spec.device)
                first_token.extend((time.perf_counter(), time.process_time()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kwargs = dict(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False,
                  pad_token_id=pad, attention_mask=torch.ones_like(ids),
                  stopping_criteria=StoppingCriteriaList([MarkFirstToken()]), **MODES[spec.mode])
    oa = spec.method == OUTPUT_ATTENTIONS
    if oa:
        kwargs.update(output_attentions=True, return_dict_in_generate=True)
    macs = spec.method.startswith("macs-")
    backend, _, fused = spec.method[5:].partition("-")
    backend = None if spec.method == AUTO else backend
    context = attach(model, backend=backend, fused_decode=bool(fused) or None) if macs else contextlib.nullcontext()
    _synchronize(spec.device)
    start, start_cpu = time.perf_counter(), time.process_time()
    with context:
        output = model.generate(ids, **kwargs)
    if oa:
        _scores_from_attentions(output.attentions, ids.shape[1], MacsConfig())
    _synchronize(spec.device)
    end, end_cpu = time.perf_counter(), time.process_time()
    # Counted, not assumed: assisted decoding accepts several tokens per pass and must still stop at `new`.
    generated = (output.sequences if oa else output).shape[1] - ids.shape[1]
    del output
    return ((first_token[0] - start, end - first_token[0]), (first_token[1] - start_cpu, end_cpu - first_token[1]),
            generated - 1)


def _rerun_without_cache(model, ids, spec: Spec, pad: int):
    """_generate's timings for output-attentions-rerun (its first RERUN_STEPS steps, each a full forward; no
    padding, so `pad` is unused)."""
    import torch

    from macs_kernels.core.config import MacsConfig

    wall, cpu = [], []
    for _ in range(min(spec.new_tokens, RERUN_STEPS)):
        _synchronize(spec.device)
        start, start_cpu = time.perf_counter(), time.process_time()
        output = model(ids, attention_mask=torch.ones_like(ids), use_cache=False, output_attentions=True)
        _scores_from_attentions((output.attentions,), spec.prompt_len, MacsConfig())
        ids = torch.cat([ids, output.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        del output
        _synchronize(spec.device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return (wall[0], sum(wall[1:])), (cpu[0], sum(cpu[1:])), len(wall) - 1


def _reset_peak(device) -> str:
    """Start a fresh peak-memory window; returns how the peak is measured."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:  # Linux: writing 5 resets this process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
        return "rss_peak"
    except OSError:
        return "rss_peak_since_start"


def _peak(device) -> int:
    import resource

    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def oa_bytes(model, spec: Spec) -> int:
    """Attention memory of the output_attentions ways: every step's rows of every layer (cached generate),
    or one full forward's matrices (rerun)."""
    config = model.config.get_text_config()
    item = {"float32": 4}.get(spec.dtype, 2)
    n, new = spec.prompt_len, spec.new_tokens
    per_head = (n + RERUN_STEPS) ** 2 if spec.method == RERUN else n * n + sum(n + k for k in range(1, new))
    return config.num_hidden_layers * config.num_attention_heads * per_head * item * spec.batch


def _available_bytes(device) -> int:
    import torch

    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _profiled_seconds(timed, model, ids, spec: Spec, pad: int) -> tuple[str, float, int]:
    """(what was summed, seconds, tokens generated) of one more run under torch.profiler: the self time of every
    GPU kernel on a GPU (the sum the profiler's own table totals), of every profiled op on a CPU."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.device(spec.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as profiler:
        _, _, steps = timed(model, ids, spec, pad)
    events = [e for e in profiler.key_averages() if not e.is_user_annotation]
    if gpu:
        microseconds = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    else:
        microseconds = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
    return ("gpu kernels" if gpu else "cpu ops"), microseconds / 1e6, steps + 1


def measure(spec: Spec, model=None, pad=None) -> dict:
    """One measurement: the result columns of a CSV row."""
    import torch
    from torch._dynamo.utils import counters

    from macs_kernels.engines.generate import check_generate
    from macs_kernels.ops.registry import resolve_backend

    if spec.threads:
        torch.set_num_threads(spec.threads)
    if model is None:
        model, pad = load(spec)
    ids = prompt_ids(model.config.get_text_config().vocab_size, spec.batch, spec.prompt_len, spec.device)
    if spec.method in EAGER_METHODS and oa_bytes(model, spec) > 0.8 * _available_bytes(spec.device):
        return {"status": f"skipped: its attentions need {oa_bytes(model, spec) / 2**30:.1f} GiB"}
    timed = _rerun_without_cache if spec.method == RERUN else _generate
    compiled = spec.method not in EAGER_METHODS and check_generate(model, dict(MODES[spec.mode])).compiled
    static = "cache_implementation" in MODES[spec.mode]
    if static:
        # generate sizes a static cache at the largest length any earlier call on this model asked for (to spare a
        # recompile); forgetting it gives every cell a cache of its own prompt and new tokens, the same for plain
        # and MACS whatever ran before.
        vars(model).pop("_previous_max_cache_length", None)
    with torch.inference_mode():
        # On a GPU the first pass at a shape compiles (Triton specialisations, cuBLAS and sdpa kernel choices), so
        # the warm-up takes the measured prompt; on a CPU a short one warms the same code at a fraction of the cost.
        # A static cache's warm-up is the timed run's shape exactly: generate's compiled graphs (and CUDA graphs)
        # are specialised to the cache's size.
        warm = spec.prompt_len if torch.device(spec.device).type == "cuda" or static else 16
        warm_spec = spec if static else dataclasses.replace(spec, prompt_len=warm, new_tokens=2)
        timed(model, ids[:, :warm], warm_spec, pad)
        memory = _reset_peak(spec.device)
        at_start = torch.cuda.memory_allocated(spec.device) if torch.device(spec.device).type == "cuda" else ""
        graphs = counters["stats"]["unique_graphs"]
        (prefill_s, decode_s), (prefill_cpu_s, decode_cpu_s), steps = timed(model, ids, spec, pad)
        timed_compiles = counters["stats"]["unique_graphs"] - graphs
        peak = _peak(spec.device)
        profiled = _profiled_seconds(timed, model, ids, spec, pad) if spec.profile else ("", "", 0)
    decoded = spec.batch * steps
    e2e_s = prefill_s + decode_s * (spec.new_tokens - 1) / steps  # the rerun's untimed steps extrapolated
    backend = ""
    if spec.method.startswith("macs-"):
        backend = resolve_backend(None, spec.device, captured=compiled) if spec.method == AUTO else spec.method[5:]
    what, profiled_s, profiled_tokens = profiled
    return {
        "status": "ok", "prefill_s": round(prefill_s, 6), "decode_s": round(decode_s, 6), "decode_steps": steps,
        "prefill_cpu_s": round(prefill_cpu_s, 6), "decode_cpu_s": round(decode_cpu_s, 6),
        "prefill_tok_s": round(spec.batch * spec.prompt_len / prefill_s, 2),
        "decode_tok_s": round(decoded / decode_s, 3), "decode_cpu_tok_s": round(decoded / decode_cpu_s, 3),
        "e2e_tok_s": round(spec.batch * spec.new_tokens / e2e_s, 3),
        "peak_mem_bytes": peak, "memory": memory, "backend": backend, "compiled": compiled,
        "timed_compiles": timed_compiles, "mem_at_start_bytes": at_start, "profiled": what,
        "profiled_s": round(profiled_s, 6) if what else "",
        "profiled_ms_per_token": round(1e3 * profiled_s / (spec.batch * profiled_tokens), 4) if what else "",
    }


# glibc raises its mmap threshold after a large block is freed, so later large tensors come from the heap and
# stay resident after they are freed: the peak RSS then depends on allocation history (up to 15% apart between
# repeats of one method at batch 8). A fixed threshold returns every large block to the OS when it is freed,
# so the peak RSS follows the live memory (repeats within 0.01%), but the page faults cost ~30% of decode
# throughput: peak memory is measured in a fresh process with it, timings in the benchmark's own process.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _fresh_process_memory(spec: Spec) -> dict:
    """Peak memory of one measurement in a fresh process with MALLOC_ENV (its timings are discarded: the page
    faults slow it down)."""
    memory = _measure_in_fresh_process(dataclasses.replace(spec, profile=False), MALLOC_ENV)
    if memory["status"] != "ok":
        return {"status": memory["status"]}
    return {"peak_mem_bytes": memory["peak_mem_bytes"], "memory": f"{memory['memory']}_fixed_mmap_threshold"}


def _measure_in_fresh_process(spec: Spec, env: dict | None = None) -> dict:
    command = [
        sys.executable,
        "-m",
        "macs_kernels.apps.bench.generate",
        "--worker",
        json.dumps(dataclasses.asdict(spec)),
    ]
    # The worker imports this very package, wherever it lies (a checkout run as a script, or installed).
    path = os.pathsep.join(filter(None, (str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH"))))
    environment = {**os.environ, "PYTHONPATH": path, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": f"failed (exit {done.returncode}): {tail[0][:200]}"}
    return json.loads(lines[-1])


# ---- the grid -------------------------------------------------------------------------------------------
def grid(args, device, max_positions: int) -> list[tuple[int, int]]:
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else CONFIG_LENGTHS if args.config else
                               CPU_LENGTHS if device.type == "cpu" else GPU_LENGTHS)
    batches = args.batches or ((1, 2) if args.quick else BATCHES)
    usable = [n for n in lengths if n + args.new_tokens <= max_positions]
    skipped = sorted(set(lengths) - set(usable))
    if skipped:
        print(f"skipping prompt lengths {skipped}: beyond the model's context window ({max_positions})")
    return [(n, b) for n in usable for b in batches]


def summarise(rows: list[dict]) -> list[dict]:
    """Medians per (mode, method, batch, length) and the ratios to plain-sdpa in the same mode and to
    output-attentions, all in the same mode (so the output_attentions ratios are greedy only). Rows without a
    mode (CSVs written before modes existed) are greedy."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            mode = row.get("mode") or GREEDY
            cells.setdefault((mode, row["method"], row["batch"], row["prompt_len"]), []).append(row)
    medians = {}
    for key, group in cells.items():
        medians[key] = {field: _median([r[field] for r in group if r.get(field) not in ("", None)])
                        for _, field in RATIOS}
        medians[key]["repeats"] = len(group)
    summary = []
    mode_order = {mode: i for i, mode in enumerate(MODES)}
    by_length_batch_mode_method = sorted(
        medians.items(), key=lambda item: (item[0][3], item[0][2], mode_order.get(item[0][0], len(MODES)), item[0][1]))
    for (mode, method, batch, length), values in by_length_batch_mode_method:
        first = cells[(mode, method, batch, length)][0]
        row = {field: first[field] for field in SUMMARY_COLUMNS if field in first}
        row.update(values, mode=mode, peak_mem_bytes=int(values["peak_mem_bytes"]))
        for name, reference in (("plain", "plain-sdpa"), ("output_attentions", OUTPUT_ATTENTIONS),
                                ("output_attentions_rerun", RERUN)):
            base = medians.get((mode, reference, batch, length))
            for short, field in RATIOS:
                column = f"{short}_vs_{name}"
                if column in SUMMARY_COLUMNS:
                    row[column] = round(values[field] / base[field], 3) if base and "" not in (
                        values[field], base[field]) else ""
        row["decode_cpu_vs_plain_paired"] = _paired_ratio(
            cells[(mode, method, batch, length)], cells.get((mode, "plain-sdpa", batch, length), []),
            "decode_cpu_tok_s",
        )
        summary.append(row)
    return summary


def _median(values: list):
    return statistics.median(values) if values else ""


def _paired_ratio(group: list[dict], plain: list[dict], field: str):
    """Median over repeats of `field` over plain's in the same repeat ("" without a pair). Repeats interleave
    the methods, so a pair shares the machine's speed of the moment; a ratio of medians does not, and on a
    machine whose speed drifts between repeats it mixes fast and slow moments."""
    plain_by_repeat = {r.get("repeat"): r[field] for r in plain}
    ratios = [r[field] / plain_by_repeat[r.get("repeat")] for r in group
              if r.get("repeat") is not None and plain_by_repeat.get(r.get("repeat"))]
    return round(statistics.median(ratios), 3) if ratios else ""


def plot(summary: list[dict], path: Path) -> None:
    plt = pyplot()
    batches = sorted({r["batch"] for r in summary})
    fields = (("decode_tok_s", "decode tokens/s"), ("decode_cpu_tok_s", "decode tokens per CPU-second"),
              ("prefill_tok_s", "prefill tokens/s"), ("e2e_tok_s", "end-to-end tokens/s"),
              ("peak_mem_bytes", "peak memory (GiB)"))
    profiled = [r["profiled"] for r in summary if r.get("profiled")]
    if profiled:
        fields += (("profiled_ms_per_token", f"profiled ms per token ({profiled[0]})"),)
    fig, axes = plt.subplots(len(batches), len(fields), figsize=(4.2 * len(fields), 3.2 * len(batches)), squeeze=False)
    modes = [mode for mode in MODES if any(r["mode"] == mode for r in summary)]
    one_length = len({r["prompt_len"] for r in summary}) == 1
    for (i, batch), (j, (field, label)) in ((a, b) for a in enumerate(batches) for b in enumerate(fields)):
        ax = axes[i][j]
        if one_length and len(modes) > 1:  # a line per method would be a dot per method: bars per mode instead
            _mode_bars(ax, [r for r in summary if r["batch"] == batch], modes, field)
            ax.set_title(f"{label}, batch {batch}, {summary[0]['prompt_len']} prompt tokens", fontsize=9)
            continue
        for mode, method in sorted({(r["mode"], r["method"]) for r in summary}):
            points = sorted((r["prompt_len"], r[field] / (2**30 if field == "peak_mem_bytes" else 1))
                            for r in summary if (r["mode"], r["method"]) == (mode, method) and r["batch"] == batch
                            and r.get(field) not in ("", None))
            if points:
                ax.plot(*zip(*points), marker="o", label=method if mode == GREEDY else f"{method}, {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{label}, batch {batch}", fontsize=9)
        ax.legend(fontsize=7)
    first = summary[0]
    fig.suptitle(f"{first['model']} {first['dtype']} on {first['device']}, {first['new_tokens']} new tokens",
                 fontsize=10)
    save_figure(fig, path)


def _mode_bars(ax, summary: list[dict], modes: list[str], field: str) -> None:
    methods = sorted({r["method"] for r in summary})
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        values = {r["mode"]: r[field] / (2**30 if field == "peak_mem_bytes" else 1)
                  for r in summary if r["method"] == method and r.get(field) not in ("", None)}
        ax.bar([x + k * width for x, mode in enumerate(modes) if mode in values],
               [values[mode] for mode in modes if mode in values], width, label=method)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(modes))], modes)
    ax.legend(fontsize=7)


def run(args) -> int:
    import torch

    if args.summarise is not None:
        return summarise_csv(args.summarise)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = "tiny" if args.quick and args.model is None and args.config is None else args.config
    methods = args.methods or methods_for(device)
    check_methods(methods)
    if STATIC in args.modes:
        # Every (batch, length, method) of a compiled static cache may compile its own graphs; past dynamo's
        # default limit of 8 it would run the rest uncompiled, without a word in the figures.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    base = Spec(args.model, config, dtype, str(device), methods[0], 1, 1, args.new_tokens, args.threads,
                profile=args.profile)
    # On a GPU the peak is reset per measurement; on a CPU only a fresh process gives a clean peak RSS.
    # Timings come from this process, every method of a repeat back to back: this machine's speed drifts by up
    # to 2x between fresh processes, so only neighbouring runs in one process compare.
    isolate_memory = device.type == "cpu" and not args.quick and not args.in_process
    model, pad = load(base)
    max_positions = model.config.get_text_config().max_position_embeddings
    env = environment(device)
    model_name = f"random {config}" if config else (args.model or "SmolLM2-135M-Instruct")
    rows = []
    stem = args.name or device_stem("generate", env, device) + ("_quick" if args.quick else "")
    cells = grid(args, device, max_positions)
    for repeat in range(args.repeats):
        for (length, batch), mode in ((cell, mode) for cell in cells for mode in args.modes):
            rotated = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
            for method in rotated:
                if not applies(method, mode, batch):
                    continue
                spec = dataclasses.replace(base, method=method, batch=batch, prompt_len=length, mode=mode)
                # In one process the eager way needs its own attention implementation.
                model.set_attn_implementation("eager" if method in EAGER_METHODS else
                                              "flash_attention_2" if method == "plain-fa2" else "sdpa")
                try:
                    result = measure(spec, model, pad)
                except Exception as error:  # noqa: BLE001 - a cell's failure is its row; the other cells still run
                    result = {"status": f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"}
                if isolate_memory and result["status"] == "ok":
                    result.update(_fresh_process_memory(spec))
                row = {**env, "loadavg": os.getloadavg()[0], "model": model_name, "dtype": dtype, "mode": mode,
                       "method": method, "batch": batch, "prompt_len": length, "new_tokens": args.new_tokens,
                       "repeat": repeat, "isolated": isolate_memory, **result}
                rows.append({column: row.get(column, "") for column in COLUMNS})
                write_csv(rows, args.out / f"{stem}.csv", COLUMNS)  # as it goes: a long run keeps what it measured
                shown = result["status"] if result["status"] != "ok" else (
                    f"{result['prefill_tok_s']:9.1f} prefill tok/s {result['decode_tok_s']:8.2f} decode tok/s "
                    f"{result['peak_mem_bytes'] / 2**30:6.2f} GiB")
                print(f"repeat {repeat} N={length:6d} B={batch} {mode:13s} {method:18s} {shown}", flush=True)
    return write_summary(rows, args.out, stem)


def write_summary(rows: list[dict], out: Path, stem: str) -> int:
    summary = summarise(rows)
    if summary:
        write_csv(summary, out / f"{stem}_summary.csv", SUMMARY_COLUMNS)
        plot(summary, out / f"{stem}.png")
        print_summary(summary)
    print(f"wrote {out / stem}.csv, {stem}_summary.csv and {stem}.png")
    return 0


def summarise_csv(path: Path) -> int:
    """The summary, table and plot of a run's CSV (one that was stopped midway too)."""
    types = {field: float for _, field in RATIOS} | dict.fromkeys(("batch", "prompt_len", "new_tokens", "repeat"), int)
    with open(path, newline="") as handle:
        rows = [{key: types[key](value) if key in types and value != "" else value for key, value in row.items()}
                for row in csv.DictReader(handle)]
    return write_summary(rows, path.parent, path.stem)


SUMMARY_TABLE = (  # (header, summary column, format) of the printed table
    ("N", "prompt_len", "{}"), ("B", "batch", "{}"), ("mode", "mode", "{}"), ("method", "method", "{}"),
    ("prefill tok/s", "prefill_tok_s", "{:.1f}"), ("decode tok/s", "decode_tok_s", "{:.2f}"),
    ("e2e tok/s", "e2e_tok_s", "{:.3f}"), ("peak GiB", "peak_mem_bytes", "{:.2f}"),
    ("decode vs plain", "decode_vs_plain", "{}"), ("decode (CPU) vs plain", "decode_cpu_vs_plain", "{}"),
    ("paired", "decode_cpu_vs_plain_paired", "{}"),
    ("mem vs plain", "mem_vs_plain", "{}"), ("profiled ms/token", "profiled_ms_per_token", "{}"),
    ("profiled vs plain", "profiled_vs_plain", "{}"), ("e2e vs OA", "e2e_vs_output_attentions", "{}"),
    ("mem vs OA", "mem_vs_output_attentions", "{}"), ("e2e vs OA rerun", "e2e_vs_output_attentions_rerun", "{}"),
    ("mem vs OA rerun", "mem_vs_output_attentions_rerun", "{}"),
)


def print_summary(summary: list[dict]) -> None:
    """The summary as a markdown table (what docs/performance.md quotes)."""
    print("| " + " | ".join(header for header, _, _ in SUMMARY_TABLE) + " |")
    print("|" + "|".join("---" if column in ("mode", "method") else "---:" for _, column, _ in SUMMARY_TABLE) + "|")
    for r in summary:
        cells = [fmt.format(r[column] / 2**30 if column == "peak_mem_bytes" else r[column])
                 for _, column, fmt in SUMMARY_TABLE]
        print("| " + " | ".join(cells) + " |")


def add_arguments(parser: argparse.ArgumentParser, default_out: Path = Path(".")) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="seconds: a tiny random model (unless --model/--config), two short prompts, in one "
                             "process")
    parser.add_argument("--model", default=None,
                        help="transformers model id or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--config", default=None,
                        help=f"random-initialised model of this shape: {', '.join(ARCHITECTURES)} or a config.json "
                             "path")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help=f"prompt lengths (default CPU {CPU_LENGTHS}, GPU {GPU_LENGTHS}, --config "
                             f"{CONFIG_LENGTHS})")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help=f"batch sizes (default {BATCHES})")
    parser.add_argument("--methods", nargs="+", default=None, help="subset of the methods (default: all available)")
    parser.add_argument("--modes", nargs="+", default=None,
                        help=f"generation modes, space- or comma-separated: {', '.join(MODES)} (default greedy; "
                             f"--config: {' '.join(CONFIG_MODES)}; --quick: all)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per generate (default 64; --quick 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared machine 1 avoids OpenMP spin contention)")
    parser.add_argument("--profile", action="store_true",
                        help="run each measurement once more under torch.profiler: GPU kernel time (CPU: op time) per "
                             "token, prefill included")
    parser.add_argument("--in-process", action="store_true",
                        help="on CPU, measure peak memory in this process too (faster; peak RSS then carries earlier "
                             "runs' heap)")
    where = "the working directory" if default_out == Path(".") else default_out
    parser.add_argument("--out", type=Path, default=default_out, help=f"results folder (default: {where})")
    parser.add_argument("--name", default=None,
                        help="file stem (default generate_cpu / generate_<gpu>; --vllm: vllm_cpu_throughput)")
    parser.add_argument("--summarise", type=Path, default=None, metavar="CSV",
                        help="only summarise this run's CSV (e.g. of a run stopped midway) into _summary.csv and .png")


def finish_args(args) -> argparse.Namespace:
    if args.new_tokens is None:
        args.new_tokens = 4 if args.quick else 64
    if args.quick:
        args.repeats = min(args.repeats, 1)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (prefill and decode are timed apart)")
    if args.modes is None:
        args.modes = list(MODES) if args.quick else list(CONFIG_MODES) if args.config else [GREEDY]
    else:
        args.modes = [mode for value in args.modes for mode in value.split(",") if mode]
    if not args.modes or set(args.modes) - set(MODES):
        raise SystemExit(f"--modes {' '.join(args.modes)}: choose from {', '.join(MODES)}")
    return args


def run_command(args: argparse.Namespace) -> int:
    return run(finish_args(args))


def main(argv=None, default_out: Path = Path(".")) -> int:
    """The benchmark as a program (benchmarks/bench_generate.py passes its results folder as default_out)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, default_out)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(Spec(**json.loads(args.worker)))), flush=True)
        return 0
    return run(finish_args(args))


if __name__ == "__main__":
    sys.exit(main())
