"""Argument checks shared by the public ops: readable errors before any kernel runs.

Checks of shapes, dtypes and devices read metadata only, on the host, on every call. Checks of index VALUES
(ranges, pages) cost no kernel launch and no host sync unless the caller asks for one (issue 48), so that a
public op costs what its kernels cost, eagerly and inside a CUDA graph or a torch.compile'd region. Each op's
`validate` argument says whether its index values are checked:
- None (the default): only where a check is free. CPU tensors outside torch.compile: the values are already on
  the host; they are read there and a bad one raises ValueError naming the row before any kernel runs. CPU
  tensors inside torch.compile: an asynchronous assertion of the same rule (`torch._assert_async`) that the
  compiled graph keeps, a RuntimeError with the rule when the graph runs. Device tensors: no value check (as
  FlashAttention's `flash_attn_with_kvcache` checks its `cache_seqlens`: not at all), unless the environment
  variable MACS_KERNELS_VALIDATE=1 makes every call validate=True (a debugging switch, like CUDA_LAUNCH_BLOCKING,
  read when macs_kernels is imported: `VALIDATE_EVERY_CALL`);
- True: always. Eagerly, the index tensors are copied to the host (one sync on a GPU) and a bad row raises
  ValueError naming it before any kernel runs; inside torch.compile or a CUDA graph capture, where the host cannot
  read them, the asynchronous assertion (a device-side assert on a GPU: it ends the CUDA context);
- False: never (the caller checked its ranges already, e.g. once per pass).
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence

import torch

from macs_kernels.ops.backends import NAMES as BACKENDS

POOLINGS = ("max", "mean", "min")
# The paper's floor weight, the default of every op that takes alpha: this layer's copy of
# core.config.DEFAULT_ALPHA, which the layers above use (the ops import nothing above them; tests/core/test_core.py
# keeps the two equal).
DEFAULT_ALPHA = 0.8


def check_options(*, alpha: float | None = None, pooling: str = "max", redistribute: bool = True,
                  backend: str | None = None) -> None:
    """The options the ops share with MacsConfig (which calls this for its own): the floor weight alpha (None: the
    op takes none), the pooling over heads, whether generated tokens' mass is spread, and the backend (None: the
    best available)."""
    if alpha is not None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a number in (0, 1], got {alpha!r}")
        if not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLINGS}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")
    if not isinstance(redistribute, bool):
        raise TypeError(f"redistribute must be True or False, got {redistribute!r}")


# An index argument as the public ops accept it: a tensor (int32 or int64), a sequence of ints, or one int
# repeated over the batch.
IndexLike = torch.Tensor | Sequence[int] | int


def host_readable(*tensors: torch.Tensor) -> bool:
    """Whether reading these tensors' values costs neither a device sync nor a graph break: CPU tensors outside
    torch.compile."""
    return not torch.compiler.is_compiling() and all(tensor.is_cpu for tensor in tensors)


def on_host(*tensors: torch.Tensor) -> bool:
    """Whether the values of these tensors are in host memory already (checking them launches nothing)."""
    return all(tensor.is_cpu for tensor in tensors)


def validate_from_environment() -> bool:
    """Whether MACS_KERNELS_VALIDATE asks every call to validate (see the module's docstring)."""
    return os.environ.get("MACS_KERNELS_VALIDATE", "") not in ("", "0")


# Read once: a read of os.environ cost every GPU call about 0.6 us of host time (issue 48).
VALIDATE_EVERY_CALL = validate_from_environment()


def check_validate(validate: bool | None) -> None:
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be True, False or None, got {validate!r}")


def values_to_check(validate: bool | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The index tensors a rule is checked on under `validate` (see the module's docstring), or None when this call
    checks no values. Device tensors that validate=True has the host read are copied there, one sync."""
    check_validate(validate)
    if validate is False:
        return None
    if on_host(*tensors):
        return tensors
    if validate is None and VALIDATE_EVERY_CALL:
        validate = True
    if validate is None:
        # Device tensors by default: no launch, no sync.
        return None
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        return tensors
    return tuple(tensor.cpu() for tensor in tensors)


def invalid_entry(valid: torch.Tensor, message: str) -> int | None:
    """Where the bool tensor `valid` (computed from values_to_check's tensors) is False: on the host
    (host_readable), the flat index of its first False entry, for the caller to raise a ValueError naming it (None
    when every entry holds); elsewhere an asynchronous assertion of `valid` with `message` (see the module's
    docstring), and None."""
    if not host_readable(valid):
        torch._assert_async(valid.all(), message)
        return None
    if bool(valid.all()):
        return None
    return int(valid.logical_not().flatten().nonzero()[0, 0])


def values_readable(what: str, *tensors: torch.Tensor) -> None:
    """Refuse, naming `what` to pass instead, a call whose output shape would depend on index values while they
    cannot be read: inside torch.compile or a CUDA graph capture."""
    capturing = any(tensor.is_cuda for tensor in tensors) and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        raise ValueError(f"inside torch.compile or a CUDA graph capture, pass {what}: the default reads index "
                         "values on the host")


# Keys a cache may hold per item: the kernels count a tile's keys as 32-bit offsets (Triton's masks, the cuda kernels'
# key loops), and a tile may run up to 2^16 keys past the last one.
MAX_KEYS = 2**31 - 2**16


def check_keys(name: str, keys: int) -> None:
    if keys > MAX_KEYS:
        raise ValueError(f"{name}: {keys} keys per item, more than the kernels' 32-bit key offsets reach (at most "
                         f"{MAX_KEYS})")


def check_tensor(name, tensor, ndim, *, float_dtype=True):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if float_dtype and not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    # is_contiguous() reads a flag; stride(-1) parses its argument (twice the host time): asked only of views. A
    # contiguous tensor's last stride is 1 unless its last dimension has one element, read at offset 0 by every kernel.
    if not tensor.is_contiguous() and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {tensor.stride()}")


INDEX_DTYPES = (torch.int32, torch.int64)


def _index_tensor(name, tensor, shape, device, also=None):
    """`tensor` checked as index `name` of `shape` (or the shape `also`, which the caller takes too), contiguous."""
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.shape != shape:
        expected = tuple(shape) if also is None else f"{tuple(also)} or {tuple(shape)}"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the data is on {device}")
    # Contiguous: kernels index (b[, r]) as b [* R + r] (a no-op for the tensors callers hold).
    return tensor.contiguous()


def as_index(name, value, batch, device):
    """A contiguous (B,) int32 or int64 index tensor from a tensor (its dtype kept: every backend reads both, so
    that FlashAttention's and vLLM's int32 lengths cost no conversion), a sequence or a Python int (repeated over
    the batch). A sequence is copied from the host, which a CUDA graph cannot capture, and an int is a fill: a
    call that should launch nothing but its kernel passes tensors."""
    if value is None:
        return None
    if type(device) is not torch.device:
        device = torch.device(device)
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return _index_tensor(name, value, (batch,), device)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        # Filled on the device (a CUDA graph can capture a fill, not a copy from the host); a copy, not a
        # stride-0 view: kernels index these by row.
        return torch.full((batch,), int(value), dtype=torch.int64, device=device)
    tensor = torch.as_tensor(value, device=device)
    if tensor.dim() == 0:
        tensor = tensor.repeat(batch)
    return _index_tensor(name, tensor, (batch,), device)


# (device, dtype) -> zeros that every call with a default start of 0 reads (a slice: no launch). Never freed or
# grown: a CUDA graph that captured a slice keeps reading it. Each batch size's slice is kept too (a view costs a
# call about a microsecond of host time).
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_ZERO_SLICES: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
_ZEROS_SIZE = 1024


def zeros_index(batch, device, dtype=torch.int64):
    """A (B,) index of zeros in `dtype` (the call's other ranges': Triton compiles one kernel per mix of widths),
    without a launch when it can: a slice of a tensor made once per device and dtype by an eager call (a capture
    or torch.compile's tracing fills its own)."""
    device = torch.device(device)
    if torch.compiler.is_compiling() or batch > _ZEROS_SIZE:
        return torch.zeros(batch, dtype=dtype, device=device)
    sliced = _ZERO_SLICES.get((device, dtype, batch))
    if sliced is not None:
        return sliced
    zeros = _ZEROS.get((device, dtype))
    if zeros is None:
        if device.type == "cuda":
            with torch.cuda.device(device):
                if torch.cuda.is_current_stream_capturing():
                    return torch.zeros(batch, dtype=dtype, device=device)
        zeros = _ZEROS[device, dtype] = torch.zeros(_ZEROS_SIZE, dtype=dtype, device=device)
        if device.type == "cuda":
            # Other streams read it too: its fill must be done before any of them does.
            torch.cuda.current_stream(device).synchronize()
    sliced = _ZERO_SLICES[device, dtype, batch] = zeros[:batch]
    return sliced


def as_row_index(name, value, batch, rows, device):
    """A (B, R) int32 or int64 index tensor: (B, R) as given (contiguous), or (B,) / a Python int broadcast over the
    R rows (a view with stride 0 over R: kernels read every range with its strides). rows None (one row per item, q
    (B, H, D)): a (B,) tensor, a (B, 1) one's column."""
    if rows is None:
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return _index_tensor(name, value, (batch, 1), torch.device(device), also=(batch,))[:, 0]
        return as_index(name, value, batch, device)
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        return _index_tensor(name, value, (batch, rows), torch.device(device), also=(batch,))
    column = as_index(name, value, batch, device).unsqueeze(1)
    return column if rows == 1 else column.expand(batch, rows)


def _in_range(start, end, length, keys, n_max=None):
    """0 <= start < end <= length <= keys, and end - start <= n_max: of Python ints, or per entry of tensors."""
    valid = (start >= 0) & (start < end) & (end <= length) & (length <= keys)
    return valid if n_max is None else valid & (end - start <= n_max)


def check_ranges(input_start, input_end, kv_len, keys, n_max=None, state="log_c", validate=None):
    """0 <= input_start < input_end <= kv_len <= keys per row, and N_b <= n_max (where and when `validate` says:
    see the module's docstring). (B,) or (B, R) ranges; a row's number counts (b, r) row-major."""
    values = values_to_check(validate, input_start, input_end, kv_len)
    if values is None:
        return
    rule = f"0 <= input_start < input_end <= kv_len <= S={keys}"
    if not host_readable(*values):
        fits = "" if n_max is None else f" and input_end - input_start <= {state}'s {n_max} columns"
        invalid_entry(_in_range(*values, keys, n_max), f"every row needs {rule}{fits}")
        return
    # One copy of the three (host) tensors to Python ints: cheaper than the tensor form's kernels.
    for b, (s, e, n) in enumerate(zip(*torch.stack([value.flatten() for value in values]).tolist())):
        if not _in_range(s, e, n, keys):
            raise ValueError(f"row {b}: need {rule}, got input_start={s}, input_end={e}, kv_len={n}")
        if not _in_range(s, e, n, keys, n_max):
            raise ValueError(f"row {b}: {e - s} input tokens do not fit {state}'s {n_max} columns")


def check_log_c(log_c, batch, device, name="log_c"):
    """A float32 (B, N_max) state updated in place (log_c, or a pooled-row buffer)."""
    check_tensor(name, log_c, 2)
    if log_c.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the score state is always float32), got {log_c.dtype}")
    if log_c.shape[0] != batch or log_c.device != device:
        raise ValueError(f"{name} must be ({batch}, N_max) on {device}, got {tuple(log_c.shape)} on {log_c.device}")
    if not log_c.is_contiguous():
        raise ValueError(f"{name} must be contiguous: it is written in place")


def check_q_k(q, k_cache, v_cache=None, *, q_dims=3):
    """q (B, H, D), or (B, H, R, D) with q_dims=4, against k_cache (B, H_kv, S, D) and v_cache."""
    check_tensor("q", q, q_dims)
    check_tensor("k_cache", k_cache, 4)
    # Each shape or device read builds a Python object: read once, they cost every public call less host time.
    q_shape, k_shape, device = q.shape, k_cache.shape, q.device
    batch, heads, dim = q_shape[0], q_shape[1], q_shape[-1]
    if k_shape[0] != batch or k_shape[3] != dim:
        raise ValueError(f"k_cache must be ({batch}, H_kv, S, {dim}) to match q {tuple(q_shape)}, got {tuple(k_shape)}")
    if not (heads and dim and k_shape[1]):  # the checks below divide by them; a kernel of width 0 crashed Triton's
        raise ValueError(f"q {tuple(q_shape)} and k_cache {tuple(k_shape)} need at least one head, KV head and "
                         "head dimension")
    if heads % k_shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({k_shape[1]})")
    check_keys("k_cache", k_shape[2])
    if k_cache.device != device:
        raise ValueError(f"q is on {device} but k_cache is on {k_cache.device}")
    if v_cache is not None:
        check_tensor("v_cache", v_cache, 4)
        v_shape = v_cache.shape
        if v_shape[:3] != k_shape[:3] or v_cache.device != device or v_shape[3] == 0:
            raise ValueError(f"v_cache must be {tuple(k_shape[:3])} x D_v (D_v >= 1) on {device}, got "
                             f"{tuple(v_shape)}")


def check_paged(q, k_pages, block_table):
    """q (B, H, D) or (B, H, R, D) against a paged cache k_pages (P, page_size, H_kv, D) and its block
    table (B, pages) of int32 or int64 page numbers."""
    check_tensor("q", q, q.dim() if isinstance(q, torch.Tensor) and q.dim() in (3, 4) else 3)
    check_tensor("k_pages", k_pages, 4)
    check_tensor("block_table", block_table, 2, float_dtype=False)
    batch, heads, dim = q.shape[0], q.shape[1], q.shape[-1]
    if k_pages.shape[3] != dim or k_pages.shape[1] == 0:
        raise ValueError(f"k_pages must be (pages, page_size >= 1, H_kv, {dim}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k_pages.shape)}")
    if heads % k_pages.shape[2]:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({k_pages.shape[2]})")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must be ({batch}, pages), got {tuple(block_table.shape)}")
    check_keys("k_pages through block_table", block_table.shape[1] * k_pages.shape[1])
    for name, tensor in (("k_pages", k_pages), ("block_table", block_table)):
        if tensor.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {tensor.device}")


def check_pages_in_use(block_table, attend_start, kv_len, page_size, pages, validate=None):
    """Every page that holds a key a row of item b attends (keys [min_r attend_start[b, r], max_r kv_len[b, r]))
    is a page of the cache, in [0, pages) (where and when `validate` says: see the module's docstring). Entries
    past an item's last page may be anything: transformers' tables hold -1 there; so may those before its first (a
    sliding window's freed pages). attend_start: the (B, R) or (B,) attended starts, as kv_len, or a function of no
    argument that computes them (only when they are checked)."""
    values = values_to_check(validate, block_table, kv_len)
    if values is None or kv_len.numel() == 0:
        return
    block_table, kv_len = values
    attend_start = (attend_start() if callable(attend_start) else attend_start).to(kv_len.device)
    batch = block_table.shape[0]
    needed = -(-kv_len.reshape(batch, -1).amax(dim=1) // page_size)
    page = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = (page < needed[:, None]) & (page >= attend_start.reshape(batch, -1).amin(dim=1)[:, None] // page_size)
    bad = in_use & ((block_table < 0) | (block_table >= pages))
    first = invalid_entry(~bad, f"every block_table entry through which an item attends keys must be a page of "
                                f"k_pages (0 <= page < {pages})")
    if first is not None:
        b, j = divmod(first, block_table.shape[1])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of k_pages (0 <= page < {pages}), "
            f"but item {b} attends keys [{j * page_size}, {(j + 1) * page_size}) through it"
        )


def as_scale(scale: float) -> float:
    """The softmax scale as a float: a finite real number (a bool is refused)."""
    # A float needs no isinstance against the numbers ABC (3% of a public call's host instructions).
    if type(scale) is not float and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_lse(lse, shape, device):
    if lse is None:
        return
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != shape or lse.device != device:
        raise ValueError(f"lse must be a tensor of shape {shape} on {device}")
    if not lse.is_floating_point():
        raise TypeError(f"lse must be floating point, got {lse.dtype}")


def as_row_block(q, out, lse, *ranges):
    """A pooled-row kernel's arguments for one row per item (q (B, H, D), ranges (B,), out (B, N_max), lse (B, H))
    as the (B, H, 1, D) block of rows its kernel takes, ranges (B, 1), out (B, 1, N_max), lse (B, H, 1); a block
    (q (B, H, R, D)) as given. The public ops pass a single row as it is: a view per argument would cost each call
    4-5 us on the host, where the cuda backend's launcher takes both ranks."""
    if q.dim() == 4:
        return (q, out, lse, *ranges)
    return (q.unsqueeze(2), out.unsqueeze(1), None if lse is None else lse.unsqueeze(-1),
            *(None if index is None else index.unsqueeze(1) for index in ranges))
