"""Backend choice and the backend self-check (issue 15, "Unverified GPU paths"), wherever Triton runs (the
interpreter on a CPU, the GPU on a CUDA machine): the triton backend can be made a candidate of the automatic
choice and its kernels made wrong by monkeypatching."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import registry, verify
from macs_kernels.ops.backends import cuda_emulated
from tests.ops.cases import DEVICE, random_qk

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
CPU = torch.device("cpu")
HERE = torch.device(DEVICE)  # where the triton backend runs


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """An empty self-check cache, as in a new process."""
    monkeypatch.setattr(registry, "_verdicts", {})
    monkeypatch.setattr(registry, "_warned", set())


@pytest.fixture
def triton_backend():
    """The triton backend's module (skips where triton is not installed)."""
    pytest.importorskip("triton")
    import macs_kernels.ops.triton as backend

    return backend


@pytest.fixture
def triton_is_a_candidate(monkeypatch, fresh_verdicts, triton_backend):
    """The automatic choice tries triton before torch (on a CPU, the interpreter)."""
    monkeypatch.setitem(registry.PREFERENCE, (HERE.type, False), ("triton", "torch"))


@pytest.fixture
def wrong_triton_zscore(monkeypatch, triton_backend):
    original = triton_backend.macs_zscore
    monkeypatch.setattr(triton_backend, "macs_zscore", lambda log_c, n_input: original(log_c, n_input) * 1.01)


def test_automatic_choice_takes_a_backend_that_passes(triton_is_a_candidate):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert ops.verified_backend(None, HERE, ops=("macs_zscore", "macs_update")) == "triton"
    assert ops.self_check("triton", HERE, "macs_update") is None


def test_automatic_choice_falls_back_with_one_warning(triton_is_a_candidate, wrong_triton_zscore):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chosen = [ops.verified_backend(None, HERE, ops=("macs_update", "macs_zscore")),
                  ops.resolve_backend(None, HERE, "macs_zscore"),
                  ops.verified_backend(None, HERE, ops=("macs_zscore",))]
    assert chosen == ["torch"] * 3
    messages = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert len(messages) == 1
    assert re.search(rf"triton backend's macs_zscore failed its self-check on {HERE.type}[:\d]*: .*differs from the "
                     r"torch path by 0\.0\d+ .*falling back", messages[0])
    # The public op, with backend=None, runs the torch path: exact z-scores, not 1% off.
    log_c = torch.randn(2, 7, device=HERE)
    torch.testing.assert_close(ops.macs_zscore(log_c, [7, 3]), ops.macs_zscore(log_c, [7, 3], backend="torch"))
    # The other ops still pass: the verdict is per op.
    assert ops.verified_backend(None, HERE, ops=("macs_update",)) == "triton"


def test_an_explicit_backend_is_kept_but_its_check_is_reported(fresh_verdicts, wrong_triton_zscore):
    log_c = torch.randn(2, 7, device=HERE)
    with pytest.warns(RuntimeWarning, match="macs_zscore failed its self-check.*named explicitly"):
        z = ops.macs_zscore(log_c, [7, 3], backend="triton")
    torch.testing.assert_close(z, ops.macs_zscore(log_c, [7, 3], backend="torch") * 1.01)


def test_a_backend_that_raises_fails_its_check(triton_is_a_candidate, triton_backend, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(triton_backend, "decode_attention", broken)
    with pytest.warns(RuntimeWarning, match="decode_attention failed its self-check.*raised RuntimeError: no kernel"):
        assert ops.verified_backend(None, HERE) == "torch"


def test_self_check_catches_a_wrong_pooled_decode(fresh_verdicts, triton_backend, monkeypatch):
    """decode_attention is checked in both fused modes: a kernel wrong only in the pooled mode fails."""
    original = triton_backend.decode_attention

    def wrong_pooled(*args):
        result = original(*args)
        if args[11] is not None:
            args[11].mul_(1.001)
        return result

    monkeypatch.setattr(triton_backend, "decode_attention", wrong_pooled)
    assert "differs from the torch path" in ops.self_check("triton", HERE, "decode_attention")


def test_verdicts_are_cached_per_process_and_device(fresh_verdicts, triton_backend, monkeypatch):
    calls = []
    compare = verify.compare
    monkeypatch.setattr(verify, "compare", lambda *args: calls.append(args) or compare(*args))
    for _ in range(3):
        assert ops.self_check("triton", HERE, "macs_zscore") is None
    assert len(calls) == 1
    assert ops.self_check("torch", HERE, "macs_zscore") is None and len(calls) == 1


def test_named_backend_that_cannot_run_raises():
    if cuda_emulated():  # the emulation runs the cuda backend on CPU tensors
        assert ops.verified_backend("cuda", CPU) == "cuda"
    else:
        with pytest.raises(ops.BackendUnavailable, match="cuda backend needs CUDA tensors"):
            ops.verified_backend("cuda", CPU)
    with pytest.raises(ValueError, match="unknown backend"):
        ops.resolve_backend("tpu", CPU)
    with pytest.raises(ValueError, match="unknown op"):
        ops.why_unavailable("torch", CPU, "macs_updat")


@pytest.mark.skipif(not cuda_emulated(), reason="MACS_KERNELS_CUDA_EMULATION is not set")
def test_the_cuda_emulation_is_there_when_asked_for():
    """With MACS_KERNELS_CUDA_EMULATION=1 the cuda backend runs on CPU tensors: a build that fails fails this run
    instead of skipping every cuda test."""
    assert registry.why_unavailable("cuda", CPU) is None


def test_cuda_backend_absent_without_extension():
    """Without macs_kernels._C the cuda backend is unavailable, naming the missing build."""
    try:
        import macs_kernels._C  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("macs_kernels._C is built here")
    if cuda_emulated():
        pytest.skip("MACS_KERNELS_CUDA_EMULATION=1: the cuda backend's kernels are the emulated build")
    reason = registry.why_unavailable("cuda", torch.device("cuda"), "macs_update")
    assert "macs_kernels._C is absent" in reason


@pytest.mark.parametrize(
    "available, expected",
    [({"cuda", "triton", "torch"}, "cuda"), ({"triton", "torch"}, "triton"), ({"torch"}, "torch")],
)
def test_automatic_choice_prefers_cuda_then_triton(monkeypatch, fresh_verdicts, available, expected):
    monkeypatch.setattr(registry, "why_unavailable",
                        lambda name, device, op=None: None if name in available else "absent")
    monkeypatch.setattr(registry, "self_check", lambda backend, device, op: None)
    monkeypatch.setattr(registry, "device_key", torch.device)
    assert ops.resolve_backend(None, torch.device("cuda")) == expected
    assert ops.resolve_backend(None, torch.device("cpu")) == "torch"


def test_launch_counter_counts_each_kernel(triton_backend):
    ops.verified_backend("triton", HERE, ops=("decode_attention", "macs_update", "macs_update_rows", "macs_zscore"))
    counts = triton_backend.LAUNCHES
    before = counts.copy()
    q, k = random_qk(1, 3, 1, 113, 64, torch.float32)
    log_c = torch.zeros(1, 50, device=HERE)
    ops.decode_attention(q, k, k, kv_len=113, scale=0.125, log_c=log_c, input_end=50, backend="triton")
    ops.macs_update(q, k, log_c, input_start=0, input_end=50, kv_len=113, scale=0.125, backend="triton")
    ops.macs_update_rows(torch.rand(1, 3, 113, device=HERE), log_c, input_start=0, input_end=50, kv_len=113,
                         backend="triton")
    ops.macs_zscore(log_c, [50], backend="triton")
    assert counts - before == {
        "_split_kv_kernel": 2, "_split_kv_combine_kernel": 2, "_pool_kernel": 3,
        "_generated_mass_kernel": 1, "_macs_zscore_kernel": 1,
    }


def test_self_check_launches_are_not_counted(fresh_verdicts, triton_backend):
    before = triton_backend.LAUNCHES.copy()
    assert ops.self_check("triton", HERE, "macs_update") is None
    assert triton_backend.LAUNCHES == before
