"""A range the checks did not read (`validate=False`, or a GPU's default, docs/api.md "Argument checks") never makes a
kernel read or write outside its tensors, on any backend (cuda, triton, numba; torch's indexing neither gathers past a
tensor, an IndexError here and a device-side assert on a GPU): the numbers are wrong, the process and the CUDA
context live on (issue 48, point 3). Every kernel clamps each range into its cache as CUDA's KeyRange does.

Every tensor a call reads or writes lies inside a larger buffer; the call runs twice, with the bytes around the
tensors set to two different values. Memory outside the tensors must come back as it was (no stray write), and the
two runs must agree bit for bit (no stray read: a K row read from the guard would score 0 in one run and 3e4 in the
other). The ranges step outside in every way a caller can get them wrong: a start before the cache, a length past it,
an input range longer than the output row, an input end before its start, a length before the start, page numbers
outside the pages; each item's range touches the edge of a tensor so that a stray access lands in the guard. The cuda
backend's split-KV calls run on inputs of each of its split kernels (float32 at D 16: the pipelined one; bf16 at D 64:
the tensor-core one; bf16 at D 72: split_kernel)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from macs_kernels import ops
from tests.ops.cases import DEVICE, assert_split_kernel, backends, launched_kernels

B, H, H_KV, S, D, R, WIDTH, PAGE = 3, 6, 2, 41, 16, 2, 32, 8
PAGES = B * 5
GUARD = 4096  # elements on each side of a tensor: more than any range below strays
FILLS = (0.0, 3.0e4)


def _guard_value(fill: float, dtype: torch.dtype):
    """What surrounds a tensor of `dtype`: `fill`, or for the block table a page number (a read past it stays in the
    pages and changes the result)."""
    return int(fill) % PAGES if dtype == torch.int32 else fill


def _guarded(tensor: torch.Tensor, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of tensor inside a buffer with `fill` around it, the buffer)."""
    buffer = torch.full((tensor.numel() + 2 * GUARD,), _guard_value(fill, tensor.dtype), dtype=tensor.dtype,
                        device=DEVICE)
    inside = buffer[GUARD:GUARD + tensor.numel()].view(tensor.shape)
    inside.copy_(tensor)
    return inside, buffer


def _bad_ranges() -> dict:
    """Item 0 starts 3 keys before the cache; item 1 ends its inputs before its start and its keys before both;
    item 2 runs 3 keys past the cache (and past its pages' 40 keys) with 41 inputs for a 32-column row; with
    row_length, a verify block's own length per row (B, R)."""
    start, end, length = ([-3, 9, 4], [20, 5, 45], [33, 7, 44])
    ranges = {name: torch.tensor(values, device=DEVICE) for name, values in
              (("start", start), ("end", end), ("length", length))}
    ranges["row_length"] = torch.stack([ranges["length"] - 1, ranges["length"]], dim=1)
    return ranges


def _inputs(fill, dtype=torch.float32, dim=D) -> tuple[dict, list[torch.Tensor]]:
    """The guarded inputs (and the buffers around them) with `fill` in the guards; q, K, V and pages in `dtype`."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, dim, generator=generator).to(dtype)
    block = torch.randn(B, H, R, dim, generator=generator).to(dtype)
    k, v = torch.randn(2, B, H_KV, S, dim, generator=generator).to(dtype)
    pages = torch.randn(PAGES, PAGE, H_KV, dim, generator=generator).to(dtype)
    rows = torch.softmax(torch.randn(B, H, S, generator=generator), -1)
    # Pages outside [0, PAGES) in use: one before, one after.
    table = torch.randperm(PAGES, generator=generator).to(torch.int32).view(B, 5)
    table[0, 1], table[2, 3] = -7, PAGES + 2
    tensors, buffers = {}, []
    for name, value in dict(q=q, block=block, k=k, v=v, pages=pages, rows=rows, table=table).items():
        tensors[name], buffer = _guarded(value.to(DEVICE), fill)
        buffers.append(buffer)
    return tensors, buffers


def _calls(data: dict, fill) -> dict:
    """name -> a call with bad ranges that returns what it computed; the state it writes is guarded with `fill`
    (log c holds 0 before the call)."""
    ranges = _bad_ranges()
    start, end, length = ranges["start"], ranges["end"], ranges["length"]
    pooled = dict(input_start=start, input_end=end, kv_len=length, scale=0.25, validate=False)
    q, k, v = data["q"], data["k"], data["v"]

    def state(*shape):
        inside, buffer = _guarded(torch.zeros(B, *shape, WIDTH, device=DEVICE), fill)
        data.setdefault("buffers", []).append(buffer)
        return inside

    def returning(*tensors):
        return [t for t in tensors if t is not None]

    def fused(backend):
        log_c = state()
        out, lse = ops.decode_attention(q, k, v, kv_start=start, kv_len=length, input_end=end, scale=0.25,
                                        log_c=log_c, validate=False, backend=backend)
        return returning(out, lse, log_c)

    def pool(query, cache, **kw):
        def call(backend):
            out = state(*(() if query.dim() == 3 else (R,)))
            ops.macs_pool(query, cache, out=out, backend=backend, **(pooled | kw))
            return [out]
        return call

    def update(backend):
        log_c = state()
        ops.macs_update(q, k, log_c, backend=backend, **pooled)
        return [log_c]

    def attention(backend):
        return returning(*ops.decode_attention(q, k, v, kv_start=start, kv_len=length, scale=0.25, validate=False,
                                               backend=backend))

    def update_rows(backend):
        log_c = state()
        ops.macs_update_rows(data["rows"], log_c, input_start=start, input_end=end, kv_len=length, validate=False,
                             backend=backend)
        return [log_c]

    def zscore(backend):
        # None, a negative count, and 33 entries of a 32-column row.
        log_c = state()
        log_c[:, :] = torch.linspace(-4.0, 0.0, WIDTH, device=DEVICE)
        counts = torch.tensor([0, -5, WIDTH + 1], device=DEVICE)
        return [ops.macs_zscore(log_c, counts, validate=False, backend=backend)]

    def features(backend):
        # Sources from before the cache to past it; more rows than the block holds, rows ending past the cache.
        return [ops.attention_features(
            data["block"], k, source_start=torch.tensor([-3, 30, 2], device=DEVICE),
            source_end=torch.tensor([20, 44, 1], device=DEVICE), kv_len=length, kv_start=start,
            n_rows=torch.tensor([R, R + 3, R], device=DEVICE), scale=0.25, n_max=WIDTH, validate=False,
            backend=backend)]

    def efficient(backend):
        p = torch.softmax(data["block"][..., :1].expand(B, H, R, S) * 0 + data["rows"][:, :, None], -1)
        return list(ops.efficient_attention(p, v, kv_len=length, kv_start=start, causal=True, validate=False,
                                            backend=backend))

    return {
        "decode_attention": attention,
        "decode_attention_fused": fused,
        "macs_pool": pool(q, k),
        "macs_pool_verify": pool(data["block"], k, kv_len=ranges["row_length"]),
        "macs_pool_window": pool(q, k, window=16),
        "macs_pool_paged": pool(q, data["pages"], block_table=data["table"]),
        "macs_update": update,
        "macs_update_rows": update_rows,
        "macs_zscore": zscore,
        "attention_features": features,
        "efficient_attention": efficient,
    }


CALL_OPS = {"decode_attention": "decode_attention", "decode_attention_fused": "decode_attention",
            "macs_pool": "macs_pool", "macs_pool_verify": "macs_pool", "macs_pool_window": "macs_pool",
            "macs_pool_paged": "macs_pool_paged", "macs_update": "macs_update", "macs_update_rows": "macs_update_rows",
            "macs_zscore": "macs_zscore", "attention_features": "attention_features",
            "efficient_attention": "efficient_attention"}


def _run(call: str, backend: str, fill, dtype=torch.float32, dim=D):
    data, buffers = _inputs(fill, dtype, dim)
    results = _calls(data, fill)[call](backend)
    buffers += data.get("buffers", [])
    return [t.clone() for t in results], buffers


def _guards_intact(buffer: torch.Tensor, fill) -> bool:
    guards = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
    return bool((guards == _guard_value(fill, buffer.dtype)).all())


# The cuda backend's split kernels, by inputs each is chosen for: (dtype, D).
CUDA_SPLIT_KERNEL_INPUTS = {"pipelined": (torch.float32, D), "mma": (torch.bfloat16, 64),
                            "general": (torch.bfloat16, 72)}
SPLIT_KV_OPS = ("decode_attention", "macs_pool", "macs_pool_paged", "macs_update")


def _params():
    for call, op in CALL_OPS.items():
        for backend in backends(op):
            kernels = CUDA_SPLIT_KERNEL_INPUTS if backend.id == "cuda" and op in SPLIT_KV_OPS else {None: None}
            for kernel, inputs in kernels.items():
                yield pytest.param(call, *backend.values, kernel, *(inputs or (torch.float32, D)), marks=backend.marks,
                                   id=f"{call}-{backend.id}" + (f"-{kernel}" if kernel else ""))


# The interpreter warns of the divisions of empty rows (0 inputs), whose results no one reads.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("call, backend, kernel, dtype, dim", list(_params()))
def test_unchecked_bad_ranges_stay_inside_the_tensors(call, backend, kernel, dtype, dim):
    """`kernel`: the cuda split kernel the call must launch (None: not a cuda split-KV call)."""
    if kernel is not None:
        ops.resolve_backend(backend, DEVICE, CALL_OPS[call])  # its self-check before the launches counted
    runs = []
    for fill in FILLS:
        with launched_kernels() if kernel is not None else contextlib.nullcontext([]) as names:
            results, buffers = _run(call, backend, fill, dtype, dim)
        if kernel is not None:
            assert_split_kernel(names, kernel)
        for buffer in buffers:
            assert _guards_intact(buffer, fill), f"{call}: a write outside its tensors (guard {fill})"
        runs.append(results)
    for first, second in zip(*runs):
        torch.testing.assert_close(first, second, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{call}: a read outside its tensors changed the result\n{m}")
