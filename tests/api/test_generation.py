"""The generation defaults (pad and end-of-sequence ids) and the one builder of an Explanation."""
import types

import pytest
import torch

from macs_kernels.api.explanation import build_explanation
from macs_kernels.api.generation import eos_ids, pad_id


def _model(pad=None, eos=None):
    return types.SimpleNamespace(generation_config=types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos))


def _tokenizer(pad=None, eos=None):
    return types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos)


def test_pad_and_end_ids_come_from_the_tokenizer_then_the_model():
    assert eos_ids(_model(eos=[7, 9]), _tokenizer(eos=2)) == {2, 7, 9}
    assert pad_id(_model(eos=[7, 9]), _tokenizer(pad=0, eos=2)) == 0
    assert pad_id(_model(eos=[7, 9]), _tokenizer(eos=2)) == 2
    assert pad_id(_model(eos=[9, 7]), _tokenizer()) == 7  # no id of the tokenizer: the smallest end id
    assert pad_id(_model(pad=3, eos=[9, 7])) == 3  # without a tokenizer the model's config names them
    assert pad_id(_model(eos=[9, 7])) == 7
    assert pad_id(_model(), _tokenizer()) is None


def test_an_explanation_is_built_from_ids_and_rows_that_match():
    log_c = torch.tensor([[0.0, -1.0, -2.0], [-2.0, -1.0, 0.0]])
    explanation = build_explanation(None, [4, 5, 6], [8, 9], log_c, {"alpha": 0.8})
    assert explanation.input_tokens == ["#4", "#5", "#6"] and explanation.generated_tokens == ["#8", "#9"]
    assert explanation.generated_ids.dtype == torch.long and explanation.text == ""
    assert explanation.top_k(1, step=1)[0][:2] == (2, "#6")
    with pytest.raises(RuntimeError, match=r"request 7: \(2, 3\) MACS rows for 3 generated tokens of a 3-token"):
        build_explanation(None, [4, 5, 6], [8, 9, 10], log_c, {}, label="request 7")
