"""Engines and the teacher-forced reference for the vLLM tests (they run in vLLM's own environment; every module
skips without vllm)."""
import gc
import os
import platform

import pytest
import torch

from tests.helpers import eager_macs

TOLERANCE = 1e-3  # |d log c| against the teacher-forced eager reference
# Rows follow what the engine computed. vLLM's CPU kernels (its oneDNN GEMMs and attention, chosen per instruction
# set and batch size) may lie further from eager than float32 rounding on some machines; rows that follow such an
# engine are allowed ENGINE_FACTOR times the engine's own distance from eager in its log-probabilities (measured
# beside them, `engine_error`), never less than TOLERANCE. With every GEMM of the engine in bfloat16
# (ONEDNN_DEFAULT_FPMATH_MODE=BF16) the rows' distance was at most 1.5 times the engine's.
ENGINE_FACTOR = 5.0


def tiny_llama(folder):
    """A small random Llama (GQA 4:2, 2 layers) with the default model's tokenizer. Head size 32: vLLM's CPU
    attention takes head sizes of 32 and up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from macs_kernels.api.models import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
        # Peaked attention: near-uniform rows make every token score alike.
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", autouse=True)
def _vllm_environment():
    """A 1 GiB KV cache; the engine core in this process unless a test asks for vLLM's multiprocessing engine."""
    saved = {name: os.environ.get(name) for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def make_llm(path, **options):
    from vllm import LLM

    from macs_kernels.vllm import WORKER_EXTENSION

    settings = dict(dtype="float32", max_model_len=2048, enforce_eager=True, max_num_seqs=8,
                    worker_extension_cls=WORKER_EXTENSION, disable_log_stats=False)
    return LLM(path, **(settings | options))


def shut_down(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="session")
def tiny_reference(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@torch.no_grad()
def engine_error(llm, model, prompts, tokens: int) -> float:
    """max |d log p| between the log-probabilities vLLM gives its generated tokens of `prompts` (greedy, `tokens`
    each, one batch) and the eager model's on the same tokens: how far the engine's own arithmetic lies from eager
    on this machine for a batch of this shape (the first token's comes out of the prefill pass, the others out of
    decode passes). Independent of macs_kernels (no attribution asked); reads the prefix cache as any request does
    (prompt log-probabilities would skip it)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    worst = 0.0
    for output in llm.generate(prompts, params):
        sequence = output.outputs[0]
        prompt, generated = list(output.prompt_token_ids), list(sequence.token_ids)
        eager = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:].double().log_softmax(-1)
        for position, (token, entry) in enumerate(zip(generated, sequence.logprobs)):
            worst = max(worst, abs(entry[token].logprob - eager[position, token].item()))
    return worst


def machine() -> str:
    """The CPU the engine ran on and the attention ISA vLLM picked, for failure messages (never raises)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        return (f"{names[0] if names else platform.machine()}; avx512 {torch.cpu._is_avx512_supported()}, amx "
                f"{torch.cpu._is_amx_tile_supported()}; vLLM float32 attention ISA {_get_attn_isa(torch.float32, 128)}")
    except Exception as error:  # the message it decorates matters more
        return f"{platform.machine()} ({type(error).__name__} reading the CPU)"


def largest_difference(model, explanations, engine: float = 0.0, **config) -> float:
    """max |d log c| of every explanation's rows against the teacher-forced eager trace of its own tokens,
    asserting it is within TOLERANCE, or ENGINE_FACTOR times `engine` (engine_error of the batch) where larger."""
    worst = 0.0
    for explanation in explanations:
        reference, _ = eager_macs(model, explanation.input_ids, explanation.generated_ids, **config)
        assert explanation.step_log_c.shape == reference.shape
        worst = max(worst, (reference - explanation.step_log_c).abs().max().item())
    allowed = max(TOLERANCE, ENGINE_FACTOR * engine)
    assert worst <= allowed, (f"max |d log c| {worst:.3g} > {allowed:.3g} (the engine's own |d log p| {engine:.3g}) "
                              f"on {machine()}")
    print(f"max |d log c| = {worst:.2e} (engine |d log p| {engine:.2e})")
    return worst
