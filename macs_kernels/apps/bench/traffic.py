"""The bytes a call's kernels move, counted on a CPU: a memory chart by kernel and argument, as a GPU profiler draws
one, for machines without a GPU (issue 48: whether the fused MACS pass can take 1.10x its attention's time depends
first on the bytes it adds).

- `triton_traffic()`: every load, store and atomic of Triton's interpreter (TRITON_INTERPRET=1), each attributed to the
  launched kernel's tensor arguments whose elements its address is (in none of them: argument "(outside)").
- `cuda_traffic(tensors)`: the CUDA emulation's (MACS_KERNELS_CUDA_EMULATION=1) 16-byte asynchronous copies and plain
  loads and stores, attributed to the tensors named and to the buffers the launchers allocate and name (scratch,
  outputs). A kernel's accesses of one size and direction to one argument count as one access (its sectors are
  their distinct sectors).

And from the same records, what either backend's programmatic dependent launches would race on
(`cuda_dependent_hazards`, `triton_dependent_accesses`): a CPU runs a launch's grid after the one before it has
ended, where on a GPU a dependent's code before its wait runs beside it.

Per (kernel, argument) three figures each for reads and writes, which bound what DRAM moves:
- `read` / `written`: the bytes the accesses asked for;
- `read_distinct` / `written_distinct`: the bytes of distinct addresses over the whole count (every repeat served by
  the cache: the least DRAM can move);
- `read_sectors` / `written_sectors`: the 32-byte sectors each access touches, in bytes, summed over accesses (nothing
  served twice by the cache: the most). The interpreter runs a program's whole tile as one access, so the sectors a
  warp leaves partial and another warp of the program completes count once, as L1 merges them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import numpy
import torch

SECTOR_BYTES = 32
OUTSIDE = "(outside)"


@dataclasses.dataclass
class Counts:
    read: int = 0
    written: int = 0
    read_distinct: int = 0
    written_distinct: int = 0
    read_sectors: int = 0
    written_sectors: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


@dataclasses.dataclass(frozen=True)
class Region:
    """The bytes of one tensor argument's elements: its span, and where the span has holes (a strided view, K of a
    packed K/V cache) the sizes and strides that say which addresses in it are elements."""
    start: int
    end: int
    item_bytes: int
    dims: tuple[tuple[int, int], ...]  # (size, stride in elements), largest stride first; () when the span is dense

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Region:
        start = tensor.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        end = start + (last + 1) * tensor.element_size() if tensor.numel() else start
        dense = tensor.numel() * tensor.element_size() == end - start
        dims = () if dense else tuple(sorted(((size, stride) for size, stride in zip(tensor.shape, tensor.stride())
                                              if size > 1 and stride > 0), key=lambda dim: -dim[1]))
        return cls(start, end, tensor.element_size(), dims)

    def holds(self, addresses: numpy.ndarray) -> numpy.ndarray:
        held = (addresses >= numpy.uint64(self.start)) & (addresses < numpy.uint64(self.end))
        if not self.dims:
            return held
        offset = (addresses[held] - numpy.uint64(self.start)).astype(numpy.int64)
        element, ok = offset // self.item_bytes, offset % self.item_bytes == 0
        for size, stride in self.dims:  # a view of one buffer: each stride exceeds the extent of the smaller ones
            index = element // stride
            ok &= index < size
            element -= index * stride
        held[held] = ok & (element == 0)
        return held


def _distinct(values: numpy.ndarray) -> numpy.ndarray:
    """numpy.unique by sorting: numpy 2.4's hashing unique takes 20x a sort's time on millions of addresses."""
    values = numpy.sort(values, axis=None)
    return values[numpy.concatenate(([True], values[1:] != values[:-1]))] if values.size else values


class Traffic:
    """Counts by (kernel, argument), filled while its context is open; `total()` sums them. An address that is an
    element of several arguments (a tensor passed twice, a view inside another) counts for all of them together,
    under their names joined by "=" ("k=v")."""

    def __init__(self):
        self.counts: dict[tuple[str, str], Counts] = {}
        self._touched: dict[tuple, numpy.ndarray] = {}

    def record(self, kernel: str, regions: dict[str, Region], kind: str, addresses: numpy.ndarray,
               item_bytes: int) -> None:
        """One access of `kind` ("read" or "written"): `item_bytes` at each of `addresses` (uint64), attributed to the
        regions (name -> Region) whose elements hold them."""
        addresses = numpy.asarray(addresses, dtype=numpy.uint64).ravel()
        if addresses.size == 0:
            return
        low, high = int(addresses.min()), int(addresses.max())
        candidates = [(name, region) for name, region in regions.items()
                      if region.start <= high and region.end > low]
        owners = numpy.zeros(addresses.size, dtype=numpy.int64)  # bit i: candidate i holds the address
        for bit, (_, region) in enumerate(candidates):
            owners |= region.holds(addresses).astype(numpy.int64) << bit
        for owner in _distinct(owners):
            mine = addresses[owners == owner]
            members = [candidate for bit, candidate in enumerate(candidates) if owner >> bit & 1]
            name = "=".join(member for member, _ in members) or OUTSIDE
            counts = self.counts.setdefault((kernel, name), Counts())
            setattr(counts, kind, getattr(counts, kind) + mine.size * item_bytes)
            sectors = _distinct(numpy.concatenate([mine, mine + numpy.uint64(item_bytes - 1)])
                                // numpy.uint64(SECTOR_BYTES)).size
            setattr(counts, f"{kind}_sectors", getattr(counts, f"{kind}_sectors") + sectors * SECTOR_BYTES)
            if members:
                self._mark(kernel, name, kind, members[0][1], mine, item_bytes, counts)

    def _mark(self, kernel, name, kind, region: Region, addresses, item_bytes, counts) -> None:
        """Adds the bytes at `addresses` that this (kernel, argument, kind) had not touched in this region to its
        distinct count."""
        key = (kernel, name, kind, region.start, region.end)
        if key not in self._touched:
            self._touched[key] = numpy.zeros(region.end - region.start, dtype=bool)
        touched = self._touched[key]
        offsets = (addresses - numpy.uint64(region.start)).astype(numpy.int64)
        bytes_at = (offsets[:, None] + numpy.arange(item_bytes)).ravel()
        before = int(numpy.count_nonzero(touched))
        touched[bytes_at[bytes_at < touched.size]] = True
        fresh = int(numpy.count_nonzero(touched)) - before
        setattr(counts, f"{kind}_distinct", getattr(counts, f"{kind}_distinct") + fresh)

    def of(self, argument: str, kernel: str | None = None) -> Counts:
        """The counts of one argument (alone or with others that name the same tensor), in one kernel or summed over
        every kernel that has one of that name."""
        return sum((counts for (k, a), counts in self.counts.items()
                    if argument in a.split("=") and kernel in (None, k)), Counts())

    def total(self) -> Counts:
        return sum(self.counts.values(), Counts())

    def rows(self) -> list[dict]:
        """One dict per (kernel, argument): the counts with their names, for CSV and JSON."""
        return [{"kernel": kernel, "argument": argument, **dataclasses.asdict(counts)}
                for (kernel, argument), counts in sorted(self.counts.items())]


def _item_bytes(pointer) -> int:
    from triton.runtime.interpreter import _get_np_dtype

    return numpy.dtype(_get_np_dtype(pointer.get_element_ty())).itemsize


def _kept(pointers, mask) -> numpy.ndarray:
    data = pointers.data
    return data.ravel() if mask is None else data[numpy.broadcast_to(mask.data.astype(bool), data.shape)]


def _argument_regions(kernel, args: tuple, kwargs: dict) -> dict[str, Region]:
    """A Triton launch's tensor arguments by name (a `_ptr` suffix dropped), as the regions of memory they hold; the
    launch options among `kwargs` (num_warps, launch_pdl) are not the kernel's."""
    parameters = inspect.signature(kernel).parameters
    named = inspect.getcallargs(kernel, *args, **{k: v for k, v in kwargs.items() if k in parameters})
    return {name.removesuffix("_ptr"): Region.of(value) for name, value in named.items()
            if isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def triton_traffic() -> Iterator[Traffic]:
    """Count the memory accesses of every Triton kernel launched inside the context (Triton's interpreter only)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    traffic = Traffic()
    launches: list[tuple[str, dict[str, Region]]] = []
    run_launch = interpreter.GridExecutor.__call__

    def launch(executor, *args, **kwargs):
        launches.append((executor.fn.__name__, _argument_regions(executor.fn, args, kwargs)))
        try:
            return run_launch(executor, *args, **kwargs)
        finally:
            launches.pop()

    def access(kind, pointers, mask):
        kernel, regions = launches[-1]
        traffic.record(kernel, regions, kind, _kept(pointers, mask), _item_bytes(pointers))

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def masked_load(pointers, mask, *args):
        access("read", pointers, mask)
        return load(pointers, mask, *args)

    def masked_store(pointers, value, mask, *args):
        access("written", pointers, mask)
        return store(pointers, value, mask, *args)

    def atomic_rmw(op, pointers, value, mask, *args):
        for kind in ("read", "written"):
            access(kind, pointers, mask)
        return rmw(op, pointers, value, mask, *args)

    def atomic_cas(pointers, compare, value, *args):
        for kind in ("read", "written"):
            access(kind, pointers, None)
        return cas(pointers, compare, value, *args)

    with mock.patch.object(interpreter.GridExecutor, "__call__", launch), \
            mock.patch.object(builder, "create_masked_load", masked_load), \
            mock.patch.object(builder, "create_masked_store", masked_store), \
            mock.patch.object(builder, "create_atomic_rmw", atomic_rmw), \
            mock.patch.object(builder, "create_atomic_cas", atomic_cas):
        yield traffic


@contextlib.contextmanager
def triton_launch_plans_for(multiprocessors: int) -> Iterator[None]:
    """The triton backend's launch plans (splits of the keys) as on a GPU of `multiprocessors` (the interpreter answers
    4): an H200 has 132."""
    from macs_kernels.ops.triton import common

    with mock.patch.object(common, "multiprocessors", lambda device: multiprocessors):
        yield


@contextlib.contextmanager
def cuda_traffic(tensors: dict[str, torch.Tensor]) -> Iterator[Traffic]:
    """Count the global-memory accesses of every cuda kernel launched inside the context (the CUDA emulation only):
    those in a buffer the launcher named (scratch such as "scores", outputs it allocates) under that name, the others
    attributed to the named tensors (an asynchronous copy from none of them: argument OUTSIDE). Plain accesses
    elsewhere are not seen. Counted when the context closes; each (kernel, argument, size, direction) counts as one
    access."""
    from macs_kernels.ops.cuda import emulation

    traffic = Traffic()
    regions = {name: Region.of(tensor) for name, tensor in tensors.items()}
    emulation.count_accesses([(region.start, region.end) for region in regions.values()])
    try:
        yield traffic
        counted = emulation.counted_accesses()
        records = counted.records
        # One group per (kernel, buffer, direction, size): sorted by that key, cut where it changes.
        key = numpy.stack([records[field].astype(numpy.int64) for field in ("kernel", "buffer", "written", "bytes")])
        order = numpy.lexsort(key[::-1])
        cuts = numpy.flatnonzero((numpy.diff(key[:, order], axis=1) != 0).any(axis=0)) + 1
        for group in numpy.split(order, cuts) if order.size else ():
            kernel, buffer, written, item_bytes = (int(value) for value in key[:, group[0]])
            if buffer >= 0:
                named = counted.buffers[buffer]
                owners = {named.name: Region(named.start, named.end, 1, ())}
            else:
                owners = regions
            traffic.record(counted.kernels[kernel], owners, "written" if written else "read",
                           records["address"][group], item_bytes)
    finally:
        emulation.count_accesses(None)


def dependent_launch_hazards(launches: list[tuple[str, bool]], touched: Callable) -> list[str]:
    """What a programmatic dependent launch would read or overwrite while the kernels before it still run on a GPU:
    for each launch made as a dependent, its accesses before its wait (griddepcontrol.wait) to bytes that a kernel
    before it in its chain (the launches back to the last one made plainly, which starts after everything before it)
    writes, and its writes before the wait to bytes that kernel reads. `launches`: (kernel name, made as a dependent)
    in launch order, each kernel once; `touched(name, written, early)`: byte address -> the name of what holds it, over
    kernel `name`'s writes (written True), reads (False) or both (None), only those before its wait when `early`. One
    line per pair of kernels and holder; none when every dependent waits first."""
    hazards, chain = [], []
    for name, dependent in launches:
        if not dependent:
            chain = [name]
            continue
        early, early_writes = touched(name, None, True), touched(name, True, True)
        for before in chain:
            for mine, theirs, what, verb in ((early, touched(before, True, False), "reads or writes", "writes"),
                                             (early_writes, touched(before, False, False), "writes", "reads")):
                shared = mine.keys() & theirs.keys()
                for holder in sorted({theirs[address] for address in shared}):
                    count = sum(theirs[address] == holder for address in shared)
                    hazards.append(f"{name} {what} {count} bytes of {holder} before its wait that {before} {verb}")
        chain.append(name)
    return hazards


def _bytes_held(addresses: numpy.ndarray, sizes: numpy.ndarray, holders: list[str]) -> dict[int, str]:
    """Byte address -> holder, for accesses of sizes[i] bytes at addresses[i] held by holders[i]."""
    sizes = numpy.asarray(sizes, dtype=numpy.int64)
    starts = numpy.repeat(numpy.asarray(addresses, dtype=numpy.uint64), sizes)
    offsets = numpy.arange(starts.size, dtype=numpy.int64) - numpy.repeat(numpy.cumsum(sizes) - sizes, sizes)
    return dict(zip((starts + offsets.astype(numpy.uint64)).tolist(),
                    [holder for holder, size in zip(holders, sizes.tolist()) for _ in range(size)]))


def cuda_dependent_hazards(accesses, launches) -> list[str]:
    """dependent_launch_hazards of the CUDA emulation's counted `accesses` (emulation.counted_accesses) over its
    `launches` (emulation.take_launches, of the same calls): an access is early when its thread had not passed
    wait_for_prior_grid (csrc/common.cuh); a holder is a buffer a launcher named, else "a tensor"."""
    kernel_of = {name: kernel for kernel, name in accesses.kernels.items()}
    records = accesses.records

    def touched(name: str, written: bool | None, early: bool) -> dict[int, str]:
        kept = records[records["kernel"] == kernel_of.get(name, -1)]
        if written is not None:
            kept = kept[kept["written"] == int(written)]
        if early:
            kept = kept[kept["before_wait"] == 1]
        return _bytes_held(kept["address"], kept["bytes"],
                           [accesses.buffers[b].name if b >= 0 else "a tensor" for b in kept["buffer"].tolist()])

    return dependent_launch_hazards([(launch.name, launch.dependent) for launch in launches], touched)


@dataclasses.dataclass
class DependentAccesses:
    """What triton_dependent_accesses recorded: the launches (kernel name, made as a dependent) in order, and each
    access (kernel name, its byte addresses, written, made before the program's wait, the argument holding it)."""
    launches: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    accesses: list[tuple[str, numpy.ndarray, bool, bool, str]] = dataclasses.field(default_factory=list)

    def hazards(self) -> list[str]:
        def touched(name: str, written: bool | None, early: bool) -> dict[int, str]:
            held = {}
            for kernel, addresses, was_written, was_early, holder in self.accesses:
                if kernel == name and written in (None, was_written) and (was_early or not early):
                    held.update(dict.fromkeys(addresses.tolist(), holder))
            return held

        return dependent_launch_hazards(self.launches, touched)


@contextlib.contextmanager
def triton_dependent_accesses(waits: bool = True) -> Iterator[DependentAccesses]:
    """Inside (Triton's interpreter only), the triton backend launches its split passes' combine and head pooling as
    programmatic dependents (common.dependent_launch), as on an sm_90 GPU, and every program's loads and stores are
    recorded, each marked early while the program has not passed its wait (common.gdc_wait, which the interpreter
    cannot run: here it marks; `waits` False: it marks nothing, every access of a dependent early). The interpreter
    runs each grid after the one before it has ended, so results are as plain launches give; `hazards()` says what
    the same code would race on where a dependent's programs run beside the kernels before it."""
    from triton.runtime import interpreter

    from macs_kernels.ops.triton import common

    builder = interpreter.interpreter_builder
    recorded = DependentAccesses()
    running: list[tuple[str, dict[str, Region]]] = []
    waited = [False]
    run_launch, set_index = interpreter.GridExecutor.__call__, builder.set_grid_idx
    load, store = builder.create_masked_load, builder.create_masked_store

    def launch(executor, *args, **kwargs):
        recorded.launches.append((executor.fn.__name__, bool(kwargs.get("launch_pdl", False))))
        running.append((executor.fn.__name__, _argument_regions(executor.fn, args, kwargs)))
        try:
            return run_launch(executor, *args, **kwargs)
        finally:
            running.pop()

    def program(x, y, z):
        waited[0] = False
        return set_index(x, y, z)

    def wait():
        waited[0] = waits

    def access(pointers, mask, written: bool):
        kernel, regions = running[-1]
        addresses = _kept(pointers, mask)
        item_bytes = _item_bytes(pointers)
        for name, region in regions.items():
            held = addresses[region.holds(addresses)]
            if held.size:
                spread = (held[:, None] + numpy.arange(item_bytes, dtype=numpy.uint64)).ravel()
                recorded.accesses.append((kernel, spread, written, not waited[0], name))

    def masked_load(pointers, mask, *args):
        access(pointers, mask, False)
        return load(pointers, mask, *args)

    def masked_store(pointers, value, mask, *args):
        access(pointers, mask, True)
        return store(pointers, value, mask, *args)

    with contextlib.ExitStack() as patches:
        for target, name, value in ((interpreter.GridExecutor, "__call__", launch), (builder, "set_grid_idx", program),
                                    (builder, "create_masked_load", masked_load),
                                    (builder, "create_masked_store", masked_store), (common, "gdc_wait", wait),
                                    (common, "gdc_launch_dependents", lambda: None)):
            patches.enter_context(mock.patch.object(target, name, value))
        # The launchers import the choice by name.
        choice = common.dependent_launch
        for module in [module for name, module in sys.modules.items() if name.startswith("macs_kernels.ops.triton")]:
            if getattr(module, "dependent_launch", None) is choice:
                patches.enter_context(mock.patch.object(module, "dependent_launch", lambda device: True))
        yield recorded

