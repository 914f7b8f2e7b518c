"""A public op costs what its kernel costs (issue 48): with device index tensors, int32 or int64 as callers hold
them, a call launches no aten op besides its kernel, and dispatches to the kernel without Python wrappers; the
widths and strides callers hold give the kernels' results bit for bit (every backend here), through the public ops
and through the kernels as the engines call them."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.apps.bench.aten import AtenOps
from macs_kernels.ops import registry
from macs_kernels.ops.backends import NAMESPACE, OPS
from tests.ops.cases import DEVICE, backends

B, H, H_KV, S, D, R = 3, 6, 2, 41, 16, 2  # GQA 3:1, odd sizes


def _data():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, D, generator=generator)
    block = torch.randn(B, H, R, D, generator=generator)
    k, v = torch.randn(2, B, H_KV, S, D, generator=generator)
    pages = k.view(B, H_KV, S, D)[:, :, :40].reshape(B, H_KV, 5, 8, D).permute(0, 2, 3, 1, 4).reshape(B * 5, 8, H_KV, D)
    table = torch.arange(B * 5, dtype=torch.int32).view(B, 5)
    return {name: value.to(DEVICE) for name, value in dict(q=q, block=block, k=k, v=v, pages=pages,
                                                           table=table).items()}


def _ranges(dtype, strided=False):
    values = {"start": [0, 4, 9], "end": [20, 30, 12], "length": [33, 40, 25]}
    ranges = {}
    for name, row in values.items():
        index = torch.tensor(row, dtype=dtype, device=DEVICE)
        # A column of a wider tensor: what a caller slicing its own metadata holds.
        ranges[name] = torch.stack([index, index], dim=1)[:, 0] if strided else index
    # A verify block's own length per row (B, R).
    rows = torch.stack([ranges["length"] - 1, ranges["length"]], dim=1)
    ranges["row_length"] = torch.stack([rows, rows], dim=-1)[..., 0] if strided else rows
    return ranges


def _calls(data, ranges):
    """name -> (a public call with these ranges, the state it writes); validate=False: device tensors' default,
    checks of no value."""
    start, end, length = ranges["start"], ranges["end"], ranges["length"]
    pooled = dict(input_start=start, input_end=end, kv_len=length, scale=0.25, validate=False)
    q, k, v = data["q"], data["k"], data["v"]
    state = {name: torch.zeros(B, *shape, 32, device=DEVICE) for name, shape in (
        ("decode_attention_fused", ()), ("macs_pool", ()), ("macs_pool_rows", (R,)), ("macs_pool_verify", (R,)),
        ("macs_pool_paged", ()),
        ("macs_update", ()), ("macs_pool_window", ()))}
    calls = {
        "decode_attention": lambda **kw: ops.decode_attention(q, k, v, kv_len=length, scale=0.25, validate=False,
                                                              **kw),
        "decode_attention_fused": lambda **kw: ops.decode_attention(
            q, k, v, kv_start=start, kv_len=length, input_end=end, scale=0.25, log_c=state["decode_attention_fused"],
            validate=False, **kw),
        "macs_pool": lambda **kw: ops.macs_pool(q, k, out=state["macs_pool"], **pooled, **kw),
        "macs_pool_rows": lambda **kw: ops.macs_pool(data["block"], k, out=state["macs_pool_rows"], **pooled, **kw),
        # The (B,) input range broadcast over the rows beside their own lengths: each range read with its strides.
        "macs_pool_verify": lambda **kw: ops.macs_pool(
            data["block"], k, out=state["macs_pool_verify"], **(pooled | {"kv_len": ranges["row_length"]}), **kw),
        "macs_pool_paged": lambda **kw: ops.macs_pool(q, data["pages"], block_table=data["table"],
                                                      out=state["macs_pool_paged"], **pooled, **kw),
        "macs_update": lambda **kw: ops.macs_update(q, k, state["macs_update"], **pooled, **kw),
        "macs_pool_window": lambda **kw: ops.macs_pool(q, k, out=state["macs_pool_window"], window=16, **pooled,
                                                       **kw),
    }
    return {name: (call, state.get(name)) for name, call in calls.items()}


# The aten ops a call runs besides its kernel: a window's first attended key (kv_len - window, then the max with
# input_start); nothing else.
EXTRA_OPS = {"macs_pool_window": ["aten.sub.Tensor", "aten.maximum.default"]}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("call", list(_calls(_data(), _ranges(torch.int64))))
def test_a_public_call_launches_nothing_but_its_kernel(call, dtype, on_device, monkeypatch):
    run, _ = _calls(_data(), _ranges(dtype))[call]
    # A first call makes what later calls reuse: the zeros of a default start and, on a GPU, the chosen backend's
    # self-check, which runs the kernel against the torch path (it ran 4 more kernels where it came here).
    run()
    ran = []
    monkeypatch.setattr(registry, "implementation", lambda backend, op: lambda *args, **kwargs: ran.append(op))
    run()
    with AtenOps() as counted:
        run()
    assert len(ran) == 2
    assert counted.launches == EXTRA_OPS.get(call, [])


def _results(call, backend):
    """What the call returns and the state it writes, as one list."""
    run, state = call
    returned = run(backend=backend)
    returned = returned if isinstance(returned, tuple) else (returned,)
    return [t.clone() for t in (*returned, state) if t is not None]


# Each call's op, whose backends run it.
CALL_OPS = {"decode_attention": "decode_attention", "decode_attention_fused": "decode_attention",
            "macs_pool": "macs_pool", "macs_pool_rows": "macs_pool", "macs_pool_verify": "macs_pool",
            "macs_pool_paged": "macs_pool_paged",
            "macs_update": "macs_update", "macs_pool_window": "macs_pool"}


@pytest.mark.parametrize("call, backend", [
    pytest.param(call, *backend.values, marks=backend.marks, id=f"{call}-{backend.id}")
    for call, op in CALL_OPS.items() for backend in backends(op)])
def test_index_widths_and_strides_give_the_same_results_bit_for_bit(call, backend):
    data = _data()
    want = _results(_calls(data, _ranges(torch.int64))[call], backend)
    assert want and all(t.abs().sum() > 0 for t in want)
    for dtype, strided in ((torch.int32, False), (torch.int32, True), (torch.int64, True)):
        got = _results(_calls(data, _ranges(dtype, strided))[call], backend)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (dtype, strided)


def test_operators_dispatch_to_their_kernels_without_python_wrappers():
    """torch.library.custom_op's Python autograd and ADInplaceOrView kernels cost about 50 us a call of a mutating op
    on these CPUs (ops/library.py, benchmarks/bench_checks.py): the operators have none, and the torch path is their
    kernel on every device without one of its own."""
    for op in OPS:
        name = f"{NAMESPACE}::{op}"
        for key in ("Autograd", "AutogradCUDA", "AutogradCPU", "ADInplaceOrView"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (op, key)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"), op


def _verify_block_ranges():
    """A verify pass's ranges as the engines hold them (core/plans.DenseRows): each item's input range (B,) broadcast
    over its R rows (stride 0), its own kv_len per row (B, R)."""
    start, end = (torch.tensor(values, device=DEVICE) for values in ([0, 4, 9], [20, 30, 12]))
    kv_len = torch.tensor([[33, 34], [39, 40], [24, 25]], device=DEVICE)
    return start[:, None].expand(-1, R), end[:, None].expand(-1, R), kv_len


@pytest.mark.parametrize("backend", backends("macs_pool"))
def test_a_pooled_rows_kernel_reads_each_range_with_its_own_strides(backend):
    """As the engines call the kernels (registry.implementation, no public op): broadcast input ranges beside
    per-row lengths give what contiguous copies give (Triton read every range with the first one's strides at
    47696d8, so each row took its item's first length)."""
    data = _data()
    pool = registry.implementation(backend, "macs_pool")
    got, want = (torch.zeros(B, R, 32, device=DEVICE) for _ in range(2))
    start, end, kv_len = _verify_block_ranges()
    pool(data["block"], data["k"], got, start, end, kv_len, 0.25, "max", True, None)
    pool(data["block"], data["k"], want, start.contiguous(), end.contiguous(), kv_len, 0.25, "max", True, None)
    assert want.abs().sum() > 0 and torch.equal(got, want)


@pytest.mark.parametrize("backend", backends("macs_update_rows"))
def test_a_row_update_kernel_reads_a_column_of_the_lengths(backend):
    """The engines' efficient-attention rows update with kv_len = the last column of their (B, R) lengths (stride R):
    the generated mass is summed up to each item's own length."""
    start, end, kv_len = _verify_block_ranges()
    rows = torch.softmax(torch.randn(B, H, S, generator=torch.Generator().manual_seed(5)), -1).to(DEVICE)
    update = registry.implementation(backend, "macs_update_rows")
    got, want = (torch.zeros(B, 32, device=DEVICE) for _ in range(2))
    update(rows, got, start[:, 0].contiguous(), end[:, 0].contiguous(), kv_len[:, -1], 0.8, "max", True)
    update(rows, want, start[:, 0].contiguous(), end[:, 0].contiguous(), kv_len[:, -1].contiguous(), 0.8, "max", True)
    assert want.abs().sum() > 0 and torch.equal(got, want)


def test_a_last_dimension_with_another_stride_is_refused_naming_the_tensor():
    data = _data()
    q = torch.stack([data["q"], data["q"]], dim=-1)[..., 0]
    with pytest.raises(ValueError, match=r"q must have unit stride in its last dimension, got strides \(192, 32, 2\)"):
        ops.decode_attention(q, data["k"], data["v"], kv_len=S, scale=0.25)


@pytest.mark.parametrize("backend", backends("macs_update"))
def test_a_last_dimension_of_one_element_is_taken_whatever_its_stride(backend):
    """torch calls a (B, 1) tensor with strides (1, B) contiguous (a transposed row): the public op's check and the
    cuda launchers' take it, and every kernel updates its one column at offset 0."""
    data = _data()
    log_c = torch.zeros(1, B, device=DEVICE).t()
    assert log_c.stride() == (1, B) and log_c.is_contiguous()
    copy = log_c.clone(memory_format=torch.contiguous_format)
    start = torch.tensor([0, 4, 9], device=DEVICE)
    for state in (log_c, copy):
        ops.macs_update(data["q"], data["k"], state, input_start=start, input_end=start + 1, kv_len=[33, 40, 25],
                        scale=0.25, backend=backend)
    assert copy.abs().min() > 0 and torch.equal(log_c, copy)
