"""Output files checked before any work: a run of minutes must not end unable to write what it made."""
from __future__ import annotations

import tempfile
from pathlib import Path


def check_writable(path: Path) -> None:
    """Raise OSError when `path` cannot be written, found by opening: an existing file for appending (left as it
    was), else a temporary file beside it. Permission bits do not tell (root passes them; /proc refuses new
    files whatever they say)."""
    if path.exists():
        with open(path, "a"):
            pass
    else:
        with tempfile.TemporaryFile(dir=path.resolve().parent):
            pass
