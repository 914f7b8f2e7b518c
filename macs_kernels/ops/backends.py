"""The backends, each declared once: its name, the devices its kernels take, the ops it implements, the ops whose
kernels take an attention variant, how its presence is probed and the module that holds its kernels (as vLLM
declares an attention backend with its capabilities). The registry (ops/registry.py), the ops' option check
(ops/_checks.py), the command line's --backend choices and the docs' backend table (docs/backends.md, from
`markdown_table()`) read these declarations and nothing else; adding a backend is its package plus one entry of
`DECLARED` (docs/architecture.md, "Adding a backend").

Imports no backend: each is imported only when asked for, so `import macs_kernels` needs neither triton nor numba
nor the compiled extension.
"""
from __future__ import annotations

import dataclasses
import os

NAMESPACE = "macs_kernels"
OPS = (
    "macs_update", "macs_update_rows", "macs_pool", "macs_pool_paged", "macs_zscore", "decode_attention",
    "attention_features", "efficient_attention",
)
# The ops a generation tracer calls per layer and step: what a backend must prove before it is chosen, and what a
# backend must implement for an engine (the command line's --backend) to run on it.
TRACER_OPS = ("macs_pool", "macs_update_rows", "macs_zscore", "decode_attention")
# The ops whose kernels can take an attention variant (ops.Variant: window, key_offset, softcap, sinks; optional
# arguments of the ops themselves).
VARIANT_OPS = ("macs_pool", "macs_pool_paged", "decode_attention")


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on these tensors."""


def triton_interpreted() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1): read before triton is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_emulated() -> bool:
    """Whether the cuda backend runs its kernels compiled for the CPU, on CPU tensors (MACS_KERNELS_CUDA_EMULATION=1,
    read before macs_kernels is imported; ops/cuda/emulation.py)."""
    return os.environ.get("MACS_KERNELS_CUDA_EMULATION", "0") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend's declaration.

    name: what `backend=` takes.
    devices: the device types its kernels take; None: any.
    ops: the ops it implements.
    variant_ops: those of `ops` whose kernels take an attention variant: the optional arguments score_start,
        softcap, sinks of the operator's schema (key slots; the public ops convert a window and key_offset with
        ops.Variant.key_slots). A public op refuses a variant for the others, naming the backend, before work.
    module: the module whose attribute `<op>` is the op's kernel (`op_modules` overrides it per op); None: the
        kernels are the operators `torch.ops.macs_kernels.<op>` that the compiled extension `requires` registers.
        Its optional attributes `macs_pool_dense`, `decode_attention_dense` (rows that attend every slot
        causally) and `uncounted()` (launches the self-check leaves out of a counter) are taken where present.
    requires: the module whose import proves the backend installed (its error is the reason it is not).
    missing: the reason given when `requires` cannot be imported ({error}: the import error).
    device_reason: the reason given for a device it does not take.
    interpreted: on other devices too while this returns True (Triton's interpreter).
    beams_module: the module of beam search's dense kernels (`beam_pool_dense`, `beam_decode_dense`), or None.
    reference: the backend every other is checked against (its self-check always passes); its kernels are the
        torch functions, so a row plan may score rows from probabilities it computes itself.
    summary: one line for the docs' table.
    """

    name: str
    devices: tuple[str, ...] | None
    ops: tuple[str, ...]
    variant_ops: tuple[str, ...]
    module: str | None
    requires: str | None
    missing: str
    device_reason: str
    summary: str
    op_modules: dict = dataclasses.field(default_factory=dict)
    interpreted: object = None  # Callable[[], bool] | None
    beams_module: str | None = None
    reference: bool = False

    def takes(self, device_type: str) -> bool:
        """Whether its kernels take tensors of `device_type` here."""
        return (self.devices is None or device_type in self.devices
                or (self.interpreted is not None and self.interpreted()))


DECLARED = (
    Backend(
        "torch", devices=None, ops=OPS, variant_ops=VARIANT_OPS, module="macs_kernels.ops.torch.backend",
        op_modules={"attention_features": "macs_kernels.ops.torch.features",
                    "efficient_attention": "macs_kernels.ops.torch.efficient"},
        requires=None, missing="", device_reason="", beams_module="macs_kernels.ops.torch.beams", reference=True,
        summary="vectorised PyTorch, any device: each operator's default kernel and the reference",
    ),
    Backend(
        "triton", devices=("cuda",), ops=OPS, variant_ops=VARIANT_OPS, module="macs_kernels.ops.triton",
        requires="macs_kernels.ops.triton", missing="triton could not be imported ({error})",
        device_reason="the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the interpreter)",
        interpreted=triton_interpreted,
        summary="Triton launchers (ops/triton/): GPUs, or the interpreter with TRITON_INTERPRET=1",
    ),
    Backend(
        "cuda", devices=("cuda",), ops=OPS, variant_ops=VARIANT_OPS, module=None,
        **(dict(requires="macs_kernels.ops.cuda.emulation",
                missing="the CUDA kernels could not be built for the CPU ({error})") if cuda_emulated() else
           dict(requires=f"{NAMESPACE}._C",
                missing=(f"the compiled extension {NAMESPACE}._C is absent ({{error}}); install on a machine with "
                         "CUDA torch and nvcc (pip install --no-build-isolation -e ., without "
                         "MACS_KERNELS_SKIP_CUDA_BUILD=1)"))),
        device_reason="the cuda backend needs CUDA tensors (or MACS_KERNELS_CUDA_EMULATION=1 for its CPU build)",
        interpreted=cuda_emulated,
        summary="the compiled extension's CUDA kernels (csrc/; their CPU emulation in ops/cuda/)",
    ),
    Backend(
        "numba", devices=("cpu",), ops=("macs_pool_paged",), variant_ops=("macs_pool_paged",),
        module="macs_kernels.ops.numba", requires="macs_kernels.ops.numba",
        missing="numba could not be imported ({error})", device_reason="the numba backend runs on CPU tensors",
        summary="numba (ops/numba/), CPUs: the paged op, which reads a serving engine's CPU cache in place",
    ),
)
BY_NAME = {backend.name: backend for backend in DECLARED}
NAMES = tuple(BY_NAME)
# The backends an engine can be told to run on (--backend): those implementing every op of the tracer.
ENGINE_BACKENDS = tuple(b.name for b in DECLARED if set(TRACER_OPS) <= set(b.ops))
# The backends whose kernels take every attention variant: a model with window, softcap or sink layers runs on them.
VARIANT_BACKENDS = tuple(b.name for b in DECLARED if set(VARIANT_OPS) <= set(b.variant_ops))


def declared(name: str) -> Backend:
    """The declaration of backend `name`; ValueError naming the choices for an unknown one."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {NAMES} or None") from None


def markdown_table() -> str:
    """The backends as Markdown (docs/backends.md embeds it; tests/ops/test_backends.py keeps the two equal)."""
    lines = ["| backend | devices | ops | ops with attention variants | engines (`backend=`) | what it is |",
             "|---|---|---|---|---|---|"]
    for b in DECLARED:
        ops = "all" if b.ops == OPS else ", ".join(b.ops)
        variants = "all of " + ", ".join(VARIANT_OPS) if b.variant_ops == VARIANT_OPS else ", ".join(b.variant_ops)
        devices = "any" if b.devices is None else ", ".join(b.devices)
        engines = "yes" if b.name in ENGINE_BACKENDS else "no (the paged op of serving engines)"
        lines.append(f"| `{b.name}` | {devices} | {ops} | {variants} | {engines} | {b.summary} |")
    return "\n".join(lines) + "\n"
