"""The cuda backend's fused ops run under every one of its split kernels (ops.cuda.CUDA_SPLIT_KV_KERNELS: "verified"
and "mma" besides the default): the tests of the modules below that take a `backend` run once more with backend
"cuda" per other kernel. `on_device`: index tensors as the argument checks see a GPU's."""
from __future__ import annotations

import pytest

from macs_kernels.ops import _checks, why_unavailable
from macs_kernels.ops.cuda import (
    CUDA_SPLIT_KV_DEFAULT,
    CUDA_SPLIT_KV_KERNELS,
    cuda_split_kv_kernel,
    set_cuda_split_kv_kernel,
)
from tests.ops.cases import CUDA_BACKEND_DEVICE

FUSED_OP_MODULES = {
    "test_decode_attention", "test_macs_update", "test_macs_pool", "test_macs_pool_paged", "test_variants",
    "test_properties", "test_call_cost", "test_out_of_range_values",
}


# The split kernels other than the default, where the cuda backend runs (a GPU, or its emulation on the CPU).
CUDA_OTHER_KERNELS = () if why_unavailable("cuda", CUDA_BACKEND_DEVICE) else tuple(
    kernel for kernel in CUDA_SPLIT_KV_KERNELS if kernel != CUDA_SPLIT_KV_DEFAULT)


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "backend" in metafunc.fixturenames and module in FUSED_OP_MODULES and CUDA_OTHER_KERNELS:
        metafunc.parametrize("cuda_split_kv", (CUDA_SPLIT_KV_DEFAULT, *CUDA_OTHER_KERNELS), indirect=True)


def pytest_collection_modifyitems(config, items):
    """Another split kernel changes only what the cuda backend runs: drop its copies of the other backends' tests
    (tests without a `backend` parameter choose their kernel themselves)."""
    redundant = [item for item in items if getattr(item, "callspec", None) is not None
                 and "backend" in item.callspec.params
                 and item.callspec.params.get("cuda_split_kv", CUDA_SPLIT_KV_DEFAULT) != CUDA_SPLIT_KV_DEFAULT
                 and item.callspec.params.get("backend") != "cuda"]
    if redundant:
        config.hook.pytest_deselected(items=redundant)
        items[:] = [item for item in items if item not in redundant]


@pytest.fixture(autouse=True)
def cuda_split_kv(request):
    """The cuda split kernel a test runs (the process's choice unless parametrized)."""
    kernel = getattr(request, "param", None)
    if kernel is None:
        yield None
        return
    previous = cuda_split_kv_kernel()
    set_cuda_split_kv_kernel(kernel)
    yield kernel
    set_cuda_split_kv_kernel(previous)


@pytest.fixture
def on_device(monkeypatch):
    """Index tensors as the checks see device tensors: values not on the host."""
    monkeypatch.setattr(_checks, "on_host", lambda *tensors: False)
    monkeypatch.delenv("MACS_KERNELS_VALIDATE", raising=False)
