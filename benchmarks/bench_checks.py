"""The host cost of a public op call on top of its kernel (issue 48); JSON lines, no asserts.

    python benchmarks/bench_checks.py    # writes benchmarks/results/checks_<device>.json (or --out)

Device index tensors are simulated on a CPU machine: `_checks.on_host` is patched to say the values are not on
the host, and the rule checked is the one a GPU call takes. Three tables:
- `rows`, the index-value checks: per mode, the mean host time of one decode_attention range check (B = 8) and the
  aten ops it issues (each one is at least a kernel launch on a GPU):
  `device_assert_before`: the pre-issue-48 device path (the rule as tensor ops, then torch._assert_async), run on
  CPU tensors: what every eager GPU call used to pay in launches; `device_default`: validate=None with device
  values: no value check; `host`: CPU values read on the host (every CPU call, before and after);
  `device_validate`: validate=True with device values: one copy to the host, then the host check;
- `calls`: a whole public call with its kernel replaced by a no-op (what the op adds: checks, index arguments,
  backend choice), device defaults, int32 and int64 ranges: host time and the aten ops other than views; per backend
  (the default choice, and the cuda backend where MACS_KERNELS_CUDA_EMULATION=1 runs it here);
- `dispatch`: one call of the `torch.ops.macs_kernels` operator (how the cuda backend's kernels are reached) less
  a direct call of its kernel (here the torch function, stubbed to return at once): the dispatcher's cost.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macs_kernels import ops  # noqa: E402
from macs_kernels.apps.bench.aten import AtenOps  # noqa: E402
from macs_kernels.apps.bench.common import environment  # noqa: E402
from macs_kernels.ops import _checks, registry  # noqa: E402
from macs_kernels.ops.library import define_operator  # noqa: E402

BATCH, KEYS, N_MAX = 8, 4096, 4080



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
            with AtenOps() as counted:
                call()
            for _ in range(repeats // 10):
                call()
            began = time.perf_counter()
            for _ in range(repeats):
                call()
            elapsed = time.perf_counter() - began
        rows.append({"mode": mode, "host_us_per_call": round(elapsed / repeats * 1e6, 2),
                     "aten_ops_per_call": len(counted.ops)})
    return rows


def _per_call_us(call, repeats: int) -> float:
    for _ in range(repeats // 10):
        call()
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) / repeats * 1e6


def _public_calls(dtype, backend=None):
    """name -> a public call at a decode step's shape (B = 8, GQA 4:1, D = 128, 4,096 keys) with `dtype` ranges, on
    `backend` (None: the default choice)."""
    q, k, v = torch.randn(BATCH, 32, 128), torch.randn(BATCH, 8, KEYS, 128), torch.randn(BATCH, 8, KEYS, 128)
    start, end, length = (torch.full((BATCH,), value, dtype=dtype) for value in (0, 4000, KEYS))
    state = torch.zeros(BATCH, N_MAX)
    ranges = dict(input_start=start, input_end=end, kv_len=length, scale=0.1, backend=backend)
    return {
        "decode_attention": lambda: ops.decode_attention(q, k, v, kv_len=length, scale=0.1, backend=backend),
        "decode_attention_fused": lambda: ops.decode_attention(q, k, v, kv_start=start, kv_len=length, input_end=end,
                                                               log_c=state, scale=0.1, backend=backend),
        "macs_pool": lambda: ops.macs_pool(q, k, out=state, **ranges),
        "macs_update": lambda: ops.macs_update(q, k, state, **ranges),
    }


def _registered_per_call(op: str, key: str) -> bool:
    """registry._registered before it kept what it found: the dispatcher asked on every call."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{registry.NAMESPACE}::{op}", key)


def _stubbed_kernels():
    return mock.patch.object(registry, "implementation", lambda backend, op: lambda *args, **kwargs: None)


@contextlib.contextmanager
def _stubbed_kernels_asking_per_call():
    with _stubbed_kernels(), mock.patch.object(registry, "_registered", _registered_per_call):
        yield


@contextlib.contextmanager
def _kernels_not_run():
    from macs_kernels.ops.cuda import emulation

    emulation.set_execute(False)
    try:
        yield
    finally:
        emulation.set_execute(True)


def measure_calls(repeats: int) -> list[dict]:
    """Per backend that runs here, with the kernel a no-op ("wrapper": the public op's checks, index arguments and
    backend choice). The cuda backend runs here on its CPU emulation (MACS_KERNELS_CUDA_EMULATION=1), on the host path
    a GPU call takes: also with the registry asking the dispatcher for the op's kernel on every call, as before (side
    by side in this run), and whole through the operator and its launcher with the kernels checked and logged but
    not run ("to the launch": what an eager GPU call costs on the host besides the driver's launches)."""
    named = [backend for backend in ("cuda", "triton") if registry.why_unavailable(backend, "cpu") is None]
    settings = [(None, "wrapper", _stubbed_kernels), *((backend, "wrapper", _stubbed_kernels) for backend in named)]
    if "cuda" in named:
        settings += [
            ("cuda", "wrapper, registration asked per call (before)", _stubbed_kernels_asking_per_call),
            ("cuda", "to the launch", _kernels_not_run),
        ]
    rows = []
    with mock.patch.object(_checks, "on_host", lambda *tensors: False):
        for backend, path, setting in settings:
            with setting():
                for dtype in (torch.int32, torch.int64):
                    for op, call in _public_calls(dtype, backend).items():
                        call()
                        with AtenOps() as counted:
                            call()
                        host_us = round(_per_call_us(call, repeats), 2)
                        rows.append({"call": op, "backend": str(backend), "path": path, "ranges": str(dtype)[6:],
                                     "host_us_per_call": host_us, "aten_ops_per_call": len(counted.launches)})
    return rows


def bench_macs_pool_noop(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, input_start: torch.Tensor,
                         input_end: torch.Tensor, kv_len: torch.Tensor, scale: float, pooling: str,
                         redistribute: bool, lse: torch.Tensor | None, score_start: torch.Tensor | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """macs_pool's operator signature, a kernel that returns at once."""


def measure_dispatch(repeats: int) -> list[dict]:
    """An operator with macs_pool's schema and a no-op kernel, declared by torch.library.custom_op (before) and by
    ops/library.define_operator (after, as macs_kernels::bench_macs_pool_noop in this process only), called through
    torch.ops with the arguments the public op passes, less a direct call of the kernel."""
    custom = torch.library.custom_op("macs_bench::custom_op", bench_macs_pool_noop, mutates_args=("out",))
    direct = define_operator(bench_macs_pool_noop, mutates_args=("out",))
    q, k = torch.randn(BATCH, 32, 1, 128), torch.randn(BATCH, 8, 64, 128)
    index = torch.zeros(BATCH, 1, dtype=torch.int64)
    arguments = (q, k, torch.zeros(BATCH, 1, N_MAX), index, index, index, 0.1, "max", True, None)
    direct_us = _per_call_us(lambda: bench_macs_pool_noop(*arguments), repeats)
    rows = []
    for declared, operator in (("custom_op (before)", custom), ("define_operator (ops/library.py)", direct)):
        operator_us = _per_call_us(lambda operator=operator: operator(*arguments), repeats)
        rows.append({"declared_by": declared, "via_torch_ops_us": round(operator_us, 2),
                     "dispatch_us": round(operator_us - direct_us, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checks_cpu.json")
    args = parser.parse_args()
    tables = {"rows": measure(args.repeats), "calls": measure_calls(args.repeats),
              "dispatch": measure_dispatch(args.repeats)}
    for table, rows in tables.items():
        for row in rows:
            print(json.dumps({"table": table, **row}))
    args.out.write_text(json.dumps({"environment": environment("cpu"), "batch": BATCH, "repeats": args.repeats,
                                    **tables}, indent=1) + "\n")


if __name__ == "__main__":
    main()
