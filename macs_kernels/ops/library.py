"""The `torch.ops.macs_kernels` operators: declared straight on the dispatcher, as vLLM's
`direct_register_custom_op` declares its own.

`torch.library.custom_op` wraps each call in Python autograd and ADInplaceOrView kernels (argument defaults filled,
version counters bumped) that cost about 30 us of host time per call of a mutating op, ten times a dispatch; the
compiled extension's CUDA kernels sit behind them. Declared here, a call dispatches in C++ to the kernel
registered for its device: the torch function (CompositeExplicitAutograd, any device) or the extension's
(`TORCH_LIBRARY_IMPL(macs_kernels, CUDA, ...)`). The schema is inferred from the torch function's annotations;
torch.compile traces the operator through its fake kernel and functionalises the written arguments from the schema.
The ops take no gradients (attribution runs under inference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from macs_kernels.ops.backends import NAMESPACE

# Operators live as long as their library object.
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _returns_nothing(*args, **kwargs) -> None:
    return None


def define_operator(function: Callable, mutates_args: tuple[str, ...] = (), fake: Callable | None = None):
    """Declare `torch.ops.macs_kernels.<function's name>` with `function` (the torch path) as its kernel on every
    device that has no kernel of its own, and `fake` (default: returns nothing, for an op that only writes its
    `mutates_args`) as what torch.compile traces. Returns the operator."""
    name = function.__name__
    # pt2_compliant: opcheck passes on every operator (tests/ops/test_library_opcheck.py), as custom_op declared.
    _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates_args),
                    tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(name, function, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake or _returns_nothing, lib=_LIBRARY)
    return getattr(getattr(torch.ops, NAMESPACE), name)
