"""Output files checked before any work: a run of minutes must not end unable to write what it made."""
from __future__ import annotations

import tempfile
from pathlib import Path


def check_writable(path: Path) -> None:
    """Raise OSError when `path` cannot be written, found by opening: an existing file for appending (left as it
    was), else a temporary file in its folder (or the nearest existing folder above it: the writer makes the
    rest). Permission bits do not tell (root passes them; /proc refuses new files whatever they say)."""
    path = Path(path)
    if path.exists():
        with open(path, "a"):
            pass
        return
    folder = path.resolve().parent
    while not folder.exists():
        folder = folder.parent
    with tempfile.TemporaryFile(dir=folder):
        pass
