"""The results stream of an evaluation (a JSONL file, appended line by line) and the files summarised from it.

Each line is one JSON object keyed by (kind, index[, method]); a later line with the same key wins and a
truncated last line (a killed run) is ignored, so a run can stop anywhere and resume. Kinds: "run" (model,
settings and the samples of the run, each with its content key), "sample" (the generation and the
alignment), "skipped" (a sample that cannot be scored, with the reason), "auc" (one method's AUC-PR of one
sample), "faithfulness" (one method's masking curves of one sample). Every line but "run" carries "key",
the digest of the content it was computed from (content_key), and "sample", the content key of its sample:
a line is reused only while its key is the one the current run computes.

Outputs never overwrite anything else: the summary of results stream X.jsonl is X.json, X.md and X.png
(X.summary.json, .md, .png for a stream X.EXT of another extension, X.json... for one without: never the
stream itself), and an existing
file at any of these paths is replaced only when this tool wrote it (check_outputs).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

RESULTS_FORMAT = "macs-kernels eval results"
SUMMARY_FORMAT = "macs-kernels eval summary"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def content_key(content) -> str:
    """SHA-1 of a JSON-able description of what a result was computed from."""
    return hashlib.sha1(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def ids_digest(ids) -> str:
    import numpy as np

    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def line_key(line: dict) -> tuple:
    return (line["kind"], line.get("index"), line.get("method"))


def read_results(path: str | os.PathLike) -> dict[tuple, dict]:
    """The results file's lines by key (later lines win; unparsable lines from a killed write are skipped)."""
    lines: dict[tuple, dict] = {}
    path = Path(path)
    if not path.is_file():
        return lines
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and "kind" in line:
                lines[line_key(line)] = line
    return lines


class Results:
    """The JSONL results stream, appended line by line and indexed by key."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        check_results_stream(self.path)
        self.lines = read_results(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as f:  # a killed write can leave a line without its newline
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    with open(self.path, "a", encoding="utf-8") as g:
                        g.write("\n")

    def get(self, kind: str, index=None, method=None, *, key: str | None = None):
        """The line of (kind, index, method); with `key`, only when it was computed from that content."""
        line = self.lines.get((kind, index, method))
        if line is None or (key is not None and line.get("key") != key):
            return None
        return line

    def write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.lines[line_key(line)] = line


# ---- which paths an evaluation may write ---------------------------------------------------------------
def summary_paths(results: str | os.PathLike) -> dict[str, Path]:
    """{"json", "md", "png"}: where the summary of the results stream `results` goes."""
    results = Path(results)
    base = results if not results.suffix else results.with_suffix("" if results.suffix == ".jsonl" else ".summary")
    return {ext: base.with_name(f"{base.name}.{ext}") for ext in ("json", "md", "png")}


def _first_line(path: Path) -> dict | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.readline()
    try:
        line = json.loads(text)
    except json.JSONDecodeError:
        return None
    return line if isinstance(line, dict) else None


def is_results_stream(path: Path) -> bool:
    """A file this tool wrote as a results stream: its first line is a "run" line (every run writes one first)."""
    first = _first_line(path)
    return first is not None and first.get("kind") == "run"


def _is_summary(path: Path, kind: str, results: Path) -> bool:
    """Whether the existing summary file `path` (kind json, md or png) was written by this tool."""
    if kind == "json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        # Summaries written before SUMMARY_FORMAT existed are recognised by their fields.
        return isinstance(data, dict) and (data.get("format") == SUMMARY_FORMAT or {"methods", "claims"} <= set(data))
    if kind == "md":
        text = path.read_text(encoding="utf-8", errors="replace")
        return text.startswith("Model: ") and "| method | n | AUC-PR" in text
    head = path.read_bytes()
    if not head.startswith(_PNG_SIGNATURE):
        return False
    # Plots carry SUMMARY_FORMAT in a PNG text chunk; older ones count when their summary JSON is ours.
    sibling = summary_paths(results)["json"]
    return SUMMARY_FORMAT.encode() in head or (sibling.is_file() and _is_summary(sibling, "json", results))


def check_results_stream(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a results file name such as results.jsonl")
    if path.is_file() and path.stat().st_size and not is_results_stream(path):
        raise ValueError(f"{path} exists and is not a results stream of macs-kernels eval (its first line is not "
                         "a run line); refusing to append to it: give another --out")


def check_outputs(results: str | os.PathLike, *, protected=(), write_stream: bool = True) -> None:
    """Raise ValueError, naming the file, when the evaluation would overwrite a file it does not own.

    Owned: a results stream (first line a "run" line), a summary JSON with this tool's format (or the
    fields of one), a Markdown table it wrote ("Model: ..." with the method table), a PNG carrying its
    marker. protected: paths never to write, whatever they hold (the data file).
    write_stream: False for --report-only (the stream is only read; it may then be the input data too).
    """
    results = Path(results)
    outputs = {"results stream": results, **{f"summary .{k}": p for k, p in summary_paths(results).items()}}
    forbidden = {Path(p).resolve() for p in protected if p is not None}
    for what, path in outputs.items():
        if path.resolve() in forbidden and (write_stream or what != "results stream"):
            raise ValueError(f"the {what} {path} would overwrite the input data; give another --out")
    check_results_stream(results)  # also when only read: a summary of someone else's file would be nonsense
    for kind, path in summary_paths(results).items():
        if path.is_dir():
            raise ValueError(f"the summary .{kind} {path} is a folder; give another --out")
        if path.is_file() and path.stat().st_size and not _is_summary(path, kind, results):
            raise ValueError(f"{path} exists and is not a summary written by macs-kernels eval; refusing to "
                             "overwrite it: give another --out (its summary goes next to it)")
