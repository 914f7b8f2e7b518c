"""The host cost of a public op's index-value checks, before and after issue 48; JSON, no asserts.

    python benchmarks/bench_checks.py    # writes benchmarks/results/checks_<device>.json (or --out)

Device index tensors are simulated on a CPU machine: `_checks.on_host` is patched to say the values are not on
the host, and the rule checked is the one a GPU call takes. Per mode, the mean host time of one decode_attention
range check (B = 8) and the aten ops it issues (each one is at least a kernel launch on a GPU):
- `device_assert_before`: the pre-issue-48 device path (the rule as tensor ops, then torch._assert_async), run
  on CPU tensors: what every eager GPU call used to pay in launches;
- `device_default`: validate=None with device values: no value check;
- `host`: CPU values read on the host (every CPU call, before and after);
- `device_validate`: validate=True with device values: one copy to the host, then the host check.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels.apps.bench import environment  # noqa: E402
from macs_kernels.ops import _checks  # noqa: E402

BATCH, KEYS, N_MAX = 8, 4096, 4080


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _before(start, end, length):
    valid = _checks._in_range(start, end, length, KEYS, N_MAX)
    torch._assert_async(valid.all(), "every row needs ...")


def _modes(start, end, length):
    return {
        "device_assert_before": (False, lambda: _before(start, end, length)),
        "device_default": (False, lambda: _checks.check_ranges(start, end, length, KEYS, N_MAX)),
        "host": (True, lambda: _checks.check_ranges(start, end, length, KEYS, N_MAX)),
        "device_validate": (False, lambda: _checks.check_ranges(start, end, length, KEYS, N_MAX, validate=True)),
    }


def measure(repeats: int) -> list[dict]:
    start = torch.zeros(BATCH, dtype=torch.int64)
    end = torch.full((BATCH,), 4000, dtype=torch.int64)
    length = torch.full((BATCH,), 4096, dtype=torch.int64)
    rows = []
    for mode, (host, call) in _modes(start, end, length).items():
        with mock.patch.object(_checks, "on_host", lambda *tensors, host=host: host):
            with _Count() as counted:
                call()
            for _ in range(repeats // 10):
                call()
            began = time.perf_counter()
            for _ in range(repeats):
                call()
            elapsed = time.perf_counter() - began
        rows.append({"mode": mode, "host_us_per_call": round(elapsed / repeats * 1e6, 2),
                     "aten_ops_per_call": counted.count})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checks_cpu.json")
    args = parser.parse_args()
    rows = measure(args.repeats)
    for row in rows:
        print(json.dumps(row))
    args.out.write_text(json.dumps({"environment": environment("cpu"), "batch": BATCH, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
