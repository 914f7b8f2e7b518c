"""The triton backend's fused ops run under every one of its fused passes
(ops.triton.settings.TRITON_SPLIT_KV_PASSES): the tests of the modules below that take a `backend` run once more with
backend "triton" per pass other than the default ("two-launch", "one-launch"). `on_device`: index tensors as the
argument checks see a GPU's."""
from __future__ import annotations

import pytest

from macs_kernels.ops import _checks

try:  # the triton backend's package, where triton is installed
    from macs_kernels.ops.triton import settings
except ImportError:
    settings = None

FUSED_OP_MODULES = {
    "test_decode_attention", "test_macs_update", "test_macs_pool", "test_macs_pool_paged", "test_variants",
    "test_properties", "test_call_cost", "test_out_of_range_values",
}


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if settings is not None and "backend" in metafunc.fixturenames and module in FUSED_OP_MODULES:
        metafunc.parametrize("triton_split_kv", settings.TRITON_SPLIT_KV_PASSES, indirect=True)


def pytest_collection_modifyitems(config, items):
    """Another pass changes only what the triton backend runs: drop its copies of the other backends' tests."""
    redundant = [item for item in items if getattr(item, "callspec", None) is not None
                 and item.callspec.params.get("triton_split_kv", "verified") != "verified"
                 and item.callspec.params.get("backend") != "triton"]
    if redundant:
        config.hook.pytest_deselected(items=redundant)
        items[:] = [item for item in items if item not in redundant]


@pytest.fixture(autouse=True)
def triton_split_kv(request):
    """The triton fused pass a test runs (the default unless parametrized)."""
    if settings is None:
        yield None
        return
    previous = settings.triton_split_kv_pass()
    settings.set_triton_split_kv_pass(getattr(request, "param", previous))
    yield settings.triton_split_kv_pass()
    settings.set_triton_split_kv_pass(previous)


@pytest.fixture
def on_device(monkeypatch):
    """Index tensors as the checks see device tensors: values not on the host."""
    monkeypatch.setattr(_checks, "on_host", lambda *tensors: False)
    monkeypatch.delenv("MACS_KERNELS_VALIDATE", raising=False)
