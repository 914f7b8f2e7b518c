"""AT2 coefficient files: shape checks, safetensors only, and the model they were trained for."""
from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch

from macs_kernels.apps.at2 import (
    DEFAULT_COEFFICIENTS,
    AT2Attributor,
    load_coefficients,
    model_record,
    save_coefficients,
)
from macs_kernels.apps.at2.coefficients import attention_fingerprint
from macs_kernels.engines.generate import check_model
from tests.helpers import default_model, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_coefficients_roundtrip_and_shape_check(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    theta = torch.rand(30, 9)
    path = tmp_path / "c.safetensors"
    AT2Attributor(model, tokenizer, theta).save(path)
    assert torch.equal(AT2Attributor.load(path, model, tokenizer).theta, theta)
    save_coefficients(path, torch.rand(12, 9))
    with pytest.raises(ValueError, match="12 layers x 9 heads, but the model has 30 layers x 9 heads"):
        AT2Attributor.load(path, model, tokenizer)


def assert_fingerprint_matches(recorded: str, norms: list[float]) -> None:
    """The recorded per-layer norms are `norms` up to summation order. Another CPU sums the float64 squares in
    another order and moves the last digits (~1e-16 relative); other weights move them far more (rounding one
    layer of the default model to bfloat16: 4e-8 to 4e-6)."""
    assert json.loads(recorded) == pytest.approx(norms, rel=1e-9, abs=0)


@torch.no_grad()
def reordered_fingerprint(model) -> list[float]:
    """attention_fingerprint summed in another order, as another CPU's vector units may sum: the same norms up
    to their last digits."""
    modules = check_model(model)
    flat = [torch.cat([p.double().flatten() for p in modules[layer].parameters()]) for layer in range(len(modules))]
    return [float(torch.linalg.vector_norm(values.flip(0))) for values in flat]


@pytest.mark.parametrize("fingerprint", [attention_fingerprint, reordered_fingerprint],
                         ids=["this-summation-order", "another-summation-order"])
def test_the_packaged_coefficients_are_trained_for_the_default_model(model_and_tokenizer, no_warnings, fingerprint,
                                                                      monkeypatch):
    model, tokenizer = model_and_tokenizer
    monkeypatch.setattr("macs_kernels.apps.at2.coefficients.attention_fingerprint", fingerprint)
    theta, metadata = load_coefficients(DEFAULT_COEFFICIENTS, model)
    assert theta.shape == (30, 9) and theta.abs().sum().item() == pytest.approx(1.0, abs=1e-5)
    assert theta.std() > 0.1 * theta.abs().mean()  # trained: far from the uniform start
    assert metadata["model"] == "SmolLM2-135M-Instruct" and metadata["data"] == "stqa_350.json"
    assert metadata["samples"] == "0..249" and metadata["examples"] == "250"  # 250-349 stay held out
    assert_fingerprint_matches(metadata["attention_fingerprint"], fingerprint(model))
    assert torch.equal(AT2Attributor(model, tokenizer).theta, theta)


def test_the_fingerprint_comparison_refuses_other_weights(model_and_tokenizer):
    model, _ = model_and_tokenizer
    _, metadata = load_coefficients(DEFAULT_COEFFICIENTS)
    norms = attention_fingerprint(model)
    moved = [norm * (1 + 1e-7) if layer == 7 else norm for layer, norm in enumerate(norms)]
    for other in (moved, norms[:-1]):
        with pytest.raises(AssertionError):
            assert_fingerprint_matches(metadata["attention_fingerprint"], other)
    recorded, same_shape = model_record(tiny_llama(seed=0))["attention_fingerprint"], tiny_llama(seed=1)
    with pytest.raises(AssertionError):
        assert_fingerprint_matches(recorded, attention_fingerprint(same_shape))


def test_the_packaged_coefficients_accept_the_default_model_in_bfloat16(model_and_tokenizer, no_warnings):
    from transformers import AutoModelForCausalLM

    model, _ = model_and_tokenizer
    half = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.bfloat16)
    load_coefficients(DEFAULT_COEFFICIENTS, half)


def test_another_model_of_the_same_shape_warns(tmp_path, no_warnings):
    trained_for, other = tiny_llama(seed=0), tiny_llama(seed=1)
    path = tmp_path / "theta.safetensors"
    AT2Attributor(trained_for, None, torch.rand(3, 4)).save(path)  # no tokenizer needed to save or load
    load_coefficients(path, trained_for)
    with pytest.warns(UserWarning, match=r"trained for .*not for this model .*attention weights differ"):
        AT2Attributor.load(path, other, None)
    # Files without a fingerprint fall back to the recorded name.
    other.config._name_or_path = "/models/my-model"
    save_coefficients(path, torch.rand(3, 4), {"model": "some-org/another-model"})
    with pytest.warns(UserWarning, match="'some-org/another-model'.*the names differ"):
        load_coefficients(path, other)
    save_coefficients(path, torch.rand(3, 4))  # records nothing: nothing to check
    load_coefficients(path, other)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    pickled = tmp_path / "theta.pt"
    torch.save({"theta": torch.rand(30, 9)}, pickled)

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(ValueError, match="not a safetensors"):
        load_coefficients(pickled)
    good = tmp_path / "theta.safetensors"
    save_coefficients(good, torch.ones(2, 3))
    assert torch.equal(load_coefficients(good)[0], torch.ones(2, 3))
