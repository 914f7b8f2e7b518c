"""AT2 training on a handful of questions of the default model; coefficient files."""
from __future__ import annotations

import pytest
import torch

from macs_kernels.apps.at2 import load_coefficients, model_record, train, train_coefficients
from macs_kernels.apps.at2.coefficients import question_digest, training_questions
from macs_kernels.apps.at2.train import collect, fit, load_examples, mean_loss, pearson_loss
from macs_kernels.apps.evaluation.data import QASample
from tests.helpers import QUESTIONS, default_model

SAMPLES = [QASample(i, q, c, ()) for i, (q, c) in enumerate(QUESTIONS)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.fixture(scope="module")
def collected(model_and_tokenizer, tmp_path_factory):
    model, tokenizer = model_and_tokenizer
    work = tmp_path_factory.mktemp("at2")
    paths = collect(model, tokenizer, SAMPLES, work, n_masks=4, max_new_tokens=4, progress=False)
    return work, paths


def test_collected_examples_hold_consistent_data(collected, model_and_tokenizer):
    model, _ = model_and_tokenizer
    _, paths = collected
    assert len(paths) == len(SAMPLES)
    for example in load_examples(paths):
        c0, c1 = example["context_tokens"].tolist()
        assert example["features"].shape == (30 * 9, c1 - c0)
        assert example["masks"].shape == (4, c1 - c0) and example["outputs"].shape == (4,)
        assert torch.isfinite(example["outputs"]).all()
        # Per head, the response rows' attention on the context is a share of each softmax row.
        assert (example["features"] >= 0).all() and (example["features"].sum(1) <= 1 + 1e-5).all()


def test_collection_resumes_without_recomputing(collected, model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    work, paths = collected

    def refuse(*args, **kwargs):
        raise AssertionError("an example already collected was recomputed")

    monkeypatch.setattr(train, "collect_example", refuse)
    assert collect(model, tokenizer, SAMPLES, work, n_masks=4, max_new_tokens=4, progress=False) == paths


def test_fit_lowers_the_pearson_loss_below_uniform(collected):
    examples = load_examples(collected[1])
    size = examples[0]["features"].shape[0]
    uniform = mean_loss(torch.full((size,), 1.0 / size), examples)
    theta = fit(examples, epochs=30, lr=1e-3, batch_size=2, progress=False)
    assert theta.abs().sum().item() == pytest.approx(1.0, abs=1e-5)  # L1-normalised
    assert mean_loss(theta, examples) < uniform - 0.05


def test_fit_resumes_from_its_checkpoint(collected, tmp_path, monkeypatch):
    examples = load_examples(collected[1])
    straight = fit(examples, epochs=4, batch_size=2, progress=False)
    checkpoint = tmp_path / "fit.safetensors"
    calls = {"n": 0}

    def dies_in_epoch_three(theta, example):
        calls["n"] += 1
        if calls["n"] > 2 * len(examples):
            raise KeyboardInterrupt
        return pearson_loss(theta, example)

    monkeypatch.setattr(train, "pearson_loss", dies_in_epoch_three)
    with pytest.raises(KeyboardInterrupt):
        fit(examples, epochs=4, batch_size=2, checkpoint=checkpoint, progress=False)
    monkeypatch.undo()
    resumed = fit(examples, epochs=4, batch_size=2, checkpoint=checkpoint, progress=False)
    assert torch.allclose(resumed, straight, atol=1e-7)


def test_trained_coefficients_record_their_model(collected, model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    work, _ = collected
    out = tmp_path / "theta.safetensors"
    _, metadata = train_coefficients(model, tokenizer, SAMPLES, work=work, out=out, n_masks=4, epochs=2,
                                     batch_size=2, max_new_tokens=4, progress=False, data_name="three")
    assert metadata == load_coefficients(out, model)[1]
    assert metadata["model"] == "SmolLM2-135M-Instruct" and metadata["data"] == "three"
    assert metadata["attention_fingerprint"] == model_record(model)["attention_fingerprint"]
    # The questions trained on, by content: an evaluation holds them out (evaluation.methods).
    assert training_questions(metadata) == {question_digest(q, c) for q, c in QUESTIONS}

