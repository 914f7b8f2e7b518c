"""The generate tracer's per-layer path reads no tensor value on the host (issue 42): on a CPU, every host read
(bool/int/float of a tensor, .item, .tolist, .cpu, .numpy, nonzero, a boolean-mask index: each a sync on a GPU)
inside the tracer's attention calls of a decode step is counted, and there are none; the per-layer scoring
compiles under torch.compile(fullgraph=True); on a GPU, CUDA's sync debug mode raises on any sync there."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from macs_kernels import attach
from macs_kernels.core.plans import DenseRows
from macs_kernels.ops import BACKENDS, Variant, why_unavailable
from macs_kernels.ops.registry import Kernels
from tests.helpers import tiny_llama

# Tensor methods that read values on the host, or give a shape that depends on them.
HOST_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "nonzero",
              "argwhere", "masked_select", "unique", "__array__"}


def _is_host_read(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in HOST_READS:
        return True
    if name == "to":
        return any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
    if name in ("__getitem__", "__setitem__"):  # a boolean mask index has a data-dependent shape
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostReads(TorchFunctionMode):
    """Records the host reads made while active, with the calling line."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_read(func, args, kwargs):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _watch_decode_steps(tracer, watch):
    """Run each attention call of the tracer's decode passes under `watch()` (a context manager yielding a list) and
    return {pass: what they recorded}. The first pass of a sequence (its per-sequence checks, host reads by design) is
    not watched: known before its layer 0 runs (the generate call's first pass is pending), and after it from the
    pass's plan."""
    attention, recorded = tracer.attention, {}

    def watched(module, *args, **kwargs):
        if tracer.call.start_pending or (module.layer_idx != 0 and tracer.prefill):
            return attention(module, *args, **kwargs)
        step = len(tracer.passes)
        with watch() as reads:
            result = attention(module, *args, **kwargs)
        recorded.setdefault(step, []).extend(reads)
        return result

    tracer.attention = watched
    return recorded


class _counted:
    def __enter__(self):
        self.mode = HostReads().__enter__()
        return self.mode.reads

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


GENERATIONS = {
    "padded": dict(prompts=([5, 9, 14, 20, 33, 41], [0, 0, 7, 8, 9, 10]), kwargs={}),
    "unpadded-dense": dict(prompts=([5, 9, 14, 20, 33, 41], [3, 4, 7, 8, 9, 10]), kwargs={}),
    "static-cache": dict(prompts=([5, 9, 14, 20, 33, 41], [0, 0, 7, 8, 9, 10]),
                         kwargs=dict(cache_implementation="static")),
    "beams": dict(prompts=([5, 9, 14, 20, 33, 41],), kwargs=dict(num_beams=2)),
}


def _generate(model, generation, backend, fused_decode, watch):
    prompts = GENERATIONS[generation]["prompts"]
    ids = torch.tensor(prompts, device=model.device)
    mask = (ids != 0).long()
    with torch.no_grad(), attach(model, backend=backend, fused_decode=fused_decode) as tracer:
        recorded = _watch_decode_steps(tracer, watch)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       **GENERATIONS[generation]["kwargs"])
    return recorded


# (generation, fused_decode): the torch backend's decode steps fused or through the wrapped attention.
WATCHED = [("padded", False), ("padded", True), ("unpadded-dense", False), ("unpadded-dense", True),
           ("static-cache", False), ("beams", False)]
WATCHED_IDS = [f"{generation}-{'fused' if fused else 'exact'}" for generation, fused in WATCHED]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("generation, fused_decode", WATCHED, ids=WATCHED_IDS)
def test_decode_steps_read_nothing_on_the_host(model, generation, fused_decode):
    recorded = _generate(model, generation, "torch", fused_decode, _counted)
    assert len(recorded) >= 3, "too few decode passes were watched"
    assert all(reads == [] for reads in recorded.values()), recorded


def test_the_counter_sees_a_host_read():
    """The counter is not blind: a host read inside a watched call is recorded (a range read on the host, as
    the public ops' CPU checks do)."""
    with _counted() as reads:
        index = torch.tensor([1, 2])
        bool(index.all()), index.tolist(), index[index > 1]
    assert reads == ["__bool__", "tolist", "__getitem__"]


def test_a_nan_row_inside_generate_still_fails_the_call(model):
    """The NaN check of generate's passes waits on the device and fails the call when generate returns."""
    broken = tiny_llama()
    with torch.no_grad():
        broken.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    ids = torch.tensor([[5, 9, 14, 20]])
    with pytest.raises(FloatingPointError, match="NaN in an attention row"):
        with torch.no_grad(), attach(broken):
            broken.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)


# ---- the per-layer scoring under torch.compile --------------------------------------------------------------

BATCH, HEADS, KV_HEADS, KEYS, DIM, LAYERS = 2, 4, 2, 16, 8, 2


def _scorer(rows, *, n_dense=None, beams=1):
    start = torch.tensor([0, 3]) if n_dense is None else torch.zeros(BATCH, dtype=torch.int64)
    end = torch.tensor([10, 8]) if n_dense is None else torch.full((BATCH,), n_dense)
    kv_len = (KEYS - rows + 1 + torch.arange(rows)).expand(BATCH, rows)
    return DenseRows(Kernels.of("torch"), LAYERS, input_start=start, input_end=end, kv_len=kv_len,
                     n_max=int((end - start).max()), pooling="max", redistribute=True, alpha=0.8, n_dense=n_dense,
                     beams=beams)


SCORINGS = {
    "pool": (dict(rows=1), "pool", {}),
    "pool-block": (dict(rows=3), "pool", {}),
    "pool-variant": (dict(rows=1), "pool", dict(variant=Variant(window=5, softcap=2.0, sinks=torch.randn(HEADS)))),
    "pool-dense": (dict(rows=1, n_dense=10), "pool", {}),
    "pool-dense-beams": (dict(rows=1, n_dense=10, beams=2), "pool", {}),
    "decode": (dict(rows=1), "decode", {}),
    "decode-variant": (dict(rows=1), "decode", dict(variant=Variant(window=5, softcap=2.0))),
    "decode-dense": (dict(rows=1, n_dense=10), "decode", {}),
}


@pytest.mark.parametrize("name", list(SCORINGS))
def test_per_layer_scoring_compiles_without_a_graph_break(name):
    """What the tracer runs per layer (DenseRows.pool / decode on the torch kernels) compiles whole and writes
    the same rows as eagerly."""
    options, method, extra = SCORINGS[name]
    rows = options["rows"]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, rows, DIM, generator=generator)
    k, v = (torch.randn(BATCH, KV_HEADS, KEYS, DIM, generator=generator) for _ in range(2))
    arguments = (q, k, 0.3) if method == "pool" else (q, k, v, 0.3)
    torch._dynamo.reset()
    eager, compiled = _scorer(**options), _scorer(**options)
    want = getattr(eager, method)(1, *arguments, **extra)
    got = torch.compile(functools.partial(getattr(compiled, method), 1, **extra), fullgraph=True,
                        backend="aot_eager")(*arguments)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled.pooled[1], eager.pooled[1])
    if method == "decode":
        torch.testing.assert_close(got, want)


# ---- on a GPU: no sync at all in a decode step's attention calls ----------------------------------------------

class _no_sync:
    """CUDA's sync debug mode set to raise while active."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")
        return []

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _gpu_backends():
    params = []
    for backend in (b for b in BACKENDS if b != "numba"):
        reason = "needs a CUDA device" if not torch.cuda.is_available() else why_unavailable(backend, "cuda")
        marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])
        params.append(pytest.param(backend, marks=marks, id=backend))
    return params


@pytest.mark.parametrize("generation, fused_decode", WATCHED, ids=WATCHED_IDS)
@pytest.mark.parametrize("backend", _gpu_backends())
def test_decode_steps_make_no_host_sync_on_a_gpu(backend, generation, fused_decode):
    recorded = _generate(tiny_llama().cuda(), generation, backend, fused_decode, _no_sync)
    assert len(recorded) >= 3, "too few decode passes were watched"
