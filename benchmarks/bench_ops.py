"""Time macs_update and the fused decode_attention against the bytes they must move; CSV + PNG, no asserts.

    python benchmarks/bench_ops.py            # full grid (on CPU: S <= 4k, the torch provider only)
    python benchmarks/bench_ops.py --quick    # a few seconds
    python benchmarks/bench_ops.py --host-only   # the eager host cost per public call only
Writes benchmarks/results/ops_<device>.csv and .png, and ops_<device>_host.csv: the eager host cost of one public
op call (host_us: the public op's time per call less its kernel's, on a tiny problem),
ops_<device>_host_profile.txt: where that call's host time goes, by Python function, and ops_<device>_host_events.csv:
below Python, by torch.profiler event (the operator, allocations, CUDA runtime calls) (or under --out).

Bytes that must move: K once for macs_update, K and V once for decode_attention (q, log_c and the
outputs are under 1% of that). GB/s = those bytes / time, whatever a provider actually reads:
torch's flash kernel and flash-attn compute attention only (no MACS) and are the floor to compare the
fused decode with; torch's flash kernel has no GQA, so it reads K/V repeated to H heads.
All providers attend keys [0, S) with the last 16 keys as generated tokens (N = S - 16 inputs).
On GPU: triton.testing.do_bench, and for B = 1 also one replay of a captured CUDA graph. The cuda backend runs the
split kernel its shape chooses (ops/cuda/__init__.py; bf16 at D 64 and 128: the tensor-core one); torch's
scaled_dot_product_attention with enable_gqa is the anchor (torch-sdpa-gqa, column vs_sdpa = time over its time).
triton-pdl, cuda-pdl: those backends with their combine and head pooling launched as programmatic dependents (sm_90+).
    python benchmarks/bench_ops.py --shapes issue   # issue 43's shapes, graph replay at every batch, ratio table
    python benchmarks/bench_ops.py --shapes issue48 --graph-only   # issue 48's table as JSON lines (ratios)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels import ops  # noqa: E402
from macs_kernels.apps.bench import device_stem, environment, write_csv  # noqa: E402
from macs_kernels.ops.registry import implementation, why_unavailable  # noqa: E402

OPS = ("macs_update", "decode_attention")
SDPA = "torch-sdpa-gqa"  # the provider every row's time is compared with (column vs_sdpa)
GENERATED = 16


@dataclasses.dataclass
class Problem:
    batch: int
    heads: int
    kv_heads: int
    dim: int
    keys: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self):
        make = dict(device=self.device, dtype=self.dtype)
        self.q = torch.randn(self.batch, self.heads, self.dim, **make)
        self.k = torch.randn(self.batch, self.kv_heads, self.keys, self.dim, **make)
        self.v = torch.randn(self.batch, self.kv_heads, self.keys, self.dim, **make)
        index = lambda value: torch.full((self.batch,), value, device=self.device, dtype=torch.long)  # noqa: E731
        self.start, self.kv_len = index(0), index(self.keys)
        self.input_end = index(max(1, self.keys - GENERATED))
        self.log_c = torch.zeros(self.batch, int(self.input_end[0]), device=self.device)
        self.scale = self.dim ** -0.5

    def bytes(self, op: str) -> int:
        cache = self.k.numel() * self.k.element_size()
        return cache if op == "macs_update" else 2 * cache


# --- providers: each builds, for one (op, problem), a no-argument callable that runs the op once ---------

def backend_call(backend: str, fused: bool = True):
    """A macs_kernels backend, called with validated arguments as the tracer does (no host sync); decode_attention's
    `pooled` is given too (it has no default, see docs/backends.md "Ops: each declared once")."""
    def build(op: str, p: Problem):
        function = implementation(backend, op)
        macs = dict(alpha=0.8, pooling="max", redistribute=True)
        if op == "macs_update":
            return lambda: function(p.q, p.k, p.log_c, input_start=p.start, input_end=p.input_end,
                                    kv_len=p.kv_len, scale=p.scale, lse=None, **macs)
        return lambda: function(p.q, p.k, p.v, kv_start=p.start, kv_len=p.kv_len, scale=p.scale,
                                log_c=p.log_c if fused else None, input_end=p.input_end if fused else None,
                                pooled=None, **macs)
    return build


def torch_sdpa_gqa_call(op: str, p: Problem):
    """torch's own GQA decode attention (the issue's anchor): K/V read once per KV head, whatever kernel it picks."""
    q = p.q[:, :, None]
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, p.k, p.v, scale=p.scale, enable_gqa=True)


def torch_flash_call(op: str, p: Problem):
    group = p.heads // p.kv_heads
    k, v = (x.repeat_interleave(group, dim=1) for x in (p.k, p.v))
    q = p.q[:, :, None]
    return lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=p.scale)[:2]


def flash_attn_call(op: str, p: Problem):
    from flash_attn import flash_attn_with_kvcache

    k, v = (x.transpose(1, 2).contiguous() for x in (p.k, p.v))  # flash-attn keeps caches (B, S, H_kv, D)
    q = p.q[:, None]
    lengths = p.kv_len.to(torch.int32)
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, softmax_scale=p.scale,
                                           return_softmax_lse=True)


def backend_ready(backend: str):
    return lambda device: why_unavailable(backend, device)


def gpu_with(module: str | None = None):
    def reason(device):
        if device.type != "cuda":
            return "needs a GPU"
        if module is not None and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        return None
    return reason


def dependent_unavailable(backend: str):
    """Why `backend`'s dependent launches cannot run on a device (None: they can)."""
    def reason(device: torch.device) -> str | None:
        why = gpu_with()(device) or why_unavailable(backend, device)
        if why is None and torch.cuda.get_device_capability(device)[0] < 9:
            why = "programmatic dependent launches need sm_90 or later"
        return why
    return reason


# Where each backend's switch of dependent launches lives.
DEPENDENT_LAUNCHES = {"triton": "macs_kernels.ops.triton.common", "cuda": "macs_kernels.ops.cuda"}


def dependent(backend: str, build):
    """A provider whose calls (and their graph captures) launch `backend`'s combine and head pooling as programmatic
    dependents (ops/triton/common.py and ops/cuda: dependent_launches). Setting and restoring the switch around each
    call adds to an eager call's host time (two foreign calls for cuda), not to a graph's replay."""
    def build_dependent(op: str, p: Problem):
        launches = importlib.import_module(DEPENDENT_LAUNCHES[backend]).dependent_launches
        fn = build(op, p)

        def call():
            with launches():
                return fn()
        return call
    return build_dependent


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    ops: tuple[str, ...]
    unavailable: Callable[[torch.device], str | None]
    build: Callable[[str, Problem], Callable[[], object]]


PROVIDERS = (
    Provider("torch", OPS, backend_ready("torch"), backend_call("torch")),
    Provider("triton", OPS, lambda d: gpu_with()(d) or why_unavailable("triton", d), backend_call("triton")),
    Provider("triton-attention-only", ("decode_attention",),
             lambda d: gpu_with()(d) or why_unavailable("triton", d), backend_call("triton", fused=False)),
    Provider("cuda", OPS, lambda d: gpu_with()(d) or why_unavailable("cuda", d), backend_call("cuda")),
    Provider("cuda-attention-only", ("decode_attention",), lambda d: gpu_with()(d) or why_unavailable("cuda", d),
             backend_call("cuda", fused=False)),
    # The same with the combine and the pooling launched as programmatic dependents (MACS_KERNELS_TRITON_PDL=1,
    # MACS_KERNELS_CUDA_PDL=1).
    *(Provider(f"{backend}-pdl{suffix}", ops, dependent_unavailable(backend),
               dependent(backend, backend_call(backend, fused=not suffix)))
      for backend in ("triton", "cuda") for suffix, ops in (("", OPS), ("-attention-only", ("decode_attention",)))),
    # The public op (argument checks with the device default, index arguments, backend choice) around the backend's
    # kernels (the provider without -public): issue 48's goal is <= 1.05x (or 2 us) of them inside a graph.
    Provider("triton-public", OPS, lambda d: gpu_with()(d) or why_unavailable("triton", d),
             lambda op, p: public_call("triton")(op, p)),
    Provider("cuda-public", OPS, lambda d: gpu_with()(d) or why_unavailable("cuda", d),
             lambda op, p: public_call("cuda")(op, p)),
    Provider(SDPA, ("decode_attention",), gpu_with(), torch_sdpa_gqa_call),
    Provider("torch-flash", ("decode_attention",), gpu_with(), torch_flash_call),
    Provider("flash-attn", ("decode_attention",), gpu_with("flash_attn"), flash_attn_call),
)


# --- timing ---------------------------------------------------------------------------------------------

def time_cpu(fn) -> float:
    fn()
    times = []
    begin = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - begin < 0.3 and len(times) < 50):
        tick = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tick)
    return statistics.median(times) * 1e3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_gpu(fn, graphed: bool) -> float:
    import triton.testing

    if graphed:
        return triton.testing.do_bench_cudagraph(fn)
    return triton.testing.do_bench(fn)


def grid(quick: bool, device: torch.device, shapes: str = "sweep"):
    if shapes == "issue48":
        # Issue 48's table: bf16, 32 query / 8 KV heads; (B, keys, D).
        return [(b, 32, 8, d, s) for b, s, d in
                ((1, 4096, 128), (1, 32768, 128), (1, 131072, 128), (8, 32768, 128), (1, 32768, 64))]
    if shapes == "issue":
        # Issue 43's shapes: >= 32k keys at batch 1 and 8, D 64 and 128, GQA 4:1 and 3:1; 4k keys at batch 1.
        return [(b, h, hkv, d, s) for b, (h, hkv), d, s in
                itertools.product((1, 8), ((32, 8), (24, 8)), (64, 128), (4096, 32768)) if s >= 32768 or b == 1]
    if quick:
        return [(1, 32, 8, 128, 1024), (1, 9, 3, 64, 4096)]
    keys = (1024, 4096) if device.type == "cpu" else (1024, 4096, 16384, 65536)
    return [(b, h, hkv, d, s) for b, (h, hkv), d, s in
            itertools.product((1, 8), ((32, 8), (9, 3)), (64, 128), keys)]


def _config(row) -> tuple:
    return row["B"], row["H"], row["H_kv"], row["D"], row["S"], row["mode"]


def add_sdpa_ratio(rows) -> None:
    """vs_sdpa: a row's time over torch sdpa's GQA decode on the same shape and timing mode (empty without it)."""
    sdpa = {_config(r): r["ms"] for r in rows if r["provider"] == SDPA}
    for row in rows:
        reference = sdpa.get(_config(row))
        row["vs_sdpa"] = round(row["ms"] / reference, 3) if reference else ""


def print_json_lines(rows) -> None:
    """decode_attention under graph replay, one JSON line per shape and provider: us per call, TB/s of K+V, time
    over sdpa's and, for a fused provider, over its own attention-only call (issue 48's goals: <= 1.10); for a
    public op, its time over its kernel's and the microseconds it adds (goal: <= 1.05x or 2 us); for a -pdl provider,
    its time over the same provider's with plain launches (below 1: dependent launches help)."""
    chosen = [r for r in rows if r["op"] == "decode_attention" and r["mode"] == "cudagraph"]
    attention = {(_config(r), r["provider"].removesuffix("-attention-only")): r["ms"] for r in chosen
                 if r["provider"].endswith("-attention-only")}
    kernels = {(_config(r), r["provider"]): r["ms"] for r in chosen}
    for row in chosen:
        line = {"B": row["B"], "S": row["S"], "D": row["D"], "H": row["H"], "H_kv": row["H_kv"],
                "provider": row["provider"], "us": round(1e3 * row["ms"], 2), "TB_s": round(row["GB_s"] / 1e3, 3),
                "vs_sdpa": row["vs_sdpa"]}
        own = attention.get((_config(row), row["provider"]))
        if own and not row["provider"].endswith("-attention-only"):
            line["fused_vs_attention"] = round(row["ms"] / own, 3)
        kernel = kernels.get((_config(row), row["provider"].removesuffix("-public")))
        if kernel and row["provider"].endswith("-public"):
            line["public_vs_kernel"] = round(row["ms"] / kernel, 3)
            line["public_extra_us"] = round(1e3 * (row["ms"] - kernel), 2)
        plain = kernels.get((_config(row), row["provider"].replace("-pdl", "")))
        if plain and "-pdl" in row["provider"]:
            line["pdl_vs_plain"] = round(row["ms"] / plain, 3)
        print(json.dumps(line), flush=True)


def available_providers(device: torch.device, names=None) -> list[Provider]:
    """The providers (those named in `names`, or all) that can run on `device`; each other one is named with why."""
    providers = []
    for provider in (p for p in PROVIDERS if names is None or p.name in names):
        reason = provider.unavailable(device)
        if reason:
            print(f"skipping {provider.name}: {reason}", flush=True)
        else:
            providers.append(provider)
    return providers


# The providers whose kernels kernel_times breaks down: each fused pass beside its attention alone, and sdpa.
BROKEN_DOWN = ("triton", "triton-attention-only", "cuda", "cuda-attention-only", SDPA)


def kernel_times(provider: Provider, op: str, problem: Problem, device: torch.device, calls: int = 20) -> list[dict]:
    """The provider's time per call by kernel: torch.profiler over `calls` eager calls after a warm-up, each kernel's
    own device time (its CPU time on a CPU, where the "kernels" are aten ops) over the calls, and how many launches of
    it a call makes. Where a fused pass's time over its attention goes (issue 48: at batch 8 every fused pass took
    50-114 us over its attention on an H200, at batch 1 7-30)."""
    from torch.profiler import ProfilerActivity, profile

    fn = provider.build(op, problem)
    fn()
    synchronize(device)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        for _ in range(calls):
            fn()
        synchronize(device)
    rows = []
    for event in profiler.key_averages():
        own = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if own > 0:
            rows.append({"provider": provider.name, "op": op, "B": problem.batch, "H": problem.heads,
                         "H_kv": problem.kv_heads, "D": problem.dim, "S": problem.keys, "kernel": event.key,
                         "launches": round(event.count / calls, 2), "us": round(own / calls, 2)})
    return rows


def print_ratio_table(rows) -> None:
    """decode_attention per shape: sdpa's microseconds, then each provider's time over sdpa's (graph replay)."""
    chosen = [r for r in rows if r["op"] == "decode_attention" and r["mode"] == "cudagraph"]
    providers = sorted({r["provider"] for r in chosen} - {SDPA})
    print("decode_attention, CUDA-graph replay: sdpa us, then time / sdpa's")
    print("B  H/H_kv  D    S      sdpa_us  " + "  ".join(providers))
    for config in sorted({_config(r) for r in chosen}):
        by_provider = {r["provider"]: r for r in chosen if _config(r) == config}
        if SDPA not in by_provider:
            continue
        ratios = "  ".join(f"{by_provider[p]['vs_sdpa']!s:>{len(p)}}" if p in by_provider else " " * len(p)
                           for p in providers)
        print(f"{config[0]:<2} {config[1]}/{config[2]:<4} {config[3]:<4} {config[4]:<6} "
              f"{1e3 * by_provider[SDPA]['ms']:8.1f}  {ratios}")


# --- eager host cost of a public op call (issue 42) --------------------------------------------------------------

def public_call(backend: str):
    """The public op (argument checks, backend choice, then the kernel), with the arguments backend_call gives."""
    def build(op: str, p: Problem):
        if op == "macs_update":
            return lambda: ops.macs_update(p.q, p.k, p.log_c, input_start=p.start, input_end=p.input_end,
                                           kv_len=p.kv_len, scale=p.scale, backend=backend)
        return lambda: ops.decode_attention(p.q, p.k, p.v, kv_start=p.start, kv_len=p.kv_len, scale=p.scale,
                                            log_c=p.log_c, input_end=p.input_end, backend=backend)
    return build


def time_calls(fn, device: torch.device, calls: int = 200) -> float:
    """Microseconds per call of `calls` back-to-back calls, the best of five runs. On a GPU the calls queue
    without waiting, so on kernels this small it is the host's time per call."""
    fn()
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        tick = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - tick) / calls)
    return best * 1e6


def host_problem(device: torch.device, dtype: torch.dtype) -> Problem:
    """The tiny problem (B=1, H=2/1, D=64, S=64) whose public calls the host cost is read on: its kernels take a few
    microseconds of GPU time, so eager calls queue as fast as the host issues them."""
    return Problem(1, 2, 1, 64, 64, dtype, device)


def host_cost_backends(device: torch.device) -> list[str]:
    """The backends whose eager host cost is measured on `device`: torch on a CPU; torch, triton and cuda where they
    run on a GPU."""
    names = ("torch",) if device.type == "cpu" else ("torch", "triton", "cuda")
    return [backend for backend in names if why_unavailable(backend, device) is None]


def host_costs(device: torch.device, dtype: torch.dtype, env: dict) -> list[dict]:
    """Per backend and op, on a tiny problem (B=1, H=2/1, D=64, S=64): the public op's time per call, its
    resolved kernel's called directly with validated arguments, and the difference, host_us: what the public
    op adds per call (argument checks, backend choice; no host sync). Goal on a GPU: <= 20 us."""
    problem = host_problem(device, dtype)
    rows = []
    for backend in host_cost_backends(device):
        for op, (launch, launching) in itertools.product(OPS, launch_paths(backend)):
            with launching():
                public_us = time_calls(public_call(backend)(op, problem), device)
                kernel_us = time_calls(backend_call(backend)(op, problem), device)
            rows.append({**env, "op": op, "backend": backend, "launch": launch, "dtype": str(dtype)[6:],
                         "public_us": round(public_us, 2), "kernel_us": round(kernel_us, 2),
                         "host_us": round(public_us - kernel_us, 2)})
            print(f"{op:17s} {backend:7s} {launch:15s} public {public_us:8.2f} us  kernel {kernel_us:8.2f} us  "
                  f"host cost {public_us - kernel_us:8.2f} us", flush=True)
    return rows


def launch_paths(backend: str) -> tuple[tuple[str, Callable], ...]:
    """(name, context) per way `backend`'s kernels launch: Triton's direct launches (its default) and its JIT's own
    path, the baseline they are compared with (ops/triton/common.py, `launch`); one path for the other backends."""
    if backend != "triton":
        return (("", contextlib.nullcontext),)
    from macs_kernels.ops.triton import common

    return ("direct", contextlib.nullcontext), ("JITFunction.run", common.jit_launches)


def host_profile(device: torch.device, dtype: torch.dtype, path: Path, calls: int = 300) -> None:
    """Where an eager public decode_attention call (with log c, the tiny problem of host_costs) spends its host time,
    per backend: cProfile's functions by their own time, written to `path`, the top few printed. Issue 48's goal is
    <= 30 us a call on cuda and <= 60 on triton; a GPU run measured 47 and 230."""
    import cProfile
    import io
    import pstats

    problem = host_problem(device, dtype)
    report = io.StringIO()
    for backend in host_cost_backends(device):
        call = public_call(backend)("decode_attention", problem)
        call()
        synchronize(device)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        synchronize(device)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        report.write(f"=== {backend}: {calls} public decode_attention calls (with log c)\n{text.getvalue()}\n")
        lines = text.getvalue().splitlines()
        header = next(n for n, line in enumerate(lines) if "ncalls" in line)
        print(f"host profile, {backend}:", *lines[header:header + 9], sep="\n  ")
    path.write_text(report.getvalue())
    print(f"wrote {path}")


def host_events(device: torch.device, dtype: torch.dtype, calls: int = 100) -> list[dict]:
    """Where an eager public decode_attention call (with log c, host_costs' tiny problem) spends its host time below
    Python, per backend: torch.profiler's host-side events (the operator, aten ops such as its allocations, and on a GPU
    the CUDA runtime calls CUPTI reports: kernel launches, function attributes), each with its count per call and its
    own host time per call, the costliest first. The profiler adds time to each event it records: the counts are
    exact, the times are for comparing events with each other. Issue 48: on an H200 an eager cuda call took 47 us of
    host time, 26 with its kernel called directly (three launches), which cProfile (host_profile) sees as one
    builtin."""
    from torch.profiler import ProfilerActivity, profile

    problem = host_problem(device, dtype)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows = []
    for backend in host_cost_backends(device):
        call = public_call(backend)("decode_attention", problem)
        call()
        synchronize(device)
        # No sync inside: its wait for the queued kernels is no host cost of a call.
        with profile(activities=activities) as profiler:
            for _ in range(calls):
                call()
        synchronize(device)
        events = [{"backend": backend, "event": event.key, "per_call": round(event.count / calls, 2),
                   "self_us_per_call": round(event.self_cpu_time_total / calls, 2)}
                  for event in profiler.key_averages()]
        rows += sorted((event for event in events if event["self_us_per_call"] > 0),
                       key=lambda event: -event["self_us_per_call"])
    return rows


def write_host_events(device: torch.device, dtype: torch.dtype, env: dict, path: Path) -> None:
    """host_events into `path`, each backend's costliest few as JSON lines."""
    rows = host_events(device, dtype)
    for backend in dict.fromkeys(row["backend"] for row in rows):
        costliest = [row for row in rows if row["backend"] == backend][:8]
        print(*(json.dumps({"host_event": row}) for row in costliest), sep="\n", flush=True)
    write_csv([{**env, **row} for row in rows], path)
    print(f"wrote {path}")


def plot(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["B"], r["H"], r["H_kv"], r["D"]) for r in rows})
    columns = min(4, len(configs))
    per_op = -(-len(configs) // columns)
    fig, axes = plt.subplots(len(OPS) * per_op, columns, figsize=(3.4 * columns, 2.7 * len(OPS) * per_op),
                             squeeze=False)
    used = set()
    for (i, op), (j, config) in itertools.product(enumerate(OPS), enumerate(configs)):
        used.add((i * per_op + j // columns, j % columns))
        ax = axes[i * per_op + j // columns][j % columns]
        for (provider, mode) in sorted({(r["provider"], r["mode"]) for r in rows if r["op"] == op}):
            points = sorted((r["S"], r["GB_s"]) for r in rows if r["op"] == op and r["provider"] == provider
                            and r["mode"] == mode and (r["B"], r["H"], r["H_kv"], r["D"]) == config)
            if points:
                ax.plot(*zip(*points), marker="o", label=provider if mode == "eager" else f"{provider} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}\nB={config[0]} H={config[1]}/{config[2]} D={config[3]}", fontsize=8)
        ax.set_xlabel("S (keys)", fontsize=8)
        if j % columns == 0:
            ax.set_ylabel("GB/s of required bytes", fontsize=8)
        ax.tick_params(labelsize=7)
    handles = {}
    for (r, c), ax in zip(itertools.product(range(axes.shape[0]), range(columns)), axes.flat):
        if (r, c) not in used:
            ax.remove()
            continue
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small problems, a few seconds")
    parser.add_argument("--graph-only", action="store_true", help="on a GPU, time CUDA-graph replay only")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to time")
    parser.add_argument("--shapes", choices=("sweep", "issue", "issue48"), default="sweep",
                        help="issue: issue 43's decode shapes (32k keys at B 1 and 8, 4k at B 1), every provider, "
                             "CUDA-graph replay at every batch, and a last table of each provider's time over sdpa's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default=None, help="file stem (default ops_cpu / ops_<gpu>)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (on a shared machine, 1 avoids OpenMP spin contention)")
    parser.add_argument("--host-only", action="store_true",
                        help="only the eager host cost per public call (<stem>_host.csv), a few seconds")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also each fused pass's, its attention's and sdpa's time by kernel (torch.profiler, "
                             "<stem>_kernels.csv, JSON lines)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    env = environment(device)  # after --threads: the CSV records the count used
    stem = args.name or device_stem("ops", env, device)
    write_csv(host_costs(device, dtype, env), args.out / f"{stem}_host.csv")
    print(f"wrote {args.out / stem}_host.csv")
    host_profile(device, dtype, args.out / f"{stem}_host_profile.txt")
    if not args.host_only:
        write_table(args, device, dtype, env, stem)
    # Last: the profiler's CUPTI, which host_events and kernel_times attach, stays attached once it has run.
    write_host_events(device, dtype, env, args.out / f"{stem}_host_events.csv")


def write_table(args, device: torch.device, dtype: torch.dtype, env: dict, stem: str) -> None:
    """Every available provider timed at every shape of the run: <stem>.csv and .png, the run's ratio table or JSON
    lines, and with --kernel-times each broken-down provider's time by kernel."""
    providers = available_providers(device)
    rows = []
    for batch, heads, kv_heads, dim, keys in grid(args.quick, device, args.shapes):
        problem = Problem(batch, heads, kv_heads, dim, keys, dtype, device)
        for op, provider in itertools.product(args.ops, providers):
            if op not in provider.ops:
                continue
            fn = provider.build(op, problem)
            graphed = device.type == "cuda" and (batch == 1 or args.shapes != "sweep")
            modes = ([] if graphed and args.graph_only else ["eager"]) + (["cudagraph"] if graphed else [])
            for mode in modes:
                ms = time_cpu(fn) if device.type == "cpu" else time_gpu(fn, mode == "cudagraph")
                moved = problem.bytes(op)
                rows.append({**env, "op": op, "provider": provider.name, "mode": mode, "dtype": str(dtype)[6:],
                             "B": batch, "H": heads, "H_kv": kv_heads, "D": dim, "S": keys,
                             "ms": round(ms, 5), "bytes": moved, "GB_s": round(moved / ms / 1e6, 2)})
                print(f"{op:17s} {provider.name:22s} {mode:9s} B={batch} H={heads}/{kv_heads} D={dim} "
                      f"S={keys:6d}  {ms:9.4f} ms  {moved / ms / 1e6:8.1f} GB/s", flush=True)
        del problem
        if device.type == "cuda":
            torch.cuda.empty_cache()

    add_sdpa_ratio(rows)
    write_csv(rows, args.out / f"{stem}.csv")
    plot(rows, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.csv and .png")
    if args.shapes == "issue":
        print_ratio_table(rows)
    if args.shapes == "issue48":
        print_json_lines(rows)
    if args.kernel_times:
        # After every timing and its table: the profiler's CUPTI stays attached once it has run.
        write_kernel_times(providers, args, device, dtype, env, args.out / f"{stem}_kernels.csv")


def write_kernel_times(providers, args, device: torch.device, dtype: torch.dtype, env: dict, path: Path) -> None:
    """kernel_times of the BROKEN_DOWN providers at every shape of the run, as JSON lines and into `path`."""
    rows = []
    for batch, heads, kv_heads, dim, keys in grid(args.quick, device, args.shapes):
        problem = Problem(batch, heads, kv_heads, dim, keys, dtype, device)
        for provider in (p for p in providers if p.name in BROKEN_DOWN):
            for op in (o for o in args.ops if o in provider.ops):
                by_kernel = kernel_times(provider, op, problem, device)
                rows += by_kernel
                print(*(json.dumps({"kernel_us": row}) for row in by_kernel), sep="\n", flush=True)
        del problem
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rows:
        write_csv([{**env, **row} for row in rows], path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
