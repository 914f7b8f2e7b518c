"""Benchmarks that ship with the package: `macs-kernels bench` (generate.py) and the helpers every benchmark
program shares (common.py)."""
from macs_kernels.apps.bench.common import device_stem, environment, source_commit, write_csv
from macs_kernels.apps.bench.generate import ARCHITECTURES

__all__ = ["ARCHITECTURES", "device_stem", "environment", "source_commit", "write_csv"]
