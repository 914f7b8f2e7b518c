"""The conformance suite's model (a small random Llama with the default model's tokenizer and chat template)
and its server process."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY, eager_attentions, eager_macs, tiny_chat_model

__all__ = ["TINY", "eager_at2_features", "eager_log_c"]


def eager_log_c(model, prompt_ids, generated_ids):
    return eager_macs(model, prompt_ids, generated_ids)[0]


def eager_at2_features(model, prompt_ids, generated_ids, steps: int):
    """(L, H, N) float64: each head's eager attention on the N prompt tokens, averaged over the `steps` query
    rows that made the generated tokens (row k: the query at position N - 1 + k)."""
    n = len(prompt_ids)
    attentions = eager_attentions(model, prompt_ids, generated_ids[:steps])
    return torch.stack([layer[:, n - 1 : n - 1 + steps, :n].double().mean(dim=1) for layer in attentions])


@pytest.fixture(scope="session")
def chat_model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conformance_model")
    tiny_chat_model(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(chat_model_folder):
    from macs_kernels.api.models import load_model

    return load_model(str(chat_model_folder))


@pytest.fixture(scope="session")
def at2_theta(chat_model, tmp_path_factory):
    """(path, theta): random AT2 coefficients recorded for the conformance model, for the server's AT2 scores."""
    from macs_kernels.apps.at2.coefficients import model_record, model_shape, save_coefficients

    model, _ = chat_model
    theta = torch.randn(*model_shape(model), generator=torch.Generator().manual_seed(5))
    path = tmp_path_factory.mktemp("at2") / "theta.safetensors"
    save_coefficients(path, theta, model_record(model))
    return path, theta


@pytest.fixture(scope="module")
def conformance_server(chat_model_folder, at2_theta):
    # Imported here: the server's extras (fastapi, uvicorn, httpx) are needed by the server's tests alone, and the
    # serve conftest skips whatever imports it without them.
    from tests.apps.serve.conftest import Server

    # A 16-token pass budget chunks every prefill; 128 cache tokens hold two ~60-token requests, so four
    # concurrent ones make the engine offload and restart requests.
    running = Server("--model", str(chat_model_folder), "--served-name", TINY, "--max-batch-tokens", "16",
                     "--cache-tokens", "128", "--page-size", "4", "--at2-coefficients", str(at2_theta[0]))
    yield running
    running.terminate()


# Random models of the real configurations of models whose attention is a variant, at the conformance model's
# size: a window of 8 tokens is shorter than every prompt of the suite, so the window bites in prefill and decode.
WINDOW = 8
VARIANT_MODELS = {  # name -> (config class, its options, attention implementation)
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0}, "eager"),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
               "sdpa"),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}, "sdpa"),
    "qwen2": ("Qwen2Config", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}, "sdpa"),
    "gpt_oss": ("GptOssConfig", {"sliding_window": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1,
                                 "layer_types": ["sliding_attention", "full_attention"]}, "eager"),
}
# A cap that bites: most logits of the random model are past softcap, so attention without the cap makes
# other tokens.
CAPPED_MODELS = {
    "gemma2_cap1": ("Gemma2Config", {"sliding_window": WINDOW, "attn_logit_softcapping": 0.5}, "eager"),
}
# Efficient rows of a window layer project onto its window's values: with head_dim 4, a window of 8 keys holds
# more than D + 1 of them, so the projection is not the identity.
EFFICIENT_WINDOW_MODELS = {
    "gemma3_d4": ("Gemma3TextConfig", {"sliding_window": WINDOW, "head_dim": 4,
                                       "layer_types": ["sliding_attention", "full_attention"]}, "sdpa"),
    "mistral_d4": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 4}, "sdpa"),
}
# Softcapping and sinks alone (every layer a full one): what efficient attention follows.
FULL_VARIANT_MODELS = {
    "gemma2_full": ("Gemma2Config", {"attn_logit_softcapping": 5.0, "layer_types": ["full_attention"] * 2},
                    "eager"),
    "gpt_oss_full": ("GptOssConfig", {"num_local_experts": 2, "num_experts_per_tok": 1,
                                      "layer_types": ["full_attention"] * 2}, "eager"),
}


def variant_model(name: str):
    """(model, tokenizer): a small random model of `name`'s configuration with the default model's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM

    from macs_kernels.api.models import load_tokenizer

    tokenizer = load_tokenizer()
    models = VARIANT_MODELS | FULL_VARIANT_MODELS | EFFICIENT_WINDOW_MODELS | CAPPED_MODELS
    config_class, options, implementation = models[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.2, **options,
    })
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    for module in model.modules():  # gpt-oss initialises its sinks to 0; random ones make them matter
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model, tokenizer


@pytest.fixture(scope="session")
def variant_models():
    """name -> (model, tokenizer), built on first use."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = variant_model(name)
        return built[name]

    return get
