"""Data parallelism for long jobs (evaluation, batch explanation): K processes under torchrun, each taking every
K-th item, all appending to ONE results stream.

Lines are appended whole under an exclusive file lock, so processes never interleave inside a line; every job
keys its lines by content and reads the stream back on start, so a job that died (any rank) resumes where the
stream stops, with nothing lost and nothing computed twice for the same key. The split is a pure function of the
item list, rank and world size (`Shard.take`), so every rank agrees on it without talking.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import os
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's part of a data-parallel job: rank `rank` of `size` (0 of 1 when not distributed)."""

    rank: int = 0
    size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def take(self, items: list) -> list:
        return items[self.rank::self.size]

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


SINGLE_PROCESS = Shard()


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def data_parallel(required: bool = False):
    """Yields the Shard of this process: from torchrun's environment (a gloo group, used only for barriers, is
    set up and torn down here), or Shard() for a plain process. required: refuse to run outside torchrun."""
    if torchrun_world_size() == 1:
        if required:
            raise SystemExit("--distributed: start this under torchrun, e.g. "
                             "torchrun --nproc-per-node 2 -m macs_kernels eval ... (WORLD_SIZE is not set)")
        yield SINGLE_PROCESS
        return
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        # Ranks can finish hours apart (the last barrier waits for the slowest): no collective timeout to speak of.
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=7))
    try:
        yield Shard(dist.get_rank(), dist.get_world_size())
    finally:
        if created:
            dist.destroy_process_group()


def print_line(text: str) -> None:
    """Print `text` and its newline in one write. Ranks share one stdout, and print() writes the newline apart when
    stdout is unbuffered (PYTHONUNBUFFERED, common under torchrun and in CI): two ranks' lines then joined into one."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def append_line(path: str | os.PathLike, text: str) -> None:
    """Append one line (newline added) in one write under an exclusive lock: safe from concurrent processes."""
    data = (text.rstrip("\n") + "\n").encode("utf-8")
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(data)
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def end_with_newline(path: Path) -> None:
    """A killed write can leave a last line without its newline: close it, so appended lines start clean."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another rank may be appending
        try:
            if f.seek(0, os.SEEK_END):
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
