"""Generation throughput and peak memory: plain generate vs MACS vs the eager output_attentions way.

    python benchmarks/bench_generate.py --quick                 # seconds (what CI runs)
    python benchmarks/bench_generate.py --threads 1 --repeats 3 # the CPU grid, default model
    python benchmarks/bench_generate.py --config Llama-3.1-8B   # on a GPU: random weights, real shape
Same as `macs-kernels bench` (the logic lives in macs_kernels/apps/bench/generate.py), except that results go to
this checkout's benchmarks/results unless --out says otherwise: generate_<device>.csv (every repeat),
_summary.csv (medians, ratios) and .png.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.bench.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=ROOT / "benchmarks" / "results"))
