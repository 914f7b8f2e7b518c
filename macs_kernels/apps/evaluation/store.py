"""The results stream of an evaluation (a JSONL file, appended line by line) and the files summarised from it.

Each line is one JSON object keyed by (kind, index[, method]); a later line with the same key wins and a
truncated last line (a killed run) is ignored, so a run can stop anywhere and resume. Kinds: "run" (model,
settings and the samples of the run, each with its content key), "sample" (the generation and the
alignment), "skipped" (a sample that cannot be scored, with the reason), "auc" (one method's AUC-PR of one
sample), "faithfulness" (one method's masking curves of one sample). Every line but "run" carries "key",
the digest of the content it was computed from (content_key), and "sample", the content key of its sample:
a line is reused only while its key is the one the current run computes.

Every line also carries "checksum", the digest of its own content (line_checksum). A line whose content no
longer matches it (edited after it was written) is never reused nor reported: a resumed run warns, naming
the line, and computes it again. Lines without a checksum, written before lines carried one, cannot be
verified: a resumed run does not reuse them either (it warns and computes them again); a report of such a
file counts them and says they are unverified.

Outputs never overwrite anything else: the summary of results stream X.jsonl is X.json, X.md and X.png
(X.summary.json, .md, .png for a stream X.EXT of another extension, X.json... for one without: never the
stream itself), and an existing
file at any of these paths is replaced only when this tool wrote it (check_outputs).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from macs_kernels.apps.data_parallel import append_line, end_with_newline
from macs_kernels.apps.files import check_writable

RESULTS_FORMAT = "macs-kernels eval results"
SUMMARY_FORMAT = "macs-kernels eval summary"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHECKSUM = "checksum"
# Why a line read back is not trusted (checksum_problem).
EDITED = "does not match its checksum (changed after it was written)"
UNCHECKED = "carries no checksum (written before results lines had one)"


def content_key(content) -> str:
    """SHA-1 of a JSON-able description of what a result was computed from."""
    return hashlib.sha1(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def ids_digest(ids) -> str:
    import numpy as np

    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def line_key(line: dict) -> tuple:
    return (line["kind"], line.get("index"), line.get("method"))


def line_checksum(line: dict) -> str:
    """The digest of a results line's content: every field but its checksum."""
    return content_key({name: value for name, value in line.items() if name != CHECKSUM})


def checksum_problem(line: dict) -> str | None:
    """EDITED or UNCHECKED when a line read back cannot be trusted to be what this tool wrote, else None."""
    if CHECKSUM not in line:
        return UNCHECKED
    return EDITED if line[CHECKSUM] != line_checksum(line) else None


def describe_line(key: tuple) -> str:
    """("auc", 3, "macs") -> 'the auc line of sample 3, method macs'."""
    kind, index, method = key
    return f"the {kind} line" + ("" if index is None else f" of sample {index}") + (
        "" if method is None else f", method {method}")


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
    """The JSONL results stream, appended line by line and indexed by key.

    Lines read back that fail their checksum (checksum_problem) are left out, so they are computed again;
    each edited one draws a warning naming it, lines without a checksum one warning with their count.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        check_results_stream(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        end_with_newline(self.path)
        lines = read_results(self.path)
        # A run line is written anew by every run and never reused.
        untrusted = {key: problem for key, line in lines.items()
                     if key[0] != "run" and (problem := checksum_problem(line)) is not None}
        self.lines = {key: line for key, line in lines.items() if key not in untrusted}
        for key, problem in untrusted.items():
            if problem == EDITED:
                warnings.warn(f"{self.path}: {describe_line(key)} {EDITED}: it is not reused and is computed again",
                              UserWarning, stacklevel=2)
        unchecked = sum(problem == UNCHECKED for problem in untrusted.values())
        if unchecked:
            warnings.warn(f"{self.path}: {unchecked} results lines have no checksum (written before results lines "
                          "had one): they cannot be verified, so they are not reused and are computed again",
                          UserWarning, stacklevel=2)

    def get(self, kind: str, index=None, method=None, *, key: str | None = None):
        """The line of (kind, index, method); with `key`, only when it was computed from that content."""
        line = self.lines.get((kind, index, method))
        if line is None or (key is not None and line.get("key") != key):
            return None
        return line

    def write(self, line: dict) -> None:
        line = {**line, CHECKSUM: line_checksum(line)}
        # Data-parallel ranks append to the same stream: whole lines under a lock.
        append_line(self.path, json.dumps(line, ensure_ascii=False))
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
    """Raise ValueError, naming the file, when the evaluation would overwrite a file it does not own or cannot
    write one.

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
    for what, path in outputs.items():
        if write_stream or what != "results stream":
            try:
                check_writable(path)
            except OSError as error:
                raise ValueError(f"cannot write the {what} {path} ({error.strerror or error})") from None
