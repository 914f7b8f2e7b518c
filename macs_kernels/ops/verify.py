"""Backend self-check: before a backend other than torch computes anything on a device, it must agree
with the torch path there.

The CUDA and Triton kernels are tested in CI only by compilation and in the Triton interpreter; a user's
GPU, driver or compiler can still make them wrong. So, once per process, device and op, the registry's
`self_check` has `compare` run the backend and the torch path on a few small cases (GQA 3:1, left pads, unused
cache slots, float32 and bfloat16; a few milliseconds on a GPU). The automatic choice
(`registry.default_backend`) skips a backend that disagrees, with one warning naming the op and the
difference; a backend named explicitly is used anyway, and the disagreement is reported the same way.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from macs_kernels.ops._checks import DEFAULT_ALPHA

# Relative difference (max |backend - torch| / max |torch|) allowed per input dtype: float32 paths differ
# by summation order only; bfloat16 paths may round p to bfloat16 before p @ V (tensor cores).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}



def _cases(op: str, device: torch.device, dtype: torch.dtype):
    """Small argument tuples of `op` (positional, as the operator takes them), each with the index of the
    argument it writes (None when it only returns) and, optionally, how many returned values to compare
    (default all)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    def index(*values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    # Long enough for several key blocks and slices (on a GPU and in the interpreter), with slice borders
    # that fall inside each range.
    batch, heads, kv_heads, keys, dim = 2, 6, 2, 200, 64
    # Item 0: inputs [0, 90), generated [90, 200). Item 1: pads [0, 5), inputs [5, 70), generated [70, 150),
    # unused slots [150, 200) holding garbage.
    start, end, length = index(0, 5), index(90, 70), index(200, 150)
    n_max = 90
    q, k_cache, v_cache = randn(batch, heads, dim, scale=2.0), randn(batch, kv_heads, keys, dim), randn(
        batch, kv_heads, keys, dim)
    k_cache[1, :, 150:] = 1e4
    scale = dim ** -0.5

    def log_c():
        return -torch.rand(batch, n_max, generator=generator).to(device)

    if op == "macs_update":
        return [((q, k_cache, log_c(), start, end, length, scale, DEFAULT_ALPHA, "max", True, None), 2)]
    if op == "macs_update_rows":
        rows = torch.rand(batch, heads, keys, generator=generator).div(keys).to(device=device, dtype=dtype)
        return [((rows, log_c(), start, end, length, DEFAULT_ALPHA, "mean", True), 1)]
    if op == "macs_zscore":
        return [((log_c().mul(5.0), index(90, 17)), None)]
    if op == "decode_attention":
        return [
            ((q, k_cache, v_cache, start, length, scale, log_c(), end, DEFAULT_ALPHA, "max", True, None), 6),
            ((q, k_cache, v_cache, start, length, scale, None, end, DEFAULT_ALPHA, "max", True,
              torch.zeros(batch, n_max, device=device)), 11),
        ]
    rows = 3
    block = randn(batch, heads, rows, dim, scale=2.0)
    if op == "macs_pool":
        causal = length[:, None] - rows + 1 + torch.arange(rows, device=device)
        out = torch.zeros(batch, rows, n_max, device=device)
        return [((block, k_cache, out, start[:, None].repeat(1, rows), end[:, None].repeat(1, rows), causal, scale,
                  "max", True, None), 2)]
    if op == "macs_pool_paged":
        # The same keys in pages of 16 slots, both items' pages interleaved in reverse order.
        page_size = 16
        pages_per_item = -(-keys // page_size)
        padded = torch.nn.functional.pad(k_cache, (0, 0, 0, pages_per_item * page_size - keys))
        k_pages = padded.transpose(1, 2).reshape(batch * pages_per_item, page_size, kv_heads, dim).flip(0)
        block_table = (batch * pages_per_item - 1 - torch.arange(batch * pages_per_item, device=device)).view(
            batch, pages_per_item).to(torch.int32)
        causal = length[:, None] - rows + 1 + torch.arange(rows, device=device)
        out = torch.zeros(batch, rows, n_max, device=device)
        return [((block, k_pages, block_table, out, start[:, None].repeat(1, rows), end[:, None].repeat(1, rows),
                  causal, scale, "max", True, None), 3)]
    if op == "attention_features":
        return [((block, k_cache, start, end, start, length, index(rows, 2), n_max, scale, None), None)]
    if op == "efficient_attention":
        p = torch.softmax(torch.randn(batch, heads, 1, keys, generator=generator), dim=-1).to(device=device,
                                                                                              dtype=dtype)
        # Only a_eff: the residual is rounding noise (~1e-7) on both paths, not a comparable quantity.
        return [((p, v_cache, start, length, False, 1e-10), None, 1)]
    raise ValueError(f"no self-check case for op {op!r}")


def _clone(args):
    return tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)


def _outputs(result, args, written, compared=None):
    outputs = list(result) if isinstance(result, tuple) else ([] if result is None else [result])
    return outputs[:compared] + ([] if written is None else [args[written]])


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|; infinite entries must agree exactly; NaN or a shape change is inf."""
    if got.shape != want.shape:
        return math.inf
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    same_infinity = torch.isinf(want) & (got == want)
    got, want = got.masked_fill(same_infinity, 0.0), want.masked_fill(same_infinity, 0.0)
    if not bool(torch.isfinite(want).all()):
        return math.inf
    difference = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if got.numel() else 0.0
    return difference if math.isfinite(difference) else math.inf


@contextlib.contextmanager
def _exact_float32_matmuls():
    """The torch path's float32 matmuls in full precision, whatever the user allowed (TF32 would make a correct
    backend look wrong)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def compare(function: Callable, reference: Callable, device: torch.device, op: str) -> str | None:
    """None when `function` computes `op` like `reference` (the torch path) on the cases, else the difference in
    words."""
    # On the CPU the backend runs in the Triton interpreter, where every dtype takes the float32 path.
    dtypes = (torch.float32,) if device.type == "cpu" else tuple(TOLERANCE)
    for dtype in dtypes:
        tolerance = TOLERANCE[dtype]
        for case, (args, *which) in enumerate(_cases(op, device, dtype)):
            want_args = _clone(args)
            with _exact_float32_matmuls():
                want = _outputs(reference(*want_args), want_args, *which)
            got_args = _clone(args)
            try:
                got = _outputs(function(*got_args), got_args, *which)
            except Exception as error:  # noqa: BLE001 - any failure disqualifies the backend
                return f"it raised {type(error).__name__}: {error}"
            worst = max((relative_difference(g, w) for g, w in zip(got, want)), default=0.0)
            if len(got) != len(want) or worst > tolerance:
                return (f"case {case} in {str(dtype).removeprefix('torch.')} differs from the torch path by "
                        f"{worst:.3g} (max relative; allowed {tolerance:g})")
    return None
