"""The choice of backend for an op on a device (see _backends for what each backend is): a named backend, or
the best available one whose self-check against the torch path passes (verify)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._backends import (  # noqa: F401 - the dispatch API, re-exported
    NAMESPACE,
    OPS,
    TRACER_OPS,
    BackendUnavailable,
    candidates,
    implementation,
    triton_interpreted,
    variant_implementation,
    why_unavailable,
)
from .verify import verified_backend


# The choice runs Python that torch.compile cannot trace (imports, self-checks): while tracing a public op it
# calls this eagerly and keeps the name returned, the backend an eager call would have run.
@torch.compiler.assume_constant_result
def resolve_backend(backend: str | None, device: torch.device | str, op: str | None = None) -> str:
    """The backend to run `op` (the tracer's ops when None) on `device`.

    Named: that backend, raising BackendUnavailable if it cannot run here; its self-check against the
    torch path runs once per process and device and warns when it disagrees. None: the best available
    backend whose self-check passes (see verify.verified_backend).
    """
    return verified_backend(backend, device, ops=TRACER_OPS if op is None else (op,))


def kernel(backend: str | None, device: torch.device, op: str) -> Callable:
    """implementation(resolve_backend(backend, device, op), op): the kernel that runs `op` here."""
    return implementation(resolve_backend(backend, device, op), op)


def variant_kernel(backend: str | None, device: torch.device, op: str) -> Callable:
    """The kernel of `op` for a layer with an attention variant on the backend chosen here; refused, naming
    the backend, where it has none."""
    resolved = resolve_backend(backend, device, op)
    run = variant_implementation(resolved, op)
    if run is None:
        raise NotImplementedError(f"{op} with an attention variant has no kernel on backend {resolved!r}; use "
                                  "torch, triton or cuda")
    return run
