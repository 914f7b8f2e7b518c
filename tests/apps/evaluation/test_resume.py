"""`macs-kernels eval` never loses or misattributes results: where the summary goes, which files it refuses to
touch, and what a resumed run reuses (only results computed from the same content)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from macs_kernels.apps.cli import main
from macs_kernels.apps.evaluation.store import summary_paths
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


@pytest.mark.slow  # eight runs of the command; the rule itself: test_summary_paths_are_never_the_stream_nor_each_other
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


@pytest.mark.slow  # three runs of the command on the default model: ~30 s
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


def test_a_record_comes_back_from_the_cache_bit_for_bit(tmp_path):
    from macs_kernels.apps.evaluation.record_cache import load_record, save_record

    rng = np.random.default_rng(0)
    # Attention weights far below float16's resolution near 1 and below its smallest normal number (6e-5).
    record = {"rows": rng.dirichlet(np.full(40, 0.05), size=(3, 2, 4)).astype(np.float32),
              "mass": rng.random((3, 2, 4), dtype=np.float32), "residual_max": np.float32(3e-7)}
    prompt, generated = np.arange(40), np.array([5, 6, 7])
    save_record(tmp_path, "key", record, prompt, generated)
    loaded, loaded_generated = load_record(tmp_path, "key", prompt)
    assert set(loaded) == set(record) and np.array_equal(loaded_generated, generated)
    for name, array in record.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name


def test_a_run_from_the_record_cache_gives_the_numbers_of_a_fresh_one_bit_for_bit(tmp_path, capsys):
    data = write_data(tmp_path / "qa.json", QUESTIONS)
    records = tmp_path / "records"
    # Methods scored from the recorded rows; every line holds only numbers that do not depend on timing.
    methods = ["--methods", "macs,macs:alpha=1.0,attention-mean", "--cost-n", "0", "--max-new-tokens", "8"]
    fresh, cached = tmp_path / "fresh.jsonl", tmp_path / "cached.jsonl"
    assert main(eval_command(data, fresh, records, *methods)) == 0
    assert "3 generations this run, 0 taken from the record cache" in capsys.readouterr().out
    assert main(eval_command(data, cached, records, *methods)) == 0
    assert "0 generations this run, 3 taken from the record cache" in capsys.readouterr().out
    fresh_lines, cached_lines = (sorted((line for line in results(out) if line["kind"] != "run"), key=json.dumps)
                                 for out in (fresh, cached))
    assert sum(line["kind"] == "auc" for line in fresh_lines) == 9
    assert fresh_lines == cached_lines  # scores, aggregates, tie counts: equal floats, not close ones


def _rewrite(out, lines):
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _finished_run(tmp_path):
    """A finished two-sample run: its results path, its command and its lines."""
    out, records = tmp_path / "r.jsonl", tmp_path / "records"
    data = write_data(tmp_path / "qa.json", QUESTIONS[:2])
    command = eval_command(data, out, records, "--cost-n", "0")  # no timings: lines computed again are equal
    assert main(command) == 0
    return out, command, results(out)


def test_an_edited_results_line_is_recomputed_and_reported_not_reused(tmp_path, capsys):
    out, command, written = _finished_run(tmp_path)
    computed = json.loads(out.with_suffix(".json").read_text())["methods"]
    target = next(line for line in written if line["kind"] == "auc" and line["best"] < 1.0)
    name = f"the auc line of sample {target['index']}, method {target['method']}"
    # Another valid JSON line with a better score, as a hand edit would leave it.
    _rewrite(out, [dict(line, best=1.0) if line is target else line for line in written])
    capsys.readouterr()

    # A report of the edited file leaves the line out and names it.
    assert main(["eval", "--report-only", "--out", str(out)]) == 0
    assert f"Left out, their content changed after they were written (it does not match their checksum): {name}." in (
        capsys.readouterr().out)
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["methods"][target["method"]]["n"] == 1 and summary["edited_lines"] == [name]

    # A resumed run warns, naming the line, and computes it again (from the record cache).
    with pytest.warns(UserWarning, match=f"{name} does not match its checksum"):
        assert main(command) == 0
    printed = capsys.readouterr().out
    assert "0 generations this run, 1 taken from the record cache" in printed
    assert "AUC-PR lines: 1 scored, 3 reused" in printed
    assert results(out)[-1] == target
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["methods"] == computed and summary["edited_lines"] == []


def test_results_lines_without_a_checksum_are_recomputed_and_reported(tmp_path, capsys):
    out, command, written = _finished_run(tmp_path)
    computed = json.loads(out.with_suffix(".json").read_text())["methods"]["macs"]["auc_pr"]["mean"]
    # As a results file written before lines carried a checksum.
    _rewrite(out, [{name: value for name, value in line.items() if name != "checksum"} for line in written])
    capsys.readouterr()

    assert main(["eval", "--report-only", "--out", str(out)]) == 0
    assert "6 results lines have no checksum (written before results lines had one): reported unverified" in (
        capsys.readouterr().out)
    assert json.loads(out.with_suffix(".json").read_text())["unverified_lines"] == 6  # 2 samples, 4 AUC-PR lines

    with pytest.warns(UserWarning, match="6 results lines have no checksum"):
        assert main(command) == 0
    printed = capsys.readouterr().out
    assert "0 generations this run, 2 taken from the record cache" in printed
    assert "samples reused from the results file: 0; AUC-PR lines: 4 scored, 0 reused" in printed
    assert results(out)[len(written):] == written  # computed again: the same lines, with their checksums
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["methods"]["macs"]["auc_pr"]["mean"] == computed and summary["unverified_lines"] == 0


def test_a_damaged_cache_file_is_named_and_computed_again(tmp_path):
    """A record or rows file cut short (a copy interrupted): named, removed and so recorded again, not a
    BadZipFile on every run that reaches its sample."""
    from macs_kernels.apps.evaluation.record_cache import load_record, load_rows, save_record, save_rows

    prompt, generated = np.arange(6), np.array([1, 2])
    save_record(tmp_path, "key", {"rows": np.ones((2, 6), np.float32)}, prompt, generated)
    save_rows(tmp_path, "key", "rollout", np.ones((2, 6)), generated, {"seconds": 1.0, "peak_bytes": None})
    for path, load in ((tmp_path / "key.npz", lambda: load_record(tmp_path, "key", prompt)),
                       (next(tmp_path.glob("key.rollout-*.npz")), lambda: load_rows(tmp_path, "key", "rollout",
                                                                                     generated))):
        path.write_bytes(path.read_bytes()[:100])
        with pytest.warns(UserWarning, match=rf"{path}: a damaged cache file \(BadZipFile"):
            assert load() is None
        assert not path.exists()


def test_a_results_stream_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    def no_loading(args):
        raise AssertionError("the model was loaded before the results stream was checked")

    monkeypatch.setattr("macs_kernels.apps.cli.eval.load_from_args", no_loading)
    data = write_data(tmp_path / "qa.json", QUESTIONS[:1])
    with pytest.raises(SystemExit, match=r"eval: --out: cannot write the results stream /proc/results.jsonl \("):
        main(eval_command(data, "/proc/results.jsonl", tmp_path / "records"))


def test_a_data_file_that_is_not_json_exits_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr("macs_kernels.apps.cli.eval.load_from_args", lambda args: pytest.fail("the model loaded"))
    data = tmp_path / "qa.json"
    data.write_text("question,context\n")
    with pytest.raises(SystemExit, match=rf"eval: {data}: not JSON \(Expecting value: line 1 column 1"):
        main(eval_command(data, tmp_path / "out.jsonl", tmp_path / "records"))
