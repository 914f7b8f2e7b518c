"""A Triton driver that launches nothing: Triton's whole host path (binding and specialising the arguments, compiling
for a real GPU target with ptxas, the launcher call) on a machine without a GPU, so that what a launch costs the host,
and which compiled kernel it calls with which arguments, can be measured and tested here (issue 48: a public op's
eager host time). The kernels must be real JITFunctions: import them with TRITON_INTERPRET unset or 0, after
`activate()`.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from collections.abc import Iterator

import torch

# What a launcher records: (kernel name, compiled kernel's hash, grid, stream, function handle, packed metadata,
# arguments).
Launch = tuple[str, str, tuple[int, int, int], int, int, tuple, tuple]


@dataclasses.dataclass
class NullDriver:
    """Stands in for Triton's CUDA driver on device 0: kernels compile for sm_<arch> and load nowhere, each under a
    function handle of its own; each launch is appended to `launches` (and runs the launch hooks it is given, as
    Triton's launcher does) instead of running. `stream` is the current stream a launch should go to. `keep`: how
    many of the last launches `launches` holds (None: all). A timing loop keeps few: every record holds its
    arguments, and tens of thousands of them make Python's full garbage collections pause the loop for 0.2 s each."""

    arch: int = 90
    stream: int = 0
    keep: int | None = None
    launches: collections.deque[Launch] = dataclasses.field(init=False)

    def __post_init__(self):
        self.launches = collections.deque(maxlen=self.keep)
        self.utils = _NullUtils()

    def launcher_cls(self, src, metadata):
        def launcher(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook,
                     exit_hook, *args):
            for hook in (enter_hook, exit_hook):
                if hook is not None:
                    hook(launch_metadata)
            self.launches.append((metadata.name, metadata.hash, (grid_0, grid_1, grid_2), stream, function,
                                  tuple(packed_metadata), args))
        return launcher

    @staticmethod
    def is_active() -> bool:
        return True

    @staticmethod
    def get_current_device() -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return self.stream

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    @staticmethod
    def get_active_torch_device() -> torch.device:
        return torch.device("cpu")


class _NullUtils:
    """An H200's limits (what `CompiledKernel` checks before its first launch); each binary loads as a new handle."""

    def __init__(self):
        self._handles = itertools.count(1)

    @staticmethod
    def get_device_properties(device) -> dict:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def load_binary(self, name, kernel, shared, device):
        handle = next(self._handles)
        return handle, handle, 128, 0, 1024  # module, function, registers, spills, threads per block


@contextlib.contextmanager
def activate(arch: int = 90, keep: int | None = None) -> Iterator[NullDriver]:
    """Triton's active driver is a NullDriver (`arch`, `keep`) inside the context."""
    from triton.runtime.driver import driver

    # Read without making the default driver, which fails on a machine without a GPU: Triton >= 3.6 keeps it in
    # `_active` behind a property (None until made), 3.4-3.5 in `active` behind a lazy proxy.
    state = vars(driver)
    previous = state["_active"] if "_active" in state else state["active"]
    null = NullDriver(arch, keep=keep)
    driver.set_active(null)
    try:
        yield null
    finally:
        driver.set_active(previous)
