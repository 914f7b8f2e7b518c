"""A folder of recorded generations, one .npz per generation key, holding the recorder's float32 arrays unchanged.

A record is stored exactly as RowRecorder returned it: a sample scored from a cached record gets the numbers
of one scored right after its generation, bit for bit, so a resumed run equals an uninterrupted one (rows
rounded to float16 moved per-sample scores by up to 5e-3 and changed tie counts).

The key (runner.generation_key) covers everything a recording depends on: model, dtype, max_new_tokens and
the prompt ids, plus RECORD_VERSION, so records are shared by every results file and data set that
generates from the same prompt, and never confused across them.
"""
from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path

import numpy as np

# Bump when RowRecorder's fields, their meaning or their stored precision change: older records are then recorded
# again, and every result computed from them scored again (3: float32 rows; 2 stored them as float16).
RECORD_VERSION = 3


def records_dir(root: str | os.PathLike | None) -> Path:
    if root is None:
        from macs_kernels.api.models import cache_dir

        root = cache_dir() / "eval_records"
    return Path(root)


def save_record(folder: Path, key: str, record: dict, prompt_ids, generated_ids) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, prompt_ids=np.asarray(prompt_ids), generated_ids=np.asarray(generated_ids), **record)
    tmp.rename(folder / f"{key}.npz")


def _damaged(path: Path, error: Exception) -> None:
    """A cached file that does not read (a run killed while another copied it, a full disk): removed, so that it
    is computed again and replaced, and named."""
    warnings.warn(f"{path}: a damaged cache file ({type(error).__name__}: {error}); computing it again", stacklevel=3)
    path.unlink(missing_ok=True)


def load_record(folder: Path, key: str, prompt_ids) -> tuple[dict, np.ndarray] | None:
    """(record, generated ids) stored under `key`, or None when missing, damaged (then removed) or recorded from
    other prompt ids."""
    path = folder / f"{key}.npz"
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            if not np.array_equal(data["prompt_ids"], np.asarray(prompt_ids)):
                return None
            record = {k: data[k] for k in data.files if k not in ("prompt_ids", "generated_ids")}
            return record, data["generated_ids"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        _damaged(path, error)
        return None


# Bump a method's entry when what its rows mean changes (macs_kernels.apps.evaluation.baselines.attnlrp, .atman,
# record.rollout_rows): their cached rows are then computed again.
MODEL_ROWS_VERSION = {"rollout": 1, "attnlrp": 1, "atman": 1}


def _rows_path(folder: Path, key: str, kind: str) -> Path:
    return folder / f"{key}.{kind}-v{MODEL_ROWS_VERSION[kind]}.npz"


def save_rows(folder: Path, key: str, kind: str, rows: np.ndarray, generated_ids, cost: dict) -> None:
    """The (steps, N) rows of an after-generation method (rollout, attnlrp, atman) of the generation `key`,
    with what computing them cost (costs.measured), so a later run reuses both."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.{kind}.{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, rows=rows, generated_ids=np.asarray(generated_ids), seconds=cost["seconds"],
                 peak_bytes=-1 if cost["peak_bytes"] is None else cost["peak_bytes"])
    tmp.rename(_rows_path(folder, key, kind))


def has_rows(folder: Path, key: str, kind: str) -> bool:
    return _rows_path(folder, key, kind).is_file()


def load_rows(folder: Path, key: str, kind: str, generated_ids) -> tuple[np.ndarray, dict] | None:
    """(rows, cost) saved by save_rows, or None when missing, damaged (then removed) or computed for other generated
    ids."""
    path = _rows_path(folder, key, kind)
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            if not np.array_equal(data["generated_ids"], np.asarray(generated_ids)):
                return None
            peak = int(data["peak_bytes"])
            return data["rows"], {"seconds": float(data["seconds"]), "peak_bytes": None if peak < 0 else peak}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        _damaged(path, error)
        return None
