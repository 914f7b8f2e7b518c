"""The public ops read no index value on the host (issue 42): on a CPU each compiles under
torch.compile(fullgraph=True) and equals its eager result, for the index values it was compiled with and for
others; a bad range is still caught inside the compiled graph (a device-side assertion); on a GPU each op is
captured in a CUDA graph, replayed after its index tensors change in place, and equals the eager result, and an
eager call makes no host sync."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import BACKENDS, Variant, why_unavailable

BATCH, HEADS, KV_HEADS, KEYS, DIM, ROWS = 2, 4, 2, 24, 8, 3
N_MAX = 12  # the width of every state and output: fits every row's inputs in both index sets below
PAGE_SIZE = 4
# Two index sets per case: the values the op is compiled (or captured) with, then others written in place.
# Item 1 has left pads and an unused cache tail; the second set moves every bound.
INDEX = {
    "start": ([0, 3], [2, 0]),
    "end": ([10, 8], [12, 5]),
    "kv_len": ([24, 15], [20, 9]),
}


def _index(name, which, device):
    return torch.tensor(INDEX[name][which], dtype=torch.int64, device=device)


def _rows(name, which, device):
    """(B, R) ranges of a block of R causal rows ending at kv_len (start, end repeated over the rows)."""
    value = _index(name, which, device)[:, None]
    if name == "kv_len":
        return value - ROWS + 1 + torch.arange(ROWS, device=device)
    return value.repeat(1, ROWS)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of a public op. `data(device)`: its tensors but the index ones; `index(which, device)`: its
    index tensors for index set 0 or 1; `call(backend, **tensors)`: runs the op and returns what it produced
    (outputs and the states it wrote)."""

    name: str
    op: str
    data: Callable
    index: Callable
    call: Callable


def _generator():
    return torch.Generator().manual_seed(0)


def _attention_data(device, *, rows=None, states=(), sinks=False):
    """q (one row per item, or `rows`), k and v; the states the op writes; gpt-oss sink logits for a variant."""
    generator = _generator()
    q_shape = (BATCH, HEADS, DIM) if rows is None else (BATCH, HEADS, rows, DIM)
    data = {
        "q": torch.randn(q_shape, generator=generator),
        "k": torch.randn(BATCH, KV_HEADS, KEYS, DIM, generator=generator),
        "v": torch.randn(BATCH, KV_HEADS, KEYS, DIM, generator=generator),
    }
    for name in states:
        data[name] = -torch.rand(BATCH, N_MAX, generator=generator) if name == "log_c" else torch.zeros(
            (BATCH, N_MAX) if rows is None else (BATCH, rows, N_MAX))
    if sinks:
        data["sinks"] = torch.randn(HEADS, generator=generator)
    return {name: tensor.to(device) for name, tensor in data.items()}


def _ranges(which, device):
    return {name: _index(name, which, device) for name in INDEX}


def _row_ranges(which, device):
    return {name: _rows(name, which, device) for name in INDEX}


def _variant(sinks=None):
    """A sliding window of 6 keys, Gemma 2's logit cap and (given) gpt-oss's sinks."""
    return Variant(window=6, softcap=2.0, sinks=sinks)


def _paged_data(device, *, rows):
    """The cache of _attention_data in pages of PAGE_SIZE, both items' pages interleaved in reverse order."""
    data = _attention_data(device, rows=rows, states=("out",))
    pages = KEYS // PAGE_SIZE
    k_pages = data.pop("k").transpose(1, 2).reshape(BATCH * pages, PAGE_SIZE, KV_HEADS, DIM).flip(0).contiguous()
    data.pop("v")
    table = (BATCH * pages - 1 - torch.arange(BATCH * pages, device=device)).view(BATCH, pages)
    return data | {"k_pages": k_pages, "block_table": table.to(torch.int32)}


def _decode(backend, q, k, v, start, end, kv_len, log_c=None, pooled=None, variant=None):
    fused = log_c is not None or pooled is not None
    out, lse = ops.decode_attention(q, k, v, kv_start=start, kv_len=kv_len, scale=0.3, log_c=log_c, pooled=pooled,
                                    input_end=end if fused else None, backend=backend, variant=variant)
    return tuple(x for x in (out, lse, log_c, pooled) if x is not None)


def _features_data(device):
    data = _attention_data(device, rows=ROWS)
    return {"q": data["q"], "k": data["k"]}


def _features_index(which, device):
    ranges = _ranges(which, device)
    # Sources inside each item's inputs; n_rows: item 1 has one row fewer.
    return {"source_start": ranges["start"], "source_end": ranges["end"], "kv_start": ranges["start"],
            "kv_len": ranges["kv_len"], "n_rows": torch.tensor([ROWS, ROWS - 1], device=device)}


def _features(backend, q, k, source_start, source_end, kv_start, kv_len, n_rows, variant=None):
    return (ops.attention_features(q, k, source_start=source_start, source_end=source_end, kv_start=kv_start,
                                   kv_len=kv_len, n_rows=n_rows, scale=0.3, n_max=N_MAX, backend=backend,
                                   variant=variant),)


def _efficient_data(device):
    generator = _generator()
    p = torch.softmax(torch.randn(BATCH, HEADS, ROWS, KEYS, generator=generator), dim=-1)
    return {"p": p.to(device), "v": torch.randn(BATCH, KV_HEADS, KEYS, DIM, generator=generator).to(device)}


CASES = [
    Case("decode_attention", "decode_attention", _attention_data, _ranges,
         lambda backend, start, end, **rest: _decode(backend, start=start, end=None, **rest)),
    Case("decode_attention-log_c", "decode_attention", functools.partial(_attention_data, states=("log_c",)),
         _ranges, _decode),
    Case("decode_attention-pooled", "decode_attention", functools.partial(_attention_data, states=("pooled",)),
         _ranges, _decode),
    Case("decode_attention-variant", "decode_attention",
         functools.partial(_attention_data, states=("pooled",), sinks=True), _ranges,
         lambda backend, sinks, **rest: _decode(backend, variant=_variant(sinks), **rest)),
    Case("macs_update", "macs_update", functools.partial(_attention_data, states=("log_c",)), _ranges,
         lambda backend, q, k, v, log_c, start, end, kv_len: (
             ops.macs_update(q, k, log_c, input_start=start, input_end=end, kv_len=kv_len, scale=0.3,
                             backend=backend), log_c)[1:]),
    Case("macs_update_rows", "macs_update_rows",
         lambda device: {"rows": torch.softmax(torch.randn(BATCH, HEADS, KEYS, generator=_generator()), -1).to(device),
                         "log_c": torch.zeros(BATCH, N_MAX, device=device)}, _ranges,
         lambda backend, rows, log_c, start, end, kv_len: (
             ops.macs_update_rows(rows, log_c, input_start=start, input_end=end, kv_len=kv_len, pooling="mean",
                                  backend=backend), log_c)[1:]),
    Case("macs_pool", "macs_pool", functools.partial(_attention_data, states=("out",)), _ranges,
         lambda backend, q, k, v, out, start, end, kv_len: (
             ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, out=out,
                           backend=backend),)),
    Case("macs_pool-rows", "macs_pool", functools.partial(_attention_data, rows=ROWS, states=("out",)), _row_ranges,
         lambda backend, q, k, v, out, start, end, kv_len: (
             ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, out=out,
                           pooling="mean", backend=backend),)),
    Case("macs_pool-variant", "macs_pool",
         functools.partial(_attention_data, rows=ROWS, states=("out",), sinks=True), _row_ranges,
         lambda backend, q, k, v, out, sinks, start, end, kv_len: (
             ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, out=out,
                           backend=backend, variant=_variant(sinks)),)),
    Case("macs_pool_paged", "macs_pool_paged", functools.partial(_paged_data, rows=ROWS), _row_ranges,
         lambda backend, q, k_pages, block_table, out, start, end, kv_len: (
             ops.macs_pool_paged(q, k_pages, block_table, input_start=start, input_end=end, kv_len=kv_len,
                                 scale=0.3, out=out, backend=backend),)),
    Case("macs_pool_paged-window", "macs_pool_paged", functools.partial(_paged_data, rows=ROWS), _row_ranges,
         lambda backend, q, k_pages, block_table, out, start, end, kv_len: (
             ops.macs_pool_paged(q, k_pages, block_table, input_start=start, input_end=end, kv_len=kv_len,
                                 scale=0.3, out=out, backend=backend, window=6, softcap=2.0),)),
    Case("macs_zscore", "macs_zscore",
         lambda device: {"log_c": torch.randn(BATCH, N_MAX, generator=_generator()).to(device)},
         lambda which, device: {"n_input": torch.tensor(([10, 5], [12, 3])[which], device=device)},
         lambda backend, log_c, n_input: (ops.macs_zscore(log_c, n_input, backend=backend),)),
    Case("attention_features", "attention_features", _features_data, _features_index, _features),
    Case("attention_features-variant", "attention_features", _features_data, _features_index,
         lambda backend, **rest: _features(backend, variant=_variant(), **rest)),
    Case("efficient_attention", "efficient_attention", _efficient_data,
         lambda which, device: {"kv_start": _index("start", which, device), "kv_len": _index("kv_len", which, device)},
         lambda backend, p, v, kv_start, kv_len: ops.efficient_attention(p, v, kv_start=kv_start, kv_len=kv_len,
                                                                         backend=backend)),
    Case("efficient_attention-causal", "efficient_attention", _efficient_data,
         lambda which, device: {"kv_start": _index("start", which, device), "kv_len": _index("kv_len", which, device)},
         lambda backend, p, v, kv_start, kv_len: ops.efficient_attention(p, v, kv_start=kv_start, kv_len=kv_len,
                                                                         causal=True, backend=backend)),
]


def _cloned(tensors: dict) -> dict:
    return {name: tensor.clone() for name, tensor in tensors.items()}


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_op_compiles_without_a_graph_break(case, fresh_dynamo):
    """fullgraph=True fails on any graph break (a host read of an index value is one); the compiled op equals
    the eager one for the index values it was traced with and for new ones (nothing was baked in)."""
    data = case.data("cpu")
    compiled = torch.compile(functools.partial(case.call, "torch"), fullgraph=True, backend="aot_eager")
    for which in (0, 1):
        index = case.index(which, "cpu")
        want = case.call("torch", **_cloned(data), **index)
        got = compiled(**_cloned(data), **index)
        _assert_same(got, want)


@pytest.mark.slow
def test_inductor_compiles_the_fused_decode_with_its_range_check(fresh_dynamo):
    """The device-side range assertion survives inductor's lowering: good ranges run, bad ones raise."""
    case = next(case for case in CASES if case.name == "decode_attention-pooled")
    data = case.data("cpu")
    compiled = torch.compile(functools.partial(case.call, "torch"), fullgraph=True)
    _assert_same(compiled(**_cloned(data), **case.index(0, "cpu")), case.call("torch", **_cloned(data),
                                                                              **case.index(0, "cpu")))
    bad = case.index(0, "cpu") | {"end": torch.tensor([10, 30])}
    with pytest.raises(RuntimeError, match="every row needs 0 <= input_start < input_end <= kv_len"):
        compiled(**_cloned(data), **bad)


def test_a_compiled_op_still_refuses_bad_ranges(fresh_dynamo):
    """Inside a compiled graph the range check is a device-side assertion: on a CPU it raises at once."""
    case = next(case for case in CASES if case.name == "decode_attention-pooled")
    data = case.data("cpu")
    compiled = torch.compile(functools.partial(case.call, "torch"), fullgraph=True, backend="aot_eager")
    compiled(**_cloned(data), **case.index(0, "cpu"))
    for bad, message in [
        ({"end": [10, 2]}, r"every row needs 0 <= input_start < input_end <= kv_len <= S=24"),
        ({"kv_len": [25, 15]}, r"kv_len <= S=24"),
        ({"start": [0, 0], "end": [20, 8]}, r"input_end - input_start <= pooled's 12 columns"),
    ]:
        index = case.index(0, "cpu") | {name: torch.tensor(value) for name, value in bad.items()}
        with pytest.raises(RuntimeError, match=message):
            compiled(**_cloned(data), **index)


def test_eager_errors_on_cpu_name_the_row():
    """Outside torch.compile, CPU index values are read on the host: the error names the row and its values."""
    case = next(case for case in CASES if case.name == "decode_attention-pooled")
    index = case.index(0, "cpu") | {"end": torch.tensor([10, 30])}
    with pytest.raises(ValueError, match=r"row 1: need 0 <= input_start < input_end <= kv_len <= S=24, got "
                                         r"input_start=3, input_end=30, kv_len=15"):
        case.call("torch", **case.data("cpu"), **index)


def test_a_data_dependent_width_is_refused_while_compiling(fresh_dynamo):
    """macs_pool without `out` sizes its output from the index values: not inside a compiled graph."""
    q, k = _attention_data("cpu")["q"], _attention_data("cpu")["k"]

    def pool(start, end, kv_len):
        return ops.macs_pool(q, k, input_start=start, input_end=end, kv_len=kv_len, scale=0.3, backend="torch")

    index = _ranges(0, "cpu")
    assert pool(**index).shape == (BATCH, 10)  # eagerly the widest row's N
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(pool, fullgraph=True, backend="aot_eager")(**index)


# ---- on a GPU: CUDA graphs ------------------------------------------------------------------------------

def _gpu_params():
    params = []
    for case in CASES:
        for backend in BACKENDS:
            marks = [pytest.mark.gpu]
            reason = "needs a CUDA device" if not torch.cuda.is_available() else why_unavailable(backend, "cuda",
                                                                                                case.op)
            if reason is not None:
                marks.append(pytest.mark.skip(reason=reason))
            elif case.op == "efficient_attention":
                marks.append(pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
                    "the Cholesky fallback's test and torch.linalg.eigh's error code are read on the host")))
            params.append(pytest.param(case, backend, marks=marks, id=f"{case.name}-{backend}"))
    return params


@pytest.mark.parametrize("case, backend", _gpu_params())
def test_every_op_replays_in_a_cuda_graph(case, backend):
    """Captured once with the first index set; the second written into the same index tensors and replayed:
    the graph's outputs equal an eager call with the second set. The captured call makes no host sync either."""
    device = torch.device("cuda")
    data, index = case.data(device), case.index(0, device)
    states = {name: tensor for name, tensor in data.items() if name in ("log_c", "pooled", "out")}
    initial = _cloned(states)
    case.call(backend, **_cloned(data), **index)  # the self-check and Triton's compilation, outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.call(backend, **data, **index)  # warm-up on a side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.call(backend, **data, **index)
    for name, tensor in case.index(1, device).items():
        index[name].copy_(tensor)
    for name, tensor in initial.items():
        states[name].copy_(tensor)
    graph.replay()
    want = case.call(backend, **_cloned(data | initial), **case.index(1, device))
    torch.cuda.synchronize()
    _assert_same(captured, want)


@pytest.mark.parametrize("case, backend", _gpu_params())
def test_an_eager_call_makes_no_host_sync(case, backend):
    device = torch.device("cuda")
    data, index = case.data(device), case.index(0, device)
    case.call(backend, **_cloned(data), **index)  # the self-check and compilation sync: once per process
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.call(backend, **data, **index)
    finally:
        torch.cuda.set_sync_debug_mode("default")
