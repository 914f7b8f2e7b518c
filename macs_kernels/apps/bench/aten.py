"""A recorder of the aten ops a call runs, for the benchmarks and the op tests (a module of its own: importing torch
is what `macs-kernels --help` must not do)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only make views: no kernel launch.
VIEW_OPS = frozenset({"aten.view.default", "aten.unsqueeze.default", "aten.slice.Tensor", "aten.expand.default",
                      "aten.select.int", "aten.squeeze.dim"})


class AtenOps(TorchDispatchMode):
    """The aten ops run inside the mode, in order (`ops`); `launches`: those other than views, each at least one
    kernel launch on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> list[str]:
        return [op for op in self.ops if op not in VIEW_OPS]
