"""The conformance suite's model (a small random Llama with the default model's tokenizer and chat template)
and its server process."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import eager_attentions, eager_macs
from tests.serve.conftest import TINY, Server, tiny_chat_model

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
    from macs_kernels.models import load_model

    return load_model(str(chat_model_folder))


@pytest.fixture(scope="session")
def at2_theta(chat_model, tmp_path_factory):
    """(path, theta): random AT2 coefficients recorded for the conformance model, for the server's AT2 scores."""
    from macs_kernels.at2.coefficients import model_record, model_shape, save_coefficients

    model, _ = chat_model
    theta = torch.randn(*model_shape(model), generator=torch.Generator().manual_seed(5))
    path = tmp_path_factory.mktemp("at2") / "theta.safetensors"
    save_coefficients(path, theta, model_record(model))
    return path, theta


@pytest.fixture(scope="module")
def conformance_server(chat_model_folder, at2_theta):
    # A 16-token pass budget chunks every prefill; 128 cache tokens hold two ~60-token requests, so four
    # concurrent ones make the engine offload and restart requests.
    running = Server("--model", str(chat_model_folder), "--served-name", TINY, "--max-batch-tokens", "16",
                     "--cache-tokens", "128", "--page-size", "4", "--at2-coefficients", str(at2_theta[0]))
    yield running
    running.terminate()
