"""`on_device`: index tensors as the argument checks see a GPU's."""
from __future__ import annotations

import pytest

from macs_kernels.ops import _checks


@pytest.fixture
def on_device(monkeypatch):
    """Index tensors as the checks see device tensors: values not on the host."""
    monkeypatch.setattr(_checks, "on_host", lambda *tensors: False)
    monkeypatch.setattr(_checks, "VALIDATE_EVERY_CALL", False)
