"""Shared test fixtures' building blocks: the default model, tiny random models, and the independent
eager-attention MACS reference."""
from __future__ import annotations

import functools

import pytest
import torch

from macs_kernels.api.prompts import qa_messages
from macs_kernels.ops import reference

QUESTIONS = [
    ("Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare around 1600. It is set in Denmark."),
    ("What colour is the sky?", "On a clear day the sky is blue because air scatters short wavelengths."),
    ("Where is the Eiffel Tower?", "The Eiffel Tower stands in Paris, France. It was built in 1889 for a fair."),
]


def continuous_batching_refusal() -> str | None:
    """Why MACS under continuous batching is refused with the installed transformers (None: it runs there)."""
    from macs_kernels.engines.continuous import batching_config_class

    try:
        batching_config_class()
    except RuntimeError as error:
        return str(error)
    return None


def skip_where_continuous_batching_is_refused(output: str) -> None:
    """A run of continuous batching (or of the server, which runs on it) that stopped with the installed transformers'
    refusal in its `output` (< 5.19, the lent GPUs' image) skips; the refusal is
    tests/integration/test_continuous_versions.py's."""
    refusal = continuous_batching_refusal()
    if refusal is not None and refusal in output:
        pytest.skip(refusal)


# The tests that run MACS under continuous batching skip where the installed transformers is refused (the GPU image's
# 5.17); the refusal itself is tested in tests/integration/test_continuous_versions.py.
NEEDS_CONTINUOUS_BATCHING = pytest.mark.skipif(continuous_batching_refusal() is not None,
                                               reason=str(continuous_batching_refusal()))


@functools.cache
def default_model():
    from macs_kernels.api.models import load_model

    return load_model()


def tiny_llama(heads: int = 4, kv_heads: int = 2, layers: int = 3, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=96, bos_token_id=1,
        # Peaked attention: near-uniform rows make z-scores of nearly equal values, all float32 noise.
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


TINY = "tiny-llama"  # the served name of the small random model the default-run tests use


def tiny_chat_model(folder):
    """A small random Llama (GQA 4:2, 2 layers) with the default model's tokenizer and chat template, saved
    to `folder`: the server loads it in a second and answers in milliseconds, so the default run stays fast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from macs_kernels.api.models import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
        # Peaked attention: near-uniform rows make z-scores of nearly equal values, all float32 noise.
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def qa(i: int):
    return qa_messages(*QUESTIONS[i])


# One eager forward with output_attentions over the whole sequence, shared with the benchmarks.
eager_macs = reference.teacher_forced_macs


@torch.no_grad()
def eager_attentions(model, input_ids, generated_ids):
    """Every layer's (H, S, S) softmax attention over prompt + generated[:-1] (1-D ids), one eager forward."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        full = torch.cat([input_ids, generated_ids[:-1]])[None]
        return [layer[0] for layer in model(full, output_attentions=True).attentions]
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def eager_norm_log_c(model, input_ids, generated_ids, **config):
    """log c of attention="norm" recomputed independently: one eager forward with output_attentions over the
    whole sequence, every layer's value vectors taken from its v_proj, each head's row weighted by
    reference.norm_row_reference; step k is the query at position N - 1 + k."""
    layers = model.model.layers
    values = {}
    handles = [layer.self_attn.v_proj.register_forward_hook(
        lambda _module, _inputs, output, i=i: values.__setitem__(i, output[0].double()))
        for i, layer in enumerate(layers)]
    try:
        attentions = eager_attentions(model, input_ids, generated_ids)
    finally:
        for handle in handles:
            handle.remove()
    n = len(input_ids)
    heads = attentions[0].shape[0]
    log_rows = []
    for k in range(len(generated_ids)):
        query = n - 1 + k
        rows = []
        for i, layer in enumerate(layers):
            head_dim = layer.self_attn.head_dim
            v = values[i][: query + 1].view(query + 1, -1, head_dim)  # (K, H_kv, D)
            group = heads // v.shape[1]
            o_weight = layer.self_attn.o_proj.weight.double()
            rows.append(torch.stack([
                reference.norm_row_reference(attentions[i][h, query, : query + 1], v[:, h // group],
                                             o_weight[:, h * head_dim: (h + 1) * head_dim])
                for h in range(heads)
            ]))
        log_rows.append(reference.macs_step_reference(rows, n, **config)[0])
    return torch.stack(log_rows)
