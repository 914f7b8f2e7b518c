"""`macs-kernels explain --method at2` end to end on the default model."""
from __future__ import annotations

import json

import pytest
import torch

from macs_kernels.apps.at2 import save_coefficients
from macs_kernels.apps.cli import main
from tests.helpers import QUESTIONS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_explain_at2_writes_sources_and_scores(tmp_path):
    question, context = QUESTIONS[2]
    coefficients = tmp_path / "uniform.safetensors"
    save_coefficients(coefficients, torch.full((30, 9), 1.0 / 270))
    out, page = tmp_path / "at2.json", tmp_path / "at2.html"
    assert main(["explain", "--method", "at2", "--question", question, "--context", context, "--max-new-tokens", "5",
                 "--coefficients", str(coefficients), "--json", str(out), "--html", str(page)]) == 0
    data = json.loads(out.read_text())
    assert data["method"] == "at2" and data["source_type"] == "sentence"
    sources = data["sources"]
    assert [s["text"] for s in sources] == ["The Eiffel Tower stands in Paris, France.",
                                            "It was built in 1889 for a fair."]
    for s in sources:
        a, b = s["char_span"]
        assert context[a:b] == s["text"] and s["token_span"][0] < s["token_span"][1]
    assert sources[0]["token_span"][1] == sources[1]["token_span"][0]
    # Uniform coefficients: the score is the mean attention share, positive and below 1 in total.
    assert all(s["score"] > 0 for s in sources) and sum(s["score"] for s in sources) < 1
    assert "Paris, France." in page.read_text()


def test_sources_partition_the_context_at_every_granularity():
    from macs_kernels.api.models import load_tokenizer
    from macs_kernels.apps.at2.sources import make_sources, sentence_spans, source_index
    from macs_kernels.apps.evaluation.alignment import align_qa

    context = 'Dr. Smith arrived. "Is it late?" she asked!\n\nThe train left at 5.30 pm.  It was full.'
    assert [context[a:b] for a, b in sentence_spans(context)] == [
        "Dr.", "Smith arrived.", '"Is it late?"', "she asked!", "The train left at 5.30 pm.", "It was full."]
    alignment = align_qa(load_tokenizer(), "When did the train leave?", context)
    first, stop = alignment.context_tokens
    for kind, count in (("token", stop - first), ("word", len(context.split())), ("sentence", 6)):
        sources = make_sources(alignment, context, kind)
        assert len(sources) == count
        index = source_index(sources, alignment.context_tokens)  # raises unless every token has one source
        assert torch.equal(index, index.sort().values)  # consecutive runs, in order
        for source in sources:
            a, b = source.char_span
            assert context[a:b] == source.text


def test_attributor_generation_and_given_response_agree():
    """explain() on a generation (queries captured while generating) and on the same response given
    (one forward) give the same source scores, also for a sub-range of target tokens."""
    from macs_kernels.apps.at2 import AT2Attributor
    from tests.helpers import default_model

    model, tokenizer = default_model()
    attributor = AT2Attributor(model, tokenizer, torch.rand(30, 9))
    question, context = QUESTIONS[0]
    generated = attributor.explain(question, context, max_new_tokens=5, sources="word")
    assert generated.target == (0, generated.response_ids.numel()) and len(generated.sources) == len(context.split())
    for target in (None, (1, 3)):
        online = generated if target is None else attributor.explain(question, context, max_new_tokens=5,
                                                                     sources="word", target=target)
        given = attributor.explain(question, context, response_ids=generated.response_ids, sources="word",
                                   target=target)
        assert torch.allclose(online.scores, given.scores, rtol=1e-5, atol=1e-6)
