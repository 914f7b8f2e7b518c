"""AT2 is held out from exactly the questions its coefficients were trained on, found by their content in any data
file, and a method not scored on some samples says so, with its reason, in the log and the report."""
import dataclasses
import json

import pytest
import torch

from macs_kernels.apps.at2.coefficients import question_digest, save_coefficients, training_questions, training_record
from macs_kernels.apps.cli import main
from macs_kernels.apps.evaluation.data import QASample, load_qa
from macs_kernels.apps.evaluation.methods import AT2_TRAINED_ON, MethodUnavailable, method_skips, parse_method
from tests.apps.evaluation import stqa_350
from tests.apps.evaluation.test_resume import _one_thread, eval_command, write_data  # noqa: F401 (autouse)
from tests.helpers import QUESTIONS


def test_at2_skips_its_training_questions_by_content_wherever_they_stand():
    samples = load_qa(stqa_350())
    at2 = parse_method("at2")
    # The packaged coefficients were trained on stqa_350's questions 0-249 (at2 train --range 0:250); eight later
    # questions repeat one of them word for word, context included.
    trained = {(s.question, s.context) for s in samples[:250]}
    repeated = [s.index for s in samples[250:] if (s.question, s.context) in trained]
    assert repeated == [271, 287, 295, 300, 306, 324, 330, 346]
    assert [s.index for s in samples if not at2.scores_sample(s)] == [*range(250), *repeated]
    assert at2.skip_reason(samples[3]) == AT2_TRAINED_ON and at2.skip_reason(samples[260]) is None
    # By content, not by file or position: a training question elsewhere is held out, a user's question at
    # index 0 is scored, and so is a training question whose context differs.
    assert not at2.scores_sample(dataclasses.replace(samples[5], index=900))
    assert at2.scores_sample(QASample(0, *QUESTIONS[0], (("William Shakespeare", 31),)))
    assert at2.scores_sample(dataclasses.replace(samples[5], context=samples[5].context + " More text."))
    assert parse_method("macs").scores_sample(samples[0])
    ranged = dataclasses.replace(at2, indices=(260, 300))
    assert method_skips([ranged, parse_method("macs")], samples[255:265]) == {
        "at2": {"outside --method-range 260:300": [255, 256, 257, 258, 259]}}


def test_training_record_names_the_questions_and_a_file_without_one_refuses_at2(tmp_path, monkeypatch):
    import macs_kernels.apps.at2

    samples = [QASample(i, question, context, ()) for i, (question, context) in enumerate(QUESTIONS)]
    record = training_record([*samples, dataclasses.replace(samples[0], index=7)])  # a repeat counts once
    assert training_questions(record) == {question_digest(q, c) for q, c in QUESTIONS}
    assert len(json.loads(record["training_questions"])) == 3 and training_questions({}) is None

    unnamed = tmp_path / "theta.safetensors"
    save_coefficients(unnamed, torch.rand(30, 9), {"model": "SmolLM2-135M-Instruct"})
    monkeypatch.setattr(macs_kernels.apps.at2, "DEFAULT_COEFFICIENTS", unnamed)
    with pytest.raises(MethodUnavailable, match="does not record the questions it was trained on"):
        parse_method("at2")


def test_at2_is_scored_on_a_users_data_and_reported_where_it_is_skipped(tmp_path, capsys):
    records = tmp_path / "records"
    at2 = ["--methods", "at2,random", "--cost-n", "0"]
    # A user's file: questions AT2 never saw, at indices below 250.
    users = write_data(tmp_path / "qa.json", QUESTIONS[:2])
    out = tmp_path / "users.jsonl"
    assert main(eval_command(users, out, records, *at2)) == 0
    printed = capsys.readouterr().out
    assert "not scored on some samples" not in printed and "Skipped: none. " in printed
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["methods"]["at2"]["n"] == 2 and summary["method_skips"] == {}

    # stqa_350's first questions trained the coefficients: at2 is skipped there, and the log and report say why.
    out = tmp_path / "stqa.jsonl"
    assert main(eval_command(stqa_350(), out, records, *at2, "--n", "2")) == 0
    printed = capsys.readouterr().out
    reason = f"at2 on 2 samples (0-1): {AT2_TRAINED_ON}"
    assert f"eval: methods not scored on some samples: {reason}" in printed
    assert f"Skipped: none; methods not scored on some samples: {reason}." in out.with_suffix(".md").read_text()
    summary = json.loads(out.with_suffix(".json").read_text())
    assert "at2" not in summary["methods"] and summary["methods"]["random"]["n"] == 2
    assert summary["method_skips"] == {"at2": {AT2_TRAINED_ON: [0, 1]}}
