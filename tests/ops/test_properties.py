"""Property-based tests (hypothesis) of every op: bad arguments raise a ValueError or TypeError naming the
argument, before any kernel runs; on random shapes, ragged ranges and dtypes the ops equal the float64
references (the torch backend in the default run, Triton in the interpreter under the slow marker)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.ops.cases import DEVICE, backends
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
OPS = ("macs_update", "macs_update_rows", "macs_zscore", "decode_attention", "macs_pool", "macs_pool_paged",
       "attention_features", "efficient_attention")


@st.composite
def shapes(draw, max_keys=70):
    kv_heads = draw(st.integers(1, 3))
    return dict(batch=draw(st.integers(1, 3)), kv_heads=kv_heads, heads=kv_heads * draw(st.integers(1, 4)),
                keys=draw(st.integers(1, max_keys)), dim=draw(st.sampled_from((4, 8, 13, 16))))


@st.composite
def ragged_ranges(draw, batch, keys, rows=None):
    """(start, end, kv_len) of shape (B,) or (B, R): 0 <= start < end <= kv_len <= keys; each int32 or int64, as
    given or a strided view (a column of a wider tensor), as callers hold them."""
    shape = (batch,) if rows is None else (batch, rows)
    count = batch * (rows or 1)
    start = draw(st.lists(st.integers(0, keys - 1), min_size=count, max_size=count))
    end = [draw(st.integers(s + 1, keys)) for s in start]
    length = [draw(st.integers(e, keys)) for e in end]
    return tuple(index_as_held(draw, torch.tensor(values).view(shape)) for values in (start, end, length))


def index_as_held(draw, index):
    """`index` int32 or int64, contiguous or a view with other strides."""
    index = index.to(draw(st.sampled_from((torch.int64, torch.int32))))
    return torch.stack([index, -index], dim=-1)[..., 0] if draw(st.booleans()) else index


def tensor(draw, *shape, dtype=torch.float32, scale=1.0):
    seed = draw(st.integers(0, 2**31 - 1))
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@st.composite
def valid_call(draw, op):
    """(keyword arguments of a valid call of ops.<op>, dtype), small shapes, on the CPU."""
    s = draw(shapes())
    batch, heads, kv_heads, keys, dim = s["batch"], s["heads"], s["kv_heads"], s["keys"], s["dim"]
    dtype = draw(st.sampled_from(FLOATS))
    options = dict(pooling=draw(st.sampled_from(("max", "mean", "min"))), redistribute=draw(st.booleans()))
    alpha = draw(st.sampled_from((0.2, 0.8, 1.0)))
    q = tensor(draw, batch, heads, dim, dtype=dtype, scale=2.0)
    k_cache = tensor(draw, batch, kv_heads, keys, dim, dtype=dtype)
    start, end, length = draw(ragged_ranges(batch, keys))
    n_max = int((end - start).max()) + draw(st.integers(0, 2))
    log_c = -tensor(draw, batch, n_max).abs()
    ranges = dict(input_start=start, input_end=end, kv_len=length)
    if op == "macs_update":
        return dict(q=q, k_cache=k_cache, log_c=log_c, scale=dim ** -0.5, alpha=alpha, **ranges, **options), dtype
    if op == "macs_update_rows":
        rows = torch.softmax(tensor(draw, batch, heads, keys), dim=-1).to(dtype)
        return dict(rows=rows, log_c=log_c, alpha=alpha, **ranges, **options), dtype
    if op == "macs_zscore":
        return dict(log_c=tensor(draw, batch, n_max, scale=3.0), n_input=end - start), torch.float32
    if op == "decode_attention":
        call = dict(q=q, k_cache=k_cache, v_cache=tensor(draw, batch, kv_heads, keys, dim, dtype=dtype),
                    kv_start=start, kv_len=length, scale=dim ** -0.5, alpha=alpha, **options)
        state = draw(st.sampled_from((None, "log_c", "pooled")))
        if state is not None:
            call.update({state: log_c if state == "log_c" else torch.zeros(batch, n_max)}, input_end=end)
        return call, dtype
    rows = draw(st.integers(1, 4))
    block = tensor(draw, batch, heads, rows, dim, dtype=dtype, scale=2.0)
    if op == "macs_pool":
        start, end, length = draw(ragged_ranges(batch, keys, rows))
        return dict(q=block, k_cache=k_cache, input_start=start, input_end=end, kv_len=length, scale=dim ** -0.5,
                    **options), dtype
    if op == "macs_pool_paged":
        start, end, length = draw(ragged_ranges(batch, keys, rows))
        page_size = draw(st.integers(1, 8))
        per_item = -(-keys // page_size)
        spare = draw(st.integers(0, 2))
        order = torch.randperm(batch * per_item + spare, generator=torch.Generator().manual_seed(
            draw(st.integers(0, 2**31 - 1))))
        padded = torch.nn.functional.pad(k_cache, (0, 0, 0, per_item * page_size - keys))
        k_pages = torch.randn(batch * per_item + spare, page_size, kv_heads, dim).to(dtype)
        k_pages[order[:batch * per_item]] = padded.transpose(1, 2).reshape(-1, page_size, kv_heads, dim)
        table = order[:batch * per_item].view(batch, per_item).to(draw(st.sampled_from((torch.int32, torch.int64))))
        beyond = torch.arange(per_item) >= -(-length.amax(dim=1, keepdim=True) // page_size)
        return dict(q=block, k_pages=k_pages, block_table=table.masked_fill(beyond, -1), input_start=start,
                    input_end=end, kv_len=length, scale=dim ** -0.5, **options), dtype
    if op == "attention_features":
        kv_start = start
        n_rows = torch.tensor([draw(st.integers(0, min(rows, int(n - s)))) for s, n in zip(start, length)])
        return dict(q=block, k_cache=k_cache, source_start=start, source_end=end, kv_start=kv_start, kv_len=length,
                    n_rows=n_rows, scale=dim ** -0.5), dtype
    if op == "efficient_attention":
        p = torch.softmax(tensor(draw, batch, heads, rows, keys, dtype=torch.float64), dim=-1)
        v_cache = tensor(draw, batch, kv_heads, keys, dim, dtype=torch.float64)
        return dict(p=p, v_cache=v_cache, kv_start=start, kv_len=length), torch.float64
    raise ValueError(op)


FLOAT_ARGUMENTS = {"q", "k_cache", "k_pages", "v_cache", "rows", "log_c", "p", "pooled"}
INDEX_ARGUMENTS = {"input_start", "input_end", "kv_len", "kv_start", "n_input", "source_start", "source_end",
                   "n_rows"}


def corruptions(call):
    """(argument name, bad value) pairs, each of which makes the call invalid."""
    bad = []
    for name, value in call.items():
        if name in FLOAT_ARGUMENTS:
            bad += [(name, value[..., None]), (name, value.to(torch.int32)), (name, value.tolist())]
        elif name in INDEX_ARGUMENTS:
            bad += [(name, value.double()), (name, torch.cat([value, value[:1]]))]
        elif name == "scale":
            bad += [(name, float("nan")), (name, "0.125")]
        elif name == "alpha":
            bad += [(name, 0.0), (name, 1.5)]
        elif name == "pooling":
            bad += [(name, "median")]
    if "q" in call:  # no head dimension or KV heads (the checks divided by zero; Triton's kernels crashed)
        bad += [(name, call[name][..., :0]) for name in ("q", "k_cache", "v_cache") if name in call]
        if "k_cache" in call:
            bad.append(("k_cache", call["k_cache"][:, :0]))
    keys = call.get("k_cache", call.get("v_cache", call.get("rows")))
    if keys is not None and "kv_len" in call:
        bad.append(("kv_len", call["kv_len"] * 0 + keys.shape[2] + 1))
    if "block_table" in call:
        table, pages = call["block_table"], call["k_pages"]
        bad += [("block_table", table.double()), ("block_table", torch.cat([table, table[:1]])),
                ("block_table", table * 0 + pages.shape[0]), ("kv_len", call["kv_len"] * 0 + table.shape[1] *
                                                              pages.shape[1] + 1)]
    if "input_end" in call:  # no inputs
        bad.append(("input_end", call.get("input_start", call.get("kv_start")).clone()))
    for state in ("log_c", "pooled"):
        if state in call and "input_end" in call:  # one column fewer than the widest row's inputs
            widest = int((call["input_end"] - call.get("input_start", call.get("kv_start"))).max())
            bad.append((state, call[state][:, : widest - 1].contiguous()))
    return bad


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_arguments_raise_an_error_naming_them(op, data):
    call, _ = data.draw(valid_call(op))
    name, value = data.draw(st.sampled_from(corruptions(call)))
    with pytest.raises((ValueError, TypeError), match=name):
        getattr(ops, op)(**(call | {name: value}), backend="torch")


def _reference(op, call):
    """The float64 result(s) of the call: what the op returns or writes."""
    ranges = {name: call[name] for name in ("input_start", "input_end", "kv_len") if name in call}
    options = {name: call[name] for name in ("alpha", "pooling", "redistribute") if name in call}
    if op == "macs_update":
        return [reference.macs_update_reference(call["q"], call["k_cache"], call["log_c"], scale=call["scale"],
                                                **ranges, **options)]
    if op == "macs_update_rows":
        return [reference.macs_update_rows_reference(call["rows"], call["log_c"], **ranges, **options)]
    if op == "macs_zscore":
        return [reference.macs_zscore_reference(call["log_c"], call["n_input"])]
    if op == "decode_attention":
        out = list(reference.decode_attention_reference(call["q"], call["k_cache"], call["v_cache"],
                                                        kv_start=call["kv_start"], kv_len=call["kv_len"],
                                                        scale=call["scale"]))
        bounds = dict(input_start=call["kv_start"], input_end=call.get("input_end"), kv_len=call["kv_len"])
        if "log_c" in call:
            out.append(reference.macs_update_reference(call["q"], call["k_cache"], call["log_c"], scale=call["scale"],
                                                       **bounds, **options))
        if "pooled" in call:
            pooled = reference.macs_pool_reference(
                call["q"][:, :, None], call["k_cache"], scale=call["scale"], pooling=call["pooling"],
                redistribute=call["redistribute"], **{name: value[:, None] for name, value in bounds.items()})[:, 0]
            out.append(torch.nn.functional.pad(pooled, (0, call["pooled"].shape[1] - pooled.shape[1])))
        return out
    if op == "macs_pool":
        return [reference.macs_pool_reference(call["q"], call["k_cache"], scale=call["scale"], pooling=call["pooling"],
                                              redistribute=call["redistribute"], **ranges)]
    if op == "macs_pool_paged":
        # The item's keys laid out contiguously again, page by page as its table lists them.
        table, k_pages = call["block_table"].cpu(), call["k_pages"]
        k_cache = torch.stack([torch.cat([k_pages[page] for page in row.clamp_min(0).tolist()]) for row in table])
        return [reference.macs_pool_reference(call["q"], k_cache.transpose(1, 2).to(DEVICE), scale=call["scale"],
                                              pooling=call["pooling"], redistribute=call["redistribute"], **ranges)]
    if op == "attention_features":
        return [reference.attention_features_reference(**call)]
    return [reference.efficient_attention_reference(call["p"], call["v_cache"], kv_start=call["kv_start"],
                                                    kv_len=call["kv_len"])[0]]


def _check_against_reference(op, call, dtype, backend):
    call = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in call.items()}
    want = _reference(op, call)
    result = getattr(ops, op)(**call, backend=backend)
    got = list(result) if isinstance(result, tuple) else ([] if result is None else [result])
    got += [call[name] for name in ("log_c", "pooled") if name in call and op != "macs_zscore"]
    if op == "efficient_attention":
        got = got[:1]  # the residual is rounding noise
    assert len(got) == len(want)
    tolerance = 1e-8 if dtype == torch.float64 else RELATIVE_ERROR[dtype]
    for g, w in zip(got, want):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(g.cpu()), finite)
        assert relative_error(g.cpu()[finite], w[finite]) <= tolerance


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_torch_backend_equals_the_reference(op, data):
    _check_against_reference(op, *data.draw(valid_call(op)), backend="torch")


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in backends("macs_update") if b.values[0] != "torch"])
@pytest.mark.parametrize("op", OPS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_gpu_backends_equal_the_reference(op, backend, data):
    reason = ops.why_unavailable(backend, DEVICE, op)  # the CUDA emulation registers no efficient_attention kernel
    if reason is not None:
        pytest.skip(reason)
    _check_against_reference(op, *data.draw(valid_call(op)), backend=backend)
