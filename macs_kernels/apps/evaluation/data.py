"""Question-context-answer samples from a JSON file (flat list or SQuAD's nested form) or a `datasets` dataset.

Unanswerable questions (SQuAD 2.0's is_impossible) are kept with no answers: the metrics skip and count them.
A gold answer whose text is not at its answer_start moves to the nearest occurrence of its text; one whose
text is nowhere in the context makes its sample refused (QASample.problem), counted in the report.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class QASample:
    """One question. answers: (text, answer_start) pairs, answer_start a character offset into context.

    index: position in the whole source (before --range/--n), so results can be traced back.
    relocated: (answer number, given start) of each answer whose text was not at its given answer_start
    and was moved to the nearest occurrence of its text in the context (its pair in `answers` holds the
    new start). problem: why the sample cannot be scored (an answer text that does not occur in the
    context at all), or None.
    """

    index: int
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]
    id: str | None = None
    relocated: tuple[tuple[int, int], ...] = ()
    problem: str | None = None


def parse_range(text: str) -> tuple[int, int | None]:
    """'250:350' -> (250, 350); '250:' -> (250, None); ':100' -> (0, 100)."""
    start, sep, stop = text.partition(":")
    if not sep:
        raise ValueError(f"a range is START:STOP, got {text!r}")
    try:
        return int(start or 0), (int(stop) if stop else None)
    except ValueError:
        raise ValueError(f"a range is START:STOP with integers, got {text!r}") from None


def load_qa(path: str | os.PathLike | None = None, *, hf_dataset: str | None = None, split: str = "validation",
            range: tuple[int, int | None] | None = None, n: int | None = None,
            cache_dir: str | os.PathLike | None = None) -> list[QASample]:
    """QA samples from `path` (a JSON file) or, with `hf_dataset`, through the `datasets` library.

    hf_dataset: a hub name (loaded with `split`), a folder written by `Dataset.save_to_disk`, or a local
    .json/.jsonl file. range=(start, stop) selects by position (stop None = to the end), then n keeps
    the first n of those. cache_dir is passed to `datasets`.
    """
    if (path is None) == (hf_dataset is None):
        raise ValueError("give exactly one of a JSON path or hf_dataset")
    records = _json_records(Path(path)) if path is not None else _dataset_records(hf_dataset, split, cache_dir)
    samples = [_sample(i, r) for i, r in enumerate(records)]
    if range is not None:
        start, stop = range
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad range {start}:{stop}")
        if start >= len(samples):
            raise ValueError(f"range starts at {start} but there are only {len(samples)} samples")
        samples = samples[start:stop]
    if n is not None:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        samples = samples[:n]
    return samples


def _json_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error}); give a JSON list of {{question, context, answers}} or "
                             "SQuAD's file (--hf-dataset reads .jsonl)") from None
    if isinstance(data, dict) and "data" in data:
        return _flatten_squad(data["data"])
    if isinstance(data, list):
        return data
    raise ValueError(f"{path}: expected a list of {{question, context, answers}} or SQuAD's {{'data': [...]}}")


def _flatten_squad(articles) -> list[dict]:
    return [
        {**qa, "context": paragraph["context"], "answers": [] if qa.get("is_impossible") else qa.get("answers", [])}
        for article in articles
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]


def _dataset_records(name: str, split: str, cache_dir) -> list[dict]:
    import datasets

    local = Path(name)
    if local.is_dir():
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[split]
    elif local.is_file():
        # A local file has no named splits: `datasets` puts it all under "train".
        loaded = datasets.load_dataset("json", data_files=str(local), split="train", cache_dir=cache_dir)
    else:
        loaded = datasets.load_dataset(name, split=split, cache_dir=cache_dir)
    rows = loaded.to_list()
    if rows and "data" in rows[0] and "question" not in rows[0]:  # a nested SQuAD file read as one row
        return [r for row in rows for r in _flatten_squad(row["data"])]
    return rows


def _sample(index: int, record: dict) -> QASample:
    try:
        question, context, answers = record["question"], record["context"], record.get("answers") or []
    except KeyError as e:
        raise ValueError(f"sample {index} has no {e.args[0]!r} field") from None
    if isinstance(answers, dict):  # the hub's SQuAD columns: {"text": [...], "answer_start": [...]}
        answers = [{"text": t, "answer_start": s} for t, s in zip(answers["text"], answers["answer_start"])]
    pairs, relocated, problems = [], [], []
    for number, answer in enumerate(answers):
        missing = [field for field in ("text", "answer_start") if not isinstance(answer, dict) or field not in answer]
        if missing:
            raise ValueError(f"sample {index}: answer {number} has no {' or '.join(map(repr, missing))} field (an "
                             "answer is {\"text\": ..., \"answer_start\": <its character offset in the context>})")
        text, start = str(answer["text"]), int(answer["answer_start"])
        found = locate_answer(context, text, start)
        if found is None:
            problems.append(f"answer {number} {text!r} (answer_start {start}) does not occur in the context")
            found = start
        elif found != start:
            relocated.append((number, start))
        pairs.append((text, found))
    sample_id = record.get("id")
    return QASample(index, question, context, tuple(pairs), None if sample_id is None else str(sample_id),
                    tuple(relocated), "; ".join(problems) or None)


def locate_answer(context: str, text: str, start: int) -> int | None:
    """Where gold answer `text` sits: `start` when the context holds it there, else the start of its
    occurrence nearest to `start` (the earlier one on a tie), None when the context never contains it.

    Scraped SQuAD-style data often carries offsets of another version of the context; labelling the tokens
    at a wrong offset would score the wrong span without a word.
    """
    if 0 <= start <= len(context) - len(text) and context.startswith(text, start):
        return start
    occurrences = []
    at = context.find(text)
    while at >= 0 and text:
        occurrences.append(at)
        at = context.find(text, at + 1)
    return min(occurrences, key=lambda p: (abs(p - start), p)) if occurrences else None
