"""Load on `macs-kernels serve`: 32 concurrent clients on loopback, 64 chat requests in all, with attribution
off and on (same server, same prompts), every answer checked against explain() of its prompt alone.

    python benchmarks/bench_serve.py                 # default model, 64 requests, 32 clients, 16 new tokens,
                                                     # 2 rounds per setting (off, on, on, off)
    python benchmarks/bench_serve.py --requests 8 --clients 4 --max-tokens 4    # a quick look
Writes benchmarks/results/serve_cpu.csv (one row per request), serve_cpu_summary.csv (per setting, over its
rounds) and serve_cpu.png (or under --out).

The server runs in its own process (the continuous-batching engine with the MACS tracer attached, as
`macs-kernels serve` runs it); clients are asyncio tasks with httpx, each sending its requests one after the
other. A request counts as correct when its answer text equals explain()'s for that prompt and, with
attribution, its step_log_c is within 1e-3 of explain()'s. Each phase is bounded by --deadline seconds:
what is not answered by then counts as failed.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QA = [
    ("Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare around 1600. It is set in Denmark."),
    ("What colour is the sky?", "On a clear day the sky is blue because air scatters short wavelengths."),
    ("Where is the Eiffel Tower?", "The Eiffel Tower stands in Paris, France. It was built in 1889 for a fair."),
    ("What do bees make?", "Honey bees collect nectar from flowers and turn it into honey inside the hive."),
    ("How many legs does a spider have?", "Spiders are arachnids, not insects: every spider has eight legs."),
    ("What is the capital of Japan?", "Tokyo has been the capital of Japan since 1868, when the emperor moved there."),
    ("What gas do plants take in?", "Plants take in carbon dioxide from the air and release oxygen in sunlight."),
    ("Who painted the Mona Lisa?", "The Mona Lisa was painted by Leonardo da Vinci in the early sixteenth century."),
]
LOG_C_TOL = 1e-3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, args) -> subprocess.Popen:
    import httpx

    command = [sys.executable, "-m", "macs_kernels.apps.serve", "--port", str(port), "--cache-tokens",
               str(args.cache_tokens)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise TimeoutError("the server did not start within 600 s")


def references(max_tokens: int) -> list:
    from macs_kernels import explain
    from macs_kernels.api.models import load_model
    from macs_kernels.api.prompts import qa_messages

    model, tokenizer = load_model()
    return [explain(model, tokenizer, qa_messages(q, c), max_new_tokens=max_tokens) for q, c in QA]


def check(body: dict, reference, attribution: bool) -> bool:
    import torch

    if body["choices"][0]["message"]["content"] != reference.text:
        return False
    if not attribution:
        return "attribution" not in body["choices"][0]
    rows = body["choices"][0]["attribution"]["step_log_c"]
    log_c = torch.tensor([[float("-inf") if v is None else v for v in row] for row in rows])
    return log_c.shape == reference.step_log_c.shape and bool(
        torch.allclose(log_c, reference.step_log_c, atol=LOG_C_TOL, rtol=0))


async def phase(url: str, model: str, args, refs, attribution: bool) -> tuple[list[dict], float]:
    import httpx

    from macs_kernels.api.prompts import qa_messages

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    records = []

    async def client(http):
        while not queue.empty():
            i = queue.get_nowait()
            question, context = QA[i % len(QA)]
            body = {"model": model, "messages": qa_messages(question, context), "max_tokens": args.max_tokens,
                    "attribution": attribution}
            start = time.perf_counter()
            try:
                response = await http.post(url + "/v1/chat/completions", json=body)
                answer = response.json()
                ok = response.status_code == 200 and check(answer, refs[i % len(QA)], attribution)
                tokens = answer.get("usage", {}).get("completion_tokens", 0)
            except (httpx.HTTPError, ValueError, KeyError):
                ok, tokens = False, 0
            records.append({"attribution": attribution, "request": i, "prompt": i % len(QA),
                            "latency_s": time.perf_counter() - start, "completion_tokens": tokens, "ok": ok})

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.deadline) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(args.clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.deadline)
        for task in pending:
            task.cancel()
    wall = time.perf_counter() - start
    answered = {r["request"] for r in records}
    records += [{"attribution": attribution, "request": i, "prompt": i % len(QA), "latency_s": float("nan"),
                 "completion_tokens": 0, "ok": False} for i in range(args.requests) if i not in answered]
    return records, wall


def summarise(records: list[dict], wall: float, attribution: bool) -> dict:
    latencies = sorted(r["latency_s"] for r in records if r["ok"])
    tokens = sum(r["completion_tokens"] for r in records if r["ok"])

    def quantile(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {
        "attribution": "on" if attribution else "off", "requests": len(records),
        "correct": sum(r["ok"] for r in records), "wall_s": round(wall, 2),
        "requests_per_s": round(len(latencies) / wall, 3), "p50_latency_s": round(statistics.median(latencies), 2)
        if latencies else float("nan"), "p99_latency_s": round(quantile(0.99), 2),
        "tokens_per_s": round(tokens / wall, 2),
    }


def plot(summary: list[dict], records: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    labels = [f"attribution {s['attribution']}" for s in summary]
    axes[0].bar(labels, [s["requests_per_s"] for s in summary], color=["#999", "#c33"])
    axes[0].set_title("requests / s")
    axes[1].bar(labels, [s["tokens_per_s"] for s in summary], color=["#999", "#c33"])
    axes[1].set_title("generated tokens / s")
    latencies = [[r["latency_s"] for r in records if r["ok"] and r["attribution"] == (s["attribution"] == "on")]
                 for s in summary]
    axes[2].boxplot(latencies, tick_labels=labels, whis=(1, 99))
    axes[2].set_title("latency (s), whiskers p1-p99")
    fig.suptitle(f"macs-kernels serve, {args.rounds} x {args.requests} requests per setting from {args.clients} "
                 f"concurrent clients, {args.max_tokens} new tokens each (CPU, default model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="phases per setting, run in ABBA order")
    parser.add_argument("--deadline", type=float, default=1200, help="seconds each phase may take")
    parser.add_argument("--cache-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    from macs_kernels.api.models import DEFAULT_MODEL

    refs = references(args.max_tokens)
    port = free_port()
    server = start_server(port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        records, walls = [], {False: 0.0, True: 0.0}
        # ABBA order over rounds: a drift in the shared machine's load hits both settings alike.
        order = [False, True, True, False] * (args.rounds // 2) + [False, True] * (args.rounds % 2)
        for attribution in order:
            phase_records, wall = asyncio.run(phase(url, DEFAULT_MODEL, args, refs, attribution))
            records += phase_records
            walls[attribution] += wall
            print(json.dumps(summarise(phase_records, wall, attribution)), flush=True)
        summary = [summarise([r for r in records if r["attribution"] == a], walls[a], a) for a in (False, True)]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "serve_cpu.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    with open(args.out / "serve_cpu_summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(summary[0]) + ["clients", "max_tokens", "cpu_threads"])
        writer.writeheader()
        for row in summary:
            writer.writerow(row | {"clients": args.clients, "max_tokens": args.max_tokens,
                                   "cpu_threads": args.threads or os.cpu_count()})
    plot(summary, records, args.out / "serve_cpu.png", args)
    print(f"wrote {args.out / 'serve_cpu.csv'}, serve_cpu_summary.csv and serve_cpu.png")
    return 0 if all(s["correct"] == s["requests"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
