"""What every host launcher of the Triton backend shares: the launch counter and the block-size policy."""
from __future__ import annotations

import collections

import torch

from .._dispatch import triton_interpreted as interpreted

# Kernel name -> launches since import: lets an integration test prove that Triton really ran.
LAUNCHES: collections.Counter = collections.Counter()


def launch(kernel, grid, *args, **kwargs) -> None:
    LAUNCHES[kernel.fn.__name__] += 1
    kernel[grid](*args, **kwargs)


def next_pow2(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter runs programs one by one, so a few suffice."""
    if interpreted() or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
