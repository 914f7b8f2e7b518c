"""Benchmarks that ship with the package: `macs-kernels bench` (generate.py) and the helpers every benchmark
program shares (common.py)."""
from .common import device_stem, environment, source_commit, write_csv
from .generate import ARCHITECTURES

__all__ = ["ARCHITECTURES", "device_stem", "environment", "source_commit", "write_csv"]
