"""AT2 features use each layer's own softmax scale: checked against eager output_attentions on models
whose scale is not head_dim ** -0.5 (Granite's attention_multiplier) or differs per layer (GPT-2 with
scale_attn_by_inverse_layer_idx)."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import trace_tensors
from macs_kernels.api.models import load_tokenizer
from macs_kernels.apps.at2 import AT2Attributor
from macs_kernels.apps.at2.features import forward_capture, response_token_features
from macs_kernels.apps.at2.sources import make_sources
from macs_kernels.apps.evaluation.alignment import align_qa
from tests.helpers import QUESTIONS, eager_attentions
from tests.tolerances import RELATIVE_ERROR, relative_error

PROMPT, RESPONSE = torch.tensor([5, 17, 33, 2, 71, 9, 40, 11, 60]), torch.tensor([12, 50, 3, 8])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def granite(vocab_size: int = 97):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    # head_dim 8: the default scale would be 0.354, the model uses 0.9.
    config = GraniteConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.9,
                           max_position_embeddings=256, initializer_range=0.2)
    return GraniteForCausalLM(config).eval()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=2, n_positions=64, initializer_range=0.2,
                        scale_attn_by_inverse_layer_idx=True, bos_token_id=1, eos_token_id=96)
    return GPT2LMHeadModel(config).eval()


MODELS = {"granite": granite, "gpt2": gpt2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def test_the_models_scales_are_not_the_head_dim_default(model):
    capture = forward_capture(model, PROMPT, RESPONSE)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    expected = [float(module.scaling) for module in model.modules() if hasattr(module, "scaling")
                and isinstance(getattr(module, "layer_idx", None), int)]
    assert capture.scales == expected
    assert all(abs(scale - head_dim ** -0.5) > 0.05 for scale in capture.scales[1:])


def test_one_forward_features_match_output_attentions(model):
    attentions = eager_attentions(model, PROMPT, RESPONSE)
    rows = RESPONSE.numel()
    for start, end in ((0, PROMPT.numel()), (3, 7)):
        capture = forward_capture(model, PROMPT, RESPONSE)
        got = capture.features(source_start=start, source_end=end)[0]
        ref = torch.stack([layer[:, -rows:, start:end].double().sum(1) / rows for layer in attentions])
        assert relative_error(got, ref) <= RELATIVE_ERROR[torch.float32]
    trained = response_token_features(model, PROMPT, RESPONSE, (3, 7))  # what `at2 train` collects
    assert relative_error(trained, ref.flatten(0, 1)) <= RELATIVE_ERROR[torch.float32]


def test_trace_tensors_at2_features_match_output_attentions(model):
    traced = trace_tensors(model, PROMPT, RESPONSE, at2=True)
    attentions = eager_attentions(model, PROMPT, RESPONSE)
    n = PROMPT.numel()
    for k in range(RESPONSE.numel()):
        ref = torch.stack([layer[:, n - 1 + k, :n].double() for layer in attentions])
        assert relative_error(traced.at2_features[k], ref) <= RELATIVE_ERROR[torch.float32]


def test_attributor_scores_match_output_attentions_on_granite():
    """AT2Attributor.explain end to end (alignment, sources, theta) on a Granite model with the default
    tokenizer's vocabulary: each sentence's score from eager attention rows."""
    tokenizer = load_tokenizer()
    model = granite(vocab_size=len(tokenizer))
    theta = torch.rand(3, 4)
    question, context = QUESTIONS[2]
    response = torch.tensor(tokenizer(" In Paris.")["input_ids"])
    explanation = AT2Attributor(model, tokenizer, theta).explain(question, context, response_ids=response)
    alignment = align_qa(tokenizer, question, context)
    attentions = eager_attentions(model, torch.tensor(alignment.input_ids), response)
    rows = response.numel()
    sources = make_sources(alignment, context, "sentence")
    assert [s.text for s in explanation.sources] == [s.text for s in sources] and len(sources) == 2
    ref = torch.tensor([
        sum(float(theta[layer, head]) * float(attentions[layer][head, -rows:, a:b].double().sum() / rows)
            for layer in range(3) for head in range(4))
        for a, b in (source.token_span for source in sources)
    ], dtype=torch.float64)
    assert relative_error(explanation.scores, ref) <= RELATIVE_ERROR[torch.float32]
