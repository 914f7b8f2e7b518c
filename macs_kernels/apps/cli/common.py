"""Arguments and checks every subcommand shares: the model to load and the files to write.

Everything here runs before any model is loaded, so a mistyped path fails in a second with the reason.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
# huggingface_hub's repo-id form: "name" or "owner/name" of word characters, dots and dashes.
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


class RegistryNames:
    """argparse `choices` read from a registry whose module imports torch (`module.attribute`, a dict or a tuple),
    only when a value is checked: `--help` (with a metavar) never reads them, so it stays torch-free."""

    def __init__(self, module: str, attribute: str):
        self.module, self.attribute = module, attribute

    def _names(self) -> list[str]:
        return list(getattr(importlib.import_module(self.module), self.attribute))

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="transformers model id or folder, or gemma3-270m (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model weights' dtype")
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")


def check_model_argument(name: str | None) -> None:
    """Refuse a --model that names a missing folder (anything that is not a hub id) before loading starts."""
    if name is None:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SystemExit(f"--model {name}: is a file, not a model folder (the folder holding config.json)")
        return
    if name.startswith((".", "~", "/")) or not _REPO_ID.fullmatch(name):
        raise SystemExit(f"--model {name}: the folder does not exist")


def check_device_argument(device: str | None) -> None:
    """Refuse a --device this torch cannot use (a misspelt one, cuda on a CPU-only build or without a GPU)
    before loading starts."""
    if device is None:
        return
    import torch

    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch says "Torch not compiled with CUDA enabled" by assert
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"--device {device}: this torch cannot use it ({reason})") from None


def check_backend_argument(backend: str | None, device: str | None) -> None:
    """Refuse a --backend that cannot run on --device (triton or cuda without CUDA) before loading starts."""
    if backend is None:
        return
    from macs_kernels.ops.registry import why_unavailable

    reason = why_unavailable(backend, device or "cpu")
    if reason is not None:
        raise SystemExit(f"--backend {backend}: {reason}")


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer) of --model/--dtype/--device; a model that cannot be loaded exits with the reason."""
    import torch

    from macs_kernels.api.models import load_model

    check_model_argument(args.model)
    check_device_argument(args.device)
    try:
        return load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except OSError as error:  # transformers' "not a valid model identifier", missing files, no network
        raise SystemExit(f"--model {args.model}: cannot load it: {str(error).splitlines()[0]}") from None


def check_output_files(**paths: Path | None) -> None:
    """Refuse output files that cannot be written (missing folder, a folder, read-only, one path twice).

    paths: option name -> path, e.g. check_output_files(json=args.json, html=args.html).
    """
    given = {f"--{name}": Path(path) for name, path in paths.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in given.items():
        if path.is_dir():
            raise SystemExit(f"{option} {path}: is a folder, give a file name")
        folder = path.resolve().parent
        if not folder.is_dir():
            raise SystemExit(f"{option} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise SystemExit(f"{option} {path}: not writable")
        resolved = path.resolve()
        if resolved in seen:
            raise SystemExit(f"{seen[resolved]} and {option} name the same file {path}")
        seen[resolved] = option


def write_outputs(args: argparse.Namespace, explanation) -> None:
    """--json and --html of an explanation (anything with to_json and to_html)."""
    if args.json:
        # One line: indented, every number of the (steps, N) rows would take a line of its own.
        args.json.write_text(explanation.to_json(separators=(",", ":")))
        print(f"wrote {args.json}")
    if args.html:
        args.html.write_text(explanation.to_html())
        print(f"wrote {args.html}")
