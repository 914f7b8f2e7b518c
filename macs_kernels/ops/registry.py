"""Which kernels run here: the one answer for (backend, device, variants, op), for the public ops and the engines.

The table (backend x op -> the function that computes it) is read from the backends' declarations
(ops/backends.py: devices, ops, variant support, availability probe, module), with no branch on a backend's name:
torch's functions (also each operator's default kernel), Triton's launchers, the compiled extension's operators
`torch.ops.macs_kernels.<op>` (cuda) and numba's paged op (CPUs).

The choice: a backend named by the caller runs if it can (else BackendUnavailable); otherwise `default_backend`
takes the fastest backend for how the pass runs whose self-check against the torch path passes (verify.py). A
layer with an attention variant (window, softcap, sinks) runs on a backend whose kernels take it
(`variant_backend`). The engines take their per-layer kernels as one `Kernels` bundle from here.

Optional backends are imported only here and only when asked for, so `import macs_kernels` needs neither
triton nor the compiled extension. Every implementation takes the validated positional arguments of its
operator (keywords by the same names work too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import warnings
from collections.abc import Callable

import torch

from macs_kernels.ops import variant, verify
from macs_kernels.ops.backends import (
    NAMES,
    NAMESPACE,
    OPS,
    TRACER_OPS,
    VARIANT_BACKENDS,
    BackendUnavailable,
    declared,
)


@functools.cache
def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure means the backend is absent
        return f"{type(error).__name__}: {error}"
    return None


def _check_op(op: str | None) -> None:
    if op is not None and op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")


def device_key(device: torch.device | str) -> torch.device:
    """`device` with its index (the current CUDA device's for a bare "cuda"): verdicts are per physical device."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- the table ------------------------------------------------------------------------------------------
def why_unavailable(backend: str, device: torch.device | str, op: str | None = None) -> str | None:
    """None when `backend` can run `op` (any op when None) on `device`, else the reason in words (read from the
    backend's declaration, ops/backends.py)."""
    _check_op(op)
    spec, device = declared(backend), torch.device(device)
    if not spec.takes(device.type):
        return spec.device_reason
    if op is not None and op not in spec.ops:
        return f"the {backend} backend implements {spec.ops} only, not {op}"
    error = None if spec.requires is None else _import_error(spec.requires)
    if error is not None:
        return spec.missing.format(error=error)
    if spec.module is None:  # the extension's operators: each op's CUDA kernel registered or not
        key = "CUDA" if device.type == "cuda" else "CPU"  # CPU: the kernels' emulated build
        if op is not None and not _registered(op, key):
            return f"{spec.requires} registers no {key} kernel for {op}"
    return None


# (op, dispatch key) pairs found registered: a registration by the extension lasts as long as the process, and the
# lookup costs a public call more than the rest of the registry's answer (about 4 us).
_registrations: set[tuple[str, str]] = set()


def _registered(op: str, key: str) -> bool:
    if (op, key) not in _registrations:
        _module("macs_kernels.ops")  # defines the operators
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key):
            return False
        _registrations.add((op, key))
    return True


def _module(name: str):
    """The module `name`, imported on first use: looked up in sys.modules first, which torch.compile traces (it
    cannot trace an import)."""
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def implementation(backend: str, op: str) -> Callable:
    """The function that computes `op` on `backend` (arguments already validated)."""
    _check_op(op)
    spec = declared(backend)
    if op not in spec.ops:
        raise BackendUnavailable(f"the {backend} backend implements {spec.ops} only, not {op}")
    if spec.module is None:
        _module(spec.requires)
        return getattr(getattr(torch.ops, NAMESPACE), op)
    return getattr(_module(spec.op_modules.get(op, spec.module)), op)


# ---- the self-check's verdicts --------------------------------------------------------------------------
_verdicts: dict[tuple[str, str, str], str | None] = {}
_warned: set[tuple] = set()


def self_check(backend: str, device: torch.device | str, op: str) -> str | None:
    """None when `backend` computes `op` like the torch path on `device` (verify.compare), else the difference in
    words. Computed once per process, backend, device and op."""
    device = device_key(device)
    key = (backend, str(device), op)
    if key not in _verdicts:
        _verdicts[key] = None if declared(backend).reference else _compare(backend, device, op)
    return _verdicts[key]


def _compare(backend: str, device: torch.device, op: str) -> str | None:
    # The self-check's launches are not the caller's: Triton's launch counter leaves them out.
    module = declared(backend).module
    uncounted = None if module is None else getattr(_module(module), "uncounted", None)
    with contextlib.nullcontext() if uncounted is None else uncounted():
        return verify.compare(implementation(backend, op), implementation("torch", op), device, op)


def checked(backend: str, device: torch.device | str, op: str) -> bool:
    """Whether `self_check(backend, device, op)` is known without running it."""
    return declared(backend).reference or (backend, str(device_key(device)), op) in _verdicts


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"macs_kernels: {message}", RuntimeWarning, stacklevel=5)


def _warn_failed(backend: str, device: torch.device, op: str, difference: str, explicit: bool) -> None:
    outcome = "using it because it was named explicitly" if explicit else "falling back to the next backend"
    _warn_once((backend, str(device), op, explicit),
               f"the {backend} backend's {op} failed its self-check on {device}: {difference}; {outcome}")


# ---- the choice -----------------------------------------------------------------------------------------
# Backends the automatic choice tries, best first, per (device type, captured): see default_backend. Never the
# Triton interpreter (it is for tests, and thousands of times slower); any other device type runs torch.
PREFERENCE = {
    ("cuda", False): ("cuda", "triton", "torch"),
    ("cuda", True): ("triton", "cuda", "torch"),
    ("cpu", False): ("numba", "torch"),
    ("cpu", True): ("numba", "torch"),
}


def _stream_capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def captured_pass() -> bool:
    """Whether the calling code runs inside torch.compile's tracing or a CUDA graph capture: a pass whose kernel
    launches cost no host time when it replays."""
    return torch.compiler.is_compiling() or _stream_capturing()


def default_backend(device: torch.device | str, ops: tuple[str, ...] = TRACER_OPS, captured: bool = False) -> str:
    """The backend a caller that names none gets for `ops` on `device`: the fastest correct one for how the pass
    runs.

    - CUDA, a captured or compiled pass (torch.compile, a CUDA graph): triton, else cuda, else torch. Triton's
      kernels were 4-6x faster than the first CUDA split kernel (H200, issues 42/43), and capture removes the
      launch cost that is Triton's only handicap.
    - CUDA, an eager pass: cuda, else triton, else torch. Triton's per-launch host cost (about 0.3 ms per layer)
      dominates an eager decode step, which the CUDA kernels' lower launch cost wins.
    - CPU: torch (numba for the paged op, where installed: it reads a serving engine's cache in place).

    "Else" means: a backend that cannot run every op here, or whose self-check against the torch path fails for
    one of them (self_check, once per process, device and op), is skipped, the latter with one warning.
    Inside a CUDA graph capture or torch.compile's tracing a self-check cannot run (it reads results on the
    host): a backend whose verdict is not known yet is skipped with one warning; resolve before capturing or
    compiling (`resolve_backend(None, device, captured=True)`) to have it.
    """
    device = device_key(device)
    # Tracing a compiled region would record the self-check's host reads too: like a capture, it takes only
    # verdicts known before.
    capturing = device.type == "cuda" and (_stream_capturing() or torch.compiler.is_compiling())
    for candidate in PREFERENCE.get((device.type, captured), ("torch",)):
        if declared(candidate).reference:
            return candidate
        if any(why_unavailable(candidate, device, op) for op in ops):
            continue
        if capturing and not all(checked(candidate, device, op) for op in ops):
            _warn_once((candidate, str(device), "capture"), (
                f"the {candidate} backend is passed over in this CUDA graph capture or compilation on {device}: its "
                "self-check has not run and cannot run inside one; call macs_kernels.ops.resolve_backend(None, "
                "device, captured=True) before capturing or compiling"))
            continue
        failed = next(((op, diff) for op in ops if (diff := self_check(candidate, device, op)) is not None),
                      None)
        if failed is None:
            return candidate
        _warn_failed(candidate, device, *failed, explicit=False)
    return "torch"


def verified_backend(backend: str | None, device: torch.device | str, ops: tuple[str, ...] = TRACER_OPS,
                     captured: bool = False) -> str:
    """The backend to run `ops` on `device`.

    backend named: it, if it can run every op here (else BackendUnavailable); each op's self-check runs and
    a disagreement is warned about, but the named backend is kept. backend None: `default_backend` for how the
    pass runs (`captured`).
    """
    if backend is None:
        return default_backend(device, ops, captured)
    device = device_key(device)
    for op in ops:
        reason = why_unavailable(backend, device, op)
        if reason is not None:
            raise BackendUnavailable(f"backend {backend!r} is unavailable: {reason}")
    for op in ops:
        difference = self_check(backend, device, op)
        if difference is not None:
            _warn_failed(backend, device, op, difference, explicit=True)
    return backend


# The choice runs Python that torch.compile cannot trace (imports, self-checks): while tracing a public op it
# calls this eagerly and keeps the name returned (the compiled pass's choice: captured_pass() is True there).
@torch.compiler.assume_constant_result
def resolve_backend(backend: str | None, device: torch.device | str, op: str | None = None,
                    captured: bool = False) -> str:
    """The backend to run `op` (the tracer's ops when None) on `device` (see verified_backend)."""
    return verified_backend(backend, device, ops=TRACER_OPS if op is None else (op,), captured=captured)


# The backends eager public calls resolved, per (backend named, device, op, captured). The choice reads what changes
# only when a verdict is added or the verdicts replaced, or an operator's registration is found (the probes' import
# errors are kept for the process): with those unchanged it is the same, and asked again it would cost each public call
# about 3 us of host time (issue 48) against 0.3 for the lookup. Not watched: the preference table and the probes'
# functions (tests that patch them replace the verdicts too), a verdict overwritten in place.
_choices: dict[tuple, str] = {}
_choices_read: tuple = (None, -1, -1)


def _eager_choice(backend: str | None, device: torch.device, op: str, captured: bool) -> str:
    global _choices_read
    verdicts, decided, registered = _verdicts, len(_verdicts), len(_registrations)
    read = _choices_read
    if read[0] is not verdicts or read[1] != decided or read[2] != registered:
        _choices.clear()
        _choices_read = (verdicts, decided, registered)
    key = (backend, device, op, captured)
    resolved = _choices.get(key)
    if resolved is None:
        resolved = resolve_backend(backend, device, op, captured)
        # Kept only if nothing it reads changed while it chose: a first choice adds its self-checks' verdicts (the
        # next call keeps it), and another thread may add some meanwhile.
        if _verdicts is verdicts and len(_verdicts) == decided and len(_registrations) == registered:
            _choices[key] = resolved
    return resolved


def kernel(backend: str | None, device: torch.device, op: str, variant=None) -> Callable:
    """The kernel that runs `op` here for a public op's call (captured or not, as the call runs). With `variant`
    (an ops.Variant other than plain attention), refused before any work, naming the backend and the arguments,
    where the chosen backend's kernel of `op` takes no attention variant (its declaration's `variant_ops`)."""
    # torch.compile traces none of the lookup (its guards would be on the table's contents), nor a bare "cuda" (the
    # current device, which may change).
    if torch.compiler.is_compiling() or type(device) is not torch.device or device.index is None and (
            device.type == "cuda"):
        resolved = resolve_backend(backend, device, op, captured_pass())
    else:
        resolved = _eager_choice(backend, device, op, _stream_capturing())
    if variant is not None and not variant.plain and op not in declared(resolved).variant_ops:
        raise NotImplementedError(
            f"{op}: the {resolved} backend's kernel takes no attention variant ({', '.join(variant.arguments())} "
            f"given); use one of {tuple(b for b in NAMES if op in declared(b).variant_ops)}")
    return implementation(resolved, op)


def variant_backend(variants, named: str | None, resolved: str) -> str:
    """The backend that scores a model whose layers have attention variants (variant.LAYOUTS names such as
    "sliding_window"): the torch, Triton and CUDA kernels take a window, a softcap and sinks (VARIANT_BACKENDS), so
    an automatic choice of another falls back to torch and a named other backend is refused before work."""
    if not variants or resolved in VARIANT_BACKENDS:
        return resolved
    if named is not None:
        raise NotImplementedError(
            f"backend={named!r} has no kernels for {', '.join(variant.LAYOUTS[v] for v in variants)} yet; use one "
            f"of {VARIANT_BACKENDS} or leave backend unset"
        )
    return "torch"


def op_backend(named: str | None, device: torch.device | str, op: str) -> str | None:
    """The backend an engine passes to `op`: `named` where it has the op here, else None (the automatic choice,
    as when the cuda backend is named for efficient rows, which only torch and Triton compute)."""
    return named if named is not None and why_unavailable(named, device, op) is None else None


# ---- the engines' per-layer kernels ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernels:
    """A backend's per-layer kernels: the general ones (ops), special cases where the backend has them, and what
    its declaration says a row plan may do with them."""

    backend: str
    pool: Callable  # ops.macs_pool's kernel
    decode: Callable  # ops.decode_attention's kernel
    update_rows: Callable  # ops.macs_update_rows's kernel
    pool_dense: Callable | None  # rows that attend every slot causally: no mask, no gather
    decode_dense: Callable | None
    pool_paged: Callable  # ops.macs_pool_paged's kernel
    paged_backend: str  # pool_paged's backend: on CPUs a paged cache is read in place by numba's
    # The dense kernels of beam search reading each prompt's input keys once (beams=...), where the backend has them.
    pool_dense_beams: Callable | None = None
    decode_dense_beams: Callable | None = None
    # The backend is the reference (torch): a plan may score rows from probabilities it computes itself (per-row
    # options, probabilities shared with AT2's features); paged_reference: the same for the paged op's backend.
    reference: bool = False
    paged_reference: bool = False

    @staticmethod
    def of(backend: str, paged: str | None = None) -> Kernels:
        """`backend`'s kernels, the paged op's from `paged` (default: `backend`)."""
        spec, paged = declared(backend), paged or backend
        special = None if spec.module is None else importlib.import_module(spec.module)
        beams = None if spec.beams_module is None else importlib.import_module(spec.beams_module)
        return Kernels(
            backend, implementation(backend, "macs_pool"), implementation(backend, "decode_attention"),
            implementation(backend, "macs_update_rows"), getattr(special, "macs_pool_dense", None),
            getattr(special, "decode_attention_dense", None), implementation(paged, "macs_pool_paged"), paged,
            getattr(beams, "beam_pool_dense", None),
            getattr(beams, "beam_decode_dense", None), spec.reference, declared(paged).reference,
        )


def engine_kernels(named: str | None, device: torch.device | str, variants: tuple[str, ...] = (),
                   op: str | None = None, captured: bool = False) -> Kernels:
    """The per-layer kernels of an engine's pass on `device`: `named` (a MacsConfig's backend) or the default for
    `op` (the tracer's ops when None) and how the pass runs, then the variant rule for a model whose layers have
    `variants`."""
    return Kernels.of(variant_backend(variants, named, resolve_backend(named, device, op, captured)))


# Backends whose kernels a torch.compile'd pass does not run, and why. The cuda kernels are exact eagerly and in a
# CUDA graph, but inside an inductor-compiled decode step on an H200 they returned wrong rows at a 1,200-token
# prompt (issue 47), for a reason not yet found: until a GPU run shows them exact there, compiled passes skip them.
# Compiled for the CPU (ops/cuda/emulation.py) they are exact inside the same inductor-compiled steps, so the cause is
# in what the emulation does not model: mode "reduce-overhead"'s CUDA graphs, streams, the GPU's memory.
COMPILE_UNSAFE = {"cuda": "its kernels returned wrong rows inside an inductor-compiled decode step on a GPU "
                          "(issue 47)"}
# The kernels a compiled decode step runs per layer (core.plans.DenseRows).
COMPILED_OPS = ("macs_pool", "decode_attention")


def compiled_self_check(backend: str, device: torch.device | str) -> str | None:
    """None when `backend`'s per-layer kernels compile inside torch.compile (inductor, one graph) on `device` and
    agree with the torch path there (verify.compare on the compiled kernels), else why not. Once per process, backend
    and device; the torch path is plain torch code, which compiles wherever torch.compile does."""
    if declared(backend).reference:
        return None
    if backend in COMPILE_UNSAFE:
        return COMPILE_UNSAFE[backend]
    device = device_key(device)
    key = (backend, str(device), "compiled")
    if key not in _verdicts:
        _verdicts[key] = next((difference for op in COMPILED_OPS
                               if (difference := _compiled_compare(backend, device, op)) is not None), None)
    return _verdicts[key]


def _compiled_compare(backend: str, device: torch.device, op: str) -> str | None:
    compiled = torch.compile(implementation(backend, op), fullgraph=True, dynamic=False)
    return verify.compare(compiled, implementation("torch", op), device, op)


def compiled_kernels(named: str | None, device: torch.device | str, variants: tuple[str, ...] = ()) -> Kernels:
    """The per-layer kernels of a torch.compile'd pass on `device` (called eagerly, before the compiled steps run):
    `engine_kernels`' choice for a captured pass if its kernels compile and agree there (`compiled_self_check`), else
    the next backend that does, torch at the latest, with one warning naming why. A compiled generate never fails
    for a kernel that cannot compile inside it."""
    chosen = variant_backend(variants, named, resolve_backend(named, device, None, captured=True))
    fallbacks = (b for b in PREFERENCE.get((torch.device(device).type, True), ()) if b not in COMPILE_UNSAFE)
    for candidate in dict.fromkeys((chosen, *fallbacks, "torch")):
        if candidate not in (chosen, "torch") and (
                any(why_unavailable(candidate, device, op) for op in TRACER_OPS)
                or variant_backend(variants, None, candidate) != candidate
                or any(self_check(candidate, device, op) for op in TRACER_OPS)):
            continue
        reason = compiled_self_check(candidate, device)
        if reason is None:
            return Kernels.of(candidate)
        _warn_once((candidate, str(device_key(device)), "compiled"),
                   f"the {candidate} backend does not run in a compiled pass on {device}: {reason}; the compiled "
                   "steps run the next backend")
    raise AssertionError("the torch path compiles wherever torch.compile does")


def paged_kernels(device: torch.device | str, captured: bool = False) -> Kernels:
    """Kernels for a paged cache read in place on `device` (a serving engine's): the paged op's default backend
    (numba's on CPUs where installed, Triton's or CUDA's on GPUs once their self-check passes), torch's gather
    otherwise; the other ops on torch."""
    return Kernels.of("torch", paged=resolve_backend(None, device, "macs_pool_paged", captured))
