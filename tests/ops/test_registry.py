"""The registry's default backend (issue 42, point 4): the fastest correct backend for how the pass runs. No GPU is
needed: which backends can run here and what their self-checks say are monkeypatched; the detection of a
compiled pass runs under torch.compile on the CPU."""
from __future__ import annotations

import warnings

import pytest
import torch

from macs_kernels.ops import registry

CUDA = torch.device("cuda")
OPS = ("macs_pool", "decode_attention")


@pytest.fixture
def machine(monkeypatch):
    """A CUDA machine on which the backends in `available` run and those in `wrong` fail their self-check."""
    state = {"available": {"cuda", "triton", "torch"}, "wrong": set(), "checks": []}
    monkeypatch.setattr(registry, "_verdicts", {})
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.setattr(registry, "device_key", torch.device)

    def why_unavailable(name, device, op=None):
        if name not in state["available"]:
            return "absent here"
        return None if name != "numba" or op in registry.declared("numba").ops else "numba has the paged op only"

    monkeypatch.setattr(registry, "why_unavailable", why_unavailable)

    def compare(backend, device, op):
        state["checks"].append((backend, op))
        return "it differs" if backend in state["wrong"] else None

    monkeypatch.setattr(registry, "_compare", compare)
    return state


@pytest.mark.parametrize("available, eager, captured", [
    ({"cuda", "triton", "torch"}, "cuda", "triton"),
    ({"triton", "torch"}, "triton", "triton"),
    ({"cuda", "torch"}, "cuda", "cuda"),
    ({"torch"}, "torch", "torch"),
])
def test_the_default_on_cuda_follows_how_the_pass_runs(machine, available, eager, captured):
    machine["available"] = available
    assert registry.default_backend(CUDA, OPS, captured=False) == eager
    assert registry.default_backend(CUDA, OPS, captured=True) == captured
    assert registry.resolve_backend(None, CUDA, "macs_pool", True) == captured


@pytest.mark.parametrize("wrong, eager, captured", [
    ({"triton"}, "cuda", "cuda"),
    ({"cuda"}, "triton", "triton"),
    ({"cuda", "triton"}, "torch", "torch"),
])
def test_a_backend_failing_its_self_check_is_passed_over(machine, wrong, eager, captured):
    machine["wrong"] = wrong
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert registry.default_backend(CUDA, OPS, captured=False) == eager
        assert registry.default_backend(CUDA, OPS, captured=True) == captured
    failed = sorted({str(w.message).split()[2] for w in record if "failed its self-check" in str(w.message)})
    assert failed == sorted(wrong)


def test_cpu_runs_torch_and_numba_only_for_the_paged_op(machine):
    machine["available"] = {"numba", "triton", "torch"}  # triton in the interpreter: never a default
    cpu = torch.device("cpu")
    for captured in (False, True):
        assert registry.default_backend(cpu, OPS, captured) == "torch"
        assert registry.default_backend(cpu, ("macs_pool_paged",), captured) == "numba"
    machine["available"] = {"triton", "torch"}
    assert registry.default_backend(cpu, ("macs_pool_paged",), True) == "torch"


def test_a_named_backend_is_kept_whatever_the_pass(machine):
    machine["wrong"] = {"cuda"}
    with pytest.warns(RuntimeWarning, match="cuda backend's macs_pool failed its self-check.*named explicitly"):
        assert registry.resolve_backend("cuda", CUDA, "macs_pool", True) == "cuda"
    machine["available"] = {"torch"}
    with pytest.raises(registry.BackendUnavailable, match="backend 'triton' is unavailable: absent here"):
        registry.resolve_backend("triton", CUDA, "macs_pool", False)


@pytest.mark.parametrize("inside", ["capture", "compilation"])
def test_inside_a_cuda_graph_capture_or_a_compilation_no_self_check_runs(machine, monkeypatch, inside):
    """A self-check reads results on the host, which a capture forbids and a compiled region would record: a
    backend whose verdict is unknown is passed over with a warning saying how to have it; one checked before the
    capture or compilation is taken."""
    if inside == "capture":
        monkeypatch.setattr(registry, "_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    registry._verdicts.update({("cuda", "cuda", op): None for op in OPS})
    with pytest.warns(RuntimeWarning, match="triton backend is passed over in this CUDA graph capture or "
                                            "compilation.*captured=True"):
        assert registry.default_backend(CUDA, OPS, captured=True) == "cuda"
    assert machine["checks"] == []
    registry._verdicts.update({("triton", "cuda", op): None for op in OPS})
    assert registry.default_backend(CUDA, OPS, captured=True) == "triton"
    assert machine["checks"] == []


def test_a_compiled_pass_is_told_from_an_eager_one(monkeypatch):
    """captured_pass() is what the public ops hand the registry: under torch.compile the compiled code keeps the
    captured choice, eagerly the eager one (here: torch eagerly, the Triton interpreter compiled)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(registry, "_verdicts", {})
    monkeypatch.setitem(registry.PREFERENCE, ("cpu", False), ("torch",))
    monkeypatch.setitem(registry.PREFERENCE, ("cpu", True), ("triton", "torch"))

    def chosen(x):
        backend = registry.resolve_backend(None, x.device, "macs_zscore", registry.captured_pass())
        return x + (1.0 if backend == "triton" else 0.0)

    x = torch.zeros(2)
    torch._dynamo.reset()
    try:
        assert chosen(x).tolist() == [0.0, 0.0]
        assert torch.compile(chosen, fullgraph=True, backend="eager")(x).tolist() == [1.0, 1.0]
    finally:
        torch._dynamo.reset()
    assert not registry.captured_pass()


@pytest.mark.parametrize("named, compiles, chosen, warned", [
    (None, {"triton", "torch"}, "triton", None),
    (None, {"torch"}, "torch", "triton"),  # Triton's kernels fail inside torch.compile: torch, one warning
    ("cuda", {"triton", "torch"}, "triton", "cuda"),  # cuda is never run by a compiled pass (issue 47)
    ("triton", {"torch"}, "torch", "triton"),
])
def test_a_compiled_pass_runs_kernels_that_compile_and_falls_back_with_one_warning(machine, monkeypatch, named,
                                                                                   compiles, chosen, warned):
    """A compiled generate never fails for a kernel that cannot compile inside it (issue 47): the registry compiles
    each candidate's per-layer kernels once (here faked) and takes the first that compiles and agrees."""
    pytest.importorskip("triton")
    compiled = []

    def compiled_compare(backend, device, op):
        compiled.append(backend)
        return None if backend in compiles else "it raised InductorError: fp64 loop-carried variable"

    monkeypatch.setattr(registry, "_compiled_compare", compiled_compare)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):  # verdicts are kept: the second choice compiles and warns nothing more
            assert registry.compiled_kernels(named, CUDA).backend == chosen
    messages = [str(w.message) for w in record if "compiled pass" in str(w.message)]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and f"the {warned} backend does not run in a compiled pass" in messages[0]
    assert "cuda" not in compiled  # the cuda kernels are refused before any compile


def test_a_kernel_found_registered_is_not_looked_up_again(monkeypatch):
    """The dispatcher's answer costs a public call about 4 us: a registration found is kept (the extension's last as
    long as the process), a missing one is asked again (the extension may load later)."""
    asked = []

    def has_kernel(name, key):
        asked.append(key)
        return key == "CUDA"

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", has_kernel)
    monkeypatch.setattr(registry, "_registrations", set())
    for _ in range(3):
        assert registry._registered("macs_pool", "CUDA") and not registry._registered("macs_pool", "CPU")
    assert asked == ["CUDA", "CPU", "CPU", "CPU"]


def test_an_eager_public_call_reuses_its_choice_until_what_it_read_changes(monkeypatch):
    """The choice costs a public call about 3 us of host time (issue 48): an eager call keeps it per (backend named,
    device, op, captured) until a verdict is added, the verdicts are replaced or a registration is found; a choice that
    added verdicts itself (a named backend's first self-check) is kept from the next call."""
    from macs_kernels import ops

    monkeypatch.setattr(registry, "_choices", {})
    monkeypatch.setattr(registry, "_verdicts", {})
    chosen = []
    resolve = registry.resolve_backend
    monkeypatch.setattr(registry, "resolve_backend", lambda *args: chosen.append(args) or resolve(*args))
    log_c = torch.randn(2, 5)
    c = log_c[0].exp()

    def calls(**options):
        before = len(chosen)
        for _ in range(3):
            z = ops.macs_zscore(log_c, [5, 4], **options)[0]
            torch.testing.assert_close(z, (c - c.mean()) / c.std(correction=0))
        return len(chosen) - before

    assert calls() == 1
    assert calls() == 0
    assert calls(backend="torch") == 2 and ("torch", "cpu", "macs_zscore") in registry._verdicts
    assert calls(backend="torch") == 0
    monkeypatch.setitem(registry._verdicts, ("triton", "cuda:7", "macs_zscore"), None)
    assert calls() == 1
    monkeypatch.setattr(registry, "_verdicts", dict(registry._verdicts))
    assert calls() == 1
    monkeypatch.setattr(registry, "_registrations", registry._registrations | {("macs_zscore", "XLA")})
    assert calls() == 1
    monkeypatch.setattr(registry, "_stream_capturing", lambda: True)
    assert calls() == 1 and chosen[-1][-1] is True
    assert calls() == 0
