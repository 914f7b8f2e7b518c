"""`macs-kernels eval` never loses or misattributes results: where the summary goes, which files it refuses to
touch, and what a resumed run reuses (only results computed from the same content)."""
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from macs_kernels.cli import main
from macs_kernels.evaluation.store import summary_paths
from tests.helpers import QUESTIONS

ANSWERS = ["William Shakespeare", "blue", "Paris"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_data(path, pairs, answers=ANSWERS):
    samples = []
    for (question, context), answer in zip(pairs, answers):
        samples.append({"question": question, "context": context,
                        "answers": [{"text": answer, "answer_start": max(context.find(answer), 0)}]})
    path.write_text(json.dumps(samples))
    return path


def eval_command(data, out, records, *extra):
    return ["eval", "--data", str(data), "--out", str(out), "--records", str(records), "--methods", "macs,random",
            "--max-new-tokens", "4", "--faithfulness-n", "0", "--no-progress", *extra]


def results(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_summary_never_shares_the_results_streams_path(tmp_path, capsys):
    data = write_data(tmp_path / "qa.json", QUESTIONS[:2])
    for name in ("results.json", "results.md", "results", "results.jsonl"):
        (tmp_path / name.replace(".", "_")).mkdir()
        out = tmp_path / name.replace(".", "_") / name
        assert main(eval_command(data, out, tmp_path / "records")) == 0
        lines = results(out)  # still the stream: a run line, then samples and AUC-PR lines
        assert lines[0]["kind"] == "run" and sum(line["kind"] == "auc" for line in lines) == 4
        paths = summary_paths(out)
        assert out not in paths.values()
        assert json.loads(paths["json"].read_text())["methods"]["macs"]["n"] == 2
        assert paths["md"].read_text().startswith("Model: ") and paths["png"].stat().st_size > 0
        # Run again: the stream is resumed (nothing recomputed), the summary rewritten in place.
        assert main(eval_command(data, out, tmp_path / "records")) == 0
        assert "0 generations this run" in capsys.readouterr().out
        assert results(out)[: len(lines)] == lines
    assert summary_paths(tmp_path / "results.json")["json"] == tmp_path / "results.summary.json"


def test_outputs_that_would_overwrite_other_files_are_refused_before_any_work(tmp_path):
    data = write_data(tmp_path / "qa.json", QUESTIONS[:1])
    records = tmp_path / "records"
    (tmp_path / "other.json").write_text('{"unrelated": true}')
    (tmp_path / "notes.jsonl").write_text("my notes\n")
    refusals = [
        (data, "the input data"),  # --out is the data file itself
        (tmp_path / "qa.jsonl", "the input data"),  # its summary qa.json would be the data file
        (tmp_path / "notes.jsonl", "not a results stream"),
        (tmp_path / "other.jsonl", "not a summary written"),  # its summary other.json is someone else's
    ]
    for out, match in refusals:
        with pytest.raises(SystemExit, match=match):
            main(eval_command(data, out, records))
    assert not records.exists()  # refused before generating
    assert (tmp_path / "notes.jsonl").read_text() == "my notes\n"
    assert json.loads((tmp_path / "other.json").read_text()) == {"unrelated": True}
    with pytest.raises(SystemExit, match="not a results stream"):
        main(["eval", "--report-only", "--out", str(tmp_path / "notes.jsonl")])


def test_resume_on_other_data_recomputes_and_reports_only_that_data(tmp_path, capsys):
    out, records = tmp_path / "r.jsonl", tmp_path / "records"
    first = write_data(tmp_path / "a.json", QUESTIONS[:2])
    assert main(eval_command(first, out, records)) == 0
    assert "2 generations this run" in capsys.readouterr().out
    a_generations = {line["index"]: line["generation"] for line in results(out) if line["kind"] == "sample"}

    # Other questions at the same indices, into the same --out: generated and scored again, not A's lines.
    second = write_data(tmp_path / "b.json", [QUESTIONS[2]], ANSWERS[2:])
    assert main(eval_command(second, out, records)) == 0
    printed = capsys.readouterr().out
    assert "1 generations this run" in printed and "AUC-PR lines: 2 scored, 0 reused" in printed
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["n"] == 1 and summary["methods"]["macs"]["n"] == 1  # A's sample 1 is not B's
    latest = {line["index"]: line for line in results(out) if line["kind"] == "sample"}
    assert latest[0]["generation"] != a_generations[0]

    # Back to A: its generations come from the record cache, its lines from the results file.
    assert main(eval_command(first, out, records)) == 0
    printed = capsys.readouterr().out
    assert "0 generations this run" in printed and "AUC-PR lines: 2 scored, 2 reused" in printed
    assert json.loads(out.with_suffix(".json").read_text())["n"] == 2


def test_changed_gold_answers_are_rescored_without_generating(tmp_path, capsys):
    out, records = tmp_path / "r.jsonl", tmp_path / "records"
    data = write_data(tmp_path / "qa.json", QUESTIONS[:2])
    assert main(eval_command(data, out, records)) == 0
    before = json.loads(out.with_suffix(".json").read_text())["methods"]["macs"]["auc_pr"]["mean"]
    capsys.readouterr()
    write_data(data, QUESTIONS[:2], ["tragedy", "short wavelengths"])
    assert main(eval_command(data, out, records)) == 0
    printed = capsys.readouterr().out
    assert "0 generations this run, 2 taken from the record cache" in printed
    assert "AUC-PR lines: 4 scored, 0 reused" in printed
    after = json.loads(out.with_suffix(".json").read_text())["methods"]["macs"]["auc_pr"]["mean"]
    assert after != before


def test_wrong_offsets_are_relocated_or_refused_and_counted(tmp_path, capsys):
    (question, context), (question2, context2) = QUESTIONS[:2]
    data = tmp_path / "qa.json"
    data.write_text(json.dumps([
        {"question": question, "context": context, "answers": [{"text": "William Shakespeare", "answer_start": 0}]},
        {"question": question2, "context": context2, "answers": [{"text": "green", "answer_start": 3}]},
    ]))
    out = tmp_path / "r.jsonl"
    assert main(eval_command(data, out, tmp_path / "records")) == 0
    printed = capsys.readouterr().out
    assert "1 gold answers were not at their answer_start" in printed
    assert "sample 1 refused: answer 0 'green' (answer_start 3) does not occur in the context" in printed
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["n"] == 1 and summary["skipped"] == {"answer_not_in_context": 1}
    assert summary["relocated_answers"] == {"answers": 1, "samples": 1}
    assert "moved to the nearest occurrence of their text: 1 in 1 samples" in out.with_suffix(".md").read_text()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc.-_xjsonlmdpg", min_size=1, max_size=14).filter(lambda n: n not in (".", "..")))
def test_summary_paths_are_never_the_stream_nor_each_other(name):
    stream = Path("results") / name
    paths = list(summary_paths(stream).values())
    assert stream not in paths and len(set(paths)) == 3
    assert all(p.parent == stream.parent for p in paths)
