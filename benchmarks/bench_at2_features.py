"""AT2 feature extraction: our per-layer reduction against the authors' dense (L, H, T, N) recomputation.

    python benchmarks/bench_at2_features.py            # N in {512, 2048, 8192}, R = 64, default model's shape
    python benchmarks/bench_at2_features.py --quick    # N = 512, 4 layers: a few seconds
Writes benchmarks/results/at2_features_cpu.csv and .png (or under --out).

Both methods start from the same per-layer tensors: the R = 64 post-RoPE target queries (H, R, D) and the
key cache (H_kv, N + R, D) of the default model's shape (30 layers, 9 heads, 3 KV heads, D = 64), sources
= the first N keys. Neither recomputes the projections (the authors' extractor also runs q_proj, k_proj
and RoPE from saved hidden states; that cost is the same for both and left out).
- ours: ops.attention_features per layer (torch path on CPU) -> (L, H, N) float32;
- dense: per layer, K repeated to H heads, the (H, R, N + R) causal softmax, its source columns written
  into an (L, H, R, N) tensor, reduced over R at the end (what the authors' extractor materialises).
Each (method, N) runs in a fresh subprocess; peak memory is the process's peak RSS above its RSS after
the inputs were built (Linux: /proc/self/clear_refs resets the peak), time the median of the repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(layers=30, heads=9, kv_heads=3, dim=64)
ROWS = 64


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _inputs(layers, heads, kv_heads, dim, n):
    generator = torch.Generator().manual_seed(0)
    queries = [torch.randn(1, heads, ROWS, dim, generator=generator) for _ in range(layers)]
    keys = [torch.randn(1, kv_heads, n + ROWS, dim, generator=generator) for _ in range(layers)]
    return queries, keys


def ours(queries, keys, n):
    from macs_kernels.ops import attention_features

    scale = queries[0].shape[-1] ** -0.5
    return torch.stack([
        attention_features(q, k, source_start=0, source_end=n, kv_len=k.shape[2], scale=scale, backend="torch")[0]
        for q, k in zip(queries, keys)
    ]) / ROWS


def dense(queries, keys, n):
    layers, (_, heads, rows, dim) = len(queries), queries[0].shape
    scale = dim ** -0.5
    attentions = torch.empty(layers, heads, rows, n)
    for layer, (q, k) in enumerate(zip(queries, keys)):
        k = k[0].repeat_interleave(heads // k.shape[1], dim=0)
        scores = q[0] @ k.transpose(-1, -2) * scale
        keys_total = k.shape[1]
        causal = torch.arange(keys_total)[None, :] > (keys_total - rows + torch.arange(rows))[:, None]
        attentions[layer] = scores.masked_fill(causal, float("-inf")).softmax(-1)[..., :n]
    return attentions.mean(dim=2)


def _child(method: str, n: int, layers: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    queries, keys = _inputs(layers, SHAPE["heads"], SHAPE["kv_heads"], SHAPE["dim"], n)
    function = {"ours": ours, "dense": dense}[method]
    function(queries[:1], keys[:1], n)  # warm-up (imports, allocator)
    base = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(queries, keys, n)
        times.append(time.perf_counter() - start)
    peak = _rss_kib("VmHWM")
    return {"method": method, "n": n, "layers": layers, "rows": ROWS, "seconds": statistics.median(times),
            "peak_mib": max(peak - base, 0) / 1024, "checksum": float(result.sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, n, layers, repeats = args.child
        print(json.dumps(_child(method, int(n), int(layers), int(repeats))))
        return 0
    sizes, layers, repeats = ((512,), 4, 1) if args.quick else ((512, 2048, 8192), SHAPE["layers"], 3)
    rows = []
    for n in sizes:
        for method in ("ours", "dense"):
            done = subprocess.run([sys.executable, __file__, "--child", method, str(n), str(layers), str(repeats)],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"N={n:5d} {method:5s} {rows[-1]['seconds']:8.3f} s  peak +{rows[-1]['peak_mib']:8.1f} MiB")
        ours_row, dense_row = rows[-2], rows[-1]
        if abs(ours_row["checksum"] - dense_row["checksum"]) > 1e-3 * abs(dense_row["checksum"]):
            raise SystemExit(f"N={n}: the two methods disagree ({ours_row['checksum']} vs {dense_row['checksum']})")
    from macs_kernels.apps.bench.common import pyplot, save_figure, write_csv

    stem = args.out / ("at2_features_cpu_quick" if args.quick else "at2_features_cpu")
    write_csv(rows, stem.with_suffix(".csv"))
    figure, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    for method, style in (("ours", "o-"), ("dense", "s--")):
        points = [r for r in rows if r["method"] == method]
        label = "ours (attention_features)" if method == "ours" else "dense (L, H, T, N)"
        axes[0].plot([r["n"] for r in points], [r["seconds"] for r in points], style, label=label)
        axes[1].plot([r["n"] for r in points], [r["peak_mib"] for r in points], style, label=label)
    for axis, title in zip(axes, ("time (s)", "peak memory above inputs (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("source tokens N")
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"AT2 features, {layers} layers x {SHAPE['heads']} heads, R = {ROWS}, CPU 1 thread")
    save_figure(figure, stem.with_suffix(".png"), dpi=120)
    print(f"wrote {stem.with_suffix('.csv')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
