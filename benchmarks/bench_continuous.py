"""Continuous batching with and without MACS: throughput and peak memory of model.generate_batch.

    python benchmarks/bench_continuous.py            # 16 requests, prompts 100-1000 tokens, 32 new tokens, 3 pairs
    python benchmarks/bench_continuous.py --quick    # 4 requests, prompts 50-200 tokens, 8 new tokens, 1 pair
    python benchmarks/bench_continuous.py --requests 16 --prompt-tokens 100 400 --new-tokens 16   # a smaller run
Writes benchmarks/results/continuous_cpu_<requests>x<prompt range>_<new tokens>_threads<T>.csv (every run), _summary.csv
(medians, ratios) and .png (or under --out).

Both modes run the same workload through transformers' continuous batching engine (sdpa, default paged
cache settings except a cache sized for the workload, prefix sharing on): prompts of random token ids
(no shared prefixes) with lengths spread evenly over the range, greedy, end-of-sequence disabled so every
request makes exactly the requested number of tokens. "macs" wraps the call in attach_continuous and reads
every request's rows. Runs alternate between the modes (off, on, on, off, ...), each in a fresh subprocess:
throughput is generated tokens per second of wall time and per second of the process's CPU time (user +
system, all threads: on a machine shared with other work, wall time measures the neighbours; run with
--threads 1 so idle worker threads do not spin), peak memory the process's peak RSS during the call
(Linux: /proc/self/clear_refs resets the peak after the model is loaded). Each run also records the machine's
1-minute load average before and after the call.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def workload(requests: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(shortest, longest, requests).round().long()
    lengths = lengths[torch.randperm(requests, generator=generator)]
    return [torch.randint(100, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def _child(mode: str, requests: int, shortest: int, longest: int, new_tokens: int, threads: int) -> dict:
    from transformers import GenerationConfig

    from macs_kernels.api.models import load_model
    from macs_kernels.engines.continuous import attach_continuous, batching_config_class

    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model()
    prompts = workload(requests, shortest, longest, model.config.vocab_size)
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    page = 256
    blocks = sum(-(-(len(p) + new_tokens) // page) for p in prompts) + 1

    def run():
        config = batching_config_class()(page_size=page, num_blocks=blocks, auto_switch_to_flash=False)
        return model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config)

    base = _rss_kib("VmRSS")
    load_before = os.getloadavg()[0]
    Path("/proc/self/clear_refs").write_text("5")
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode == "macs":
        with attach_continuous(model) as tracer:
            outputs = run()
            steps = [tracer.request_rows(request_id)[0].shape[0] for request_id in outputs]
    else:
        outputs = run()
        steps = [new_tokens] * len(outputs)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _rss_kib("VmHWM")
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    if generated != requests * new_tokens or steps != [new_tokens] * requests:
        raise SystemExit(f"{mode}: {generated} tokens and rows {steps} for {requests} x {new_tokens}")
    return {
        "mode": mode, "requests": requests, "prompt_tokens": sum(map(len, prompts)), "new_tokens": new_tokens,
        "seconds": seconds, "tokens_per_s": generated / seconds, "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": generated / cpu_seconds, "peak_rss_mib": peak / 1024,
        "peak_above_model_mib": max(peak - base, 0) / 1024, "threads": torch.get_num_threads(),
        "load_before": load_before, "load_after": os.getloadavg()[0],
    }


def _summary(rows: list[dict]) -> dict:
    median = {
        mode: {key: statistics.median(r[key] for r in rows if r["mode"] == mode)
               for key in ("seconds", "tokens_per_s", "tokens_per_cpu_s", "peak_rss_mib", "peak_above_model_mib")}
        for mode in ("plain", "macs")
    }
    return {
        "pairs": len(rows) // 2,
        "plain_tokens_per_s": median["plain"]["tokens_per_s"], "macs_tokens_per_s": median["macs"]["tokens_per_s"],
        "throughput_ratio": median["macs"]["tokens_per_s"] / median["plain"]["tokens_per_s"],
        "plain_tokens_per_cpu_s": median["plain"]["tokens_per_cpu_s"],
        "macs_tokens_per_cpu_s": median["macs"]["tokens_per_cpu_s"],
        "cpu_throughput_ratio": median["macs"]["tokens_per_cpu_s"] / median["plain"]["tokens_per_cpu_s"],
        "plain_peak_rss_mib": median["plain"]["peak_rss_mib"], "macs_peak_rss_mib": median["macs"]["peak_rss_mib"],
        "peak_memory_ratio": median["macs"]["peak_rss_mib"] / median["plain"]["peak_rss_mib"],
        "plain_peak_above_model_mib": median["plain"]["peak_above_model_mib"],
        "macs_peak_above_model_mib": median["macs"]["peak_above_model_mib"],
    }


def _plot(rows: list[dict], summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    colours = {"plain": "tab:blue", "macs": "tab:red"}
    for axis, key, label in ((axes[0], "tokens_per_cpu_s", "generated tokens / CPU s"),
                             (axes[1], "peak_rss_mib", "peak RSS (MiB)")):
        axis.bar(range(len(rows)), [r[key] for r in rows], color=[colours[r["mode"]] for r in rows])
        axis.set_xticks(range(len(rows)), [f"{i + 1}\n{r['mode']}" for i, r in enumerate(rows)])
        axis.set_title(label)
    axes[0].set_xlabel(f"run (CPU-time throughput ratio {summary['cpu_throughput_ratio']:.3f}, "
                       f"wall {summary['throughput_ratio']:.3f})")
    axes[1].set_xlabel(f"run (peak memory ratio {summary['peak_memory_ratio']:.3f})")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=None, help="runs per mode (default 3, 1 with --quick)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=None, metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, *sizes = args.child
        print(json.dumps(_child(mode, *map(int, sizes))))
        return 0
    requests, shortest, longest, new_tokens = (4, 50, 200, 8) if args.quick else (16, 100, 1000, 32)
    requests = args.requests or requests
    shortest, longest = args.prompt_tokens or (shortest, longest)
    new_tokens = args.new_tokens or new_tokens
    pairs = args.pairs or (1 if args.quick else 3)
    order = [("plain", "macs") if i % 2 == 0 else ("macs", "plain") for i in range(pairs)]
    rows = []
    for mode in (mode for pair in order for mode in pair):
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode,
             *map(str, (requests, shortest, longest, new_tokens, args.threads))],
            capture_output=True, text=True, check=False,
        )
        if done.returncode:
            raise SystemExit(f"{mode} run failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = rows[-1]
        print(f"{mode:5s} {row['seconds']:8.1f} s {row['tokens_per_s']:7.2f} tok/s "
              f"{row['tokens_per_cpu_s']:7.2f} tok/CPU s "
              f"peak {row['peak_rss_mib']:8.1f} MiB "
              f"(+{row['peak_above_model_mib']:.1f} above the loaded model) "
              f"load {row['load_before']:.2f} -> {row['load_after']:.2f}", flush=True)
    summary = _summary(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"continuous_cpu_{requests}x{shortest}-{longest}_{new_tokens}_threads{rows[0]['threads']}"
    for path, table in ((stem.with_suffix(".csv"), rows), (Path(f"{stem}_summary.csv"), [summary])):
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    _plot(rows, summary, stem.with_suffix(".png"),
          f"generate_batch, {requests} requests, prompts {shortest}-{longest} tokens, {new_tokens} new tokens, "
          f"CPU {rows[0]['threads']} threads")
    print(json.dumps(summary, indent=1))
    print(f"wrote {stem}.csv, {stem}_summary.csv and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
