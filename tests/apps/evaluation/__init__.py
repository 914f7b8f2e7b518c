"""Tests of macs_kernels.apps.evaluation and the `macs-kernels eval` command."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def stqa_350() -> Path:
    """The paper's stqa_350.json: $MACS_KERNELS_STQA_350, else shared/data/ in a folder above this checkout
    (skips the test when there is none)."""
    given = os.environ.get("MACS_KERNELS_STQA_350")
    candidates = [Path(given)] if given else [p / "shared" / "data" / "stqa_350.json" for p in Path(__file__).parents]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        pytest.skip("stqa_350.json is not next to this checkout (set MACS_KERNELS_STQA_350)")
    return found
