"""Every generate mode the tracer allows: each returned sequence's rows equal a teacher-forced trace of its own
tokens (`trace_tensors` and the independent eager `output_attentions` reference), with as many rows as generated
tokens (up to and including its end-of-sequence token), N columns, max |d log c| <= 1e-3 in float32.
Every other mode raises before generation, naming the option."""
from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList

from macs_kernels import attach, explain, stream, trace_tensors
from macs_kernels.engines.hf_models import cache_argument, returned_cache
from macs_kernels.ops.torch import beams as torch_beams
from tests.helpers import default_model, eager_macs, eager_norm_log_c, qa, tiny_llama
from tests.integration.test_integration_efficient import _efficient_reference as efficient_reference

LOG_TOLERANCE = 1e-3
EOS = 96  # tiny_llama's end-of-sequence id

# A left-padded batch of 3 prompts of different lengths (pad id 0).
PROMPTS = torch.tensor([[0, 0, 5, 9, 14, 20, 33, 41], [1, 5, 9, 14, 20, 33, 41, 7], [0, 0, 0, 0, 3, 8, 12, 60]])
MASK = (torch.arange(8) >= torch.tensor([[2], [0], [4]])).long()


class IdTokenizer:
    """The tokenizer explain() needs for token-id prompts on a tiny random model: ids are their own text."""

    pad_token_id, eos_token_id, chat_template = 0, EOS, None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def assert_teacher_forced(model, prompt_ids, generated_ids, step_log_c):
    assert step_log_c.shape == (len(generated_ids), len(prompt_ids))
    reference, _ = eager_macs(model, prompt_ids, generated_ids)
    traced = trace_tensors(model, prompt_ids, generated_ids, backend="torch")
    assert (step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE
    assert (step_log_c - traced.log_c).abs().max() <= LOG_TOLERANCE


def traced_sequences(model, ids, mask, *, eos=None, max_new_tokens=6, fused_decode=None, **generate_kwargs):
    """generate inside attach(): per returned sequence (prompt ids, generated ids up to its EOS, step_log_c)."""
    if eos is not None:
        generate_kwargs["eos_token_id"] = eos
    with torch.no_grad(), attach(model, backend="torch", fused_decode=fused_decode) as tracer:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                             **generate_kwargs)
    per_prompt = out.shape[0] // ids.shape[0]
    result = []
    for i, sequence in enumerate(out):
        generated = sequence[ids.shape[1]:].tolist()
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        log_c, _ = tracer.rows(i, len(generated))
        result.append((ids[i // per_prompt][mask[i // per_prompt].bool()], torch.tensor(generated), log_c))
    return result, tracer


@pytest.fixture(scope="module")
def gqa_model():
    return tiny_llama(heads=3, kv_heads=1)


# ---- small random models (GQA 3:1) --------------------------------------------------------------------
@pytest.mark.parametrize("generate_kwargs", [
    dict(num_beams=3),
    dict(num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping=True),
    dict(num_beams=3, num_return_sequences=3, length_penalty=2.0, early_stopping="never"),
    dict(num_beams=3, num_return_sequences=2, do_sample=True),
    dict(do_sample=True, num_return_sequences=2),
    dict(cache_implementation="static"),
    dict(cache_implementation="static", num_beams=3, num_return_sequences=2),
], ids=["beams", "beams-k2-penalty", "beams-k3-never", "beam-sample", "sample-k2", "static", "static-beams"])
def test_left_padded_batch_rows_equal_teacher_forced(gqa_model, generate_kwargs):
    torch.manual_seed(1)
    sequences, _ = traced_sequences(gqa_model, PROMPTS, MASK, **generate_kwargs)
    assert len(sequences) == 3 * generate_kwargs.get("num_return_sequences", 1)
    for prompt_ids, generated_ids, log_c in sequences:
        assert_teacher_forced(gqa_model, prompt_ids, generated_ids, log_c)


def test_beams_ending_at_different_steps(gqa_model):
    # An end-of-sequence id that some beam makes early: the returned beams then end at different steps.
    free, _ = traced_sequences(gqa_model, PROMPTS[1:2], MASK[1:2], num_beams=3, num_return_sequences=3,
                               max_new_tokens=8)
    eos = int(free[1][1][3])
    sequences, _ = traced_sequences(gqa_model, PROMPTS[1:2], MASK[1:2], eos=eos, num_beams=3,
                                    num_return_sequences=3, max_new_tokens=8)
    lengths = [len(generated) for _, generated, _ in sequences]
    assert len(set(lengths)) > 1 and any(generated[-1] == eos for _, generated, _ in sequences), lengths
    for prompt_ids, generated_ids, log_c in sequences:
        assert_teacher_forced(gqa_model, prompt_ids, generated_ids, log_c)


@pytest.mark.parametrize("fused_decode", [False, True], ids=["exact", "fused"])
def test_unpadded_beams_sharing_their_input_keys_equal_teacher_forced(fused_decode, monkeypatch):
    # Unpadded prompts take the dense path, where a prompt's beams read one copy of their input keys: two
    # prompts of 3 beams, 2 KV heads, so a mix-up of prompts, beams or KV heads changes the rows.
    model = tiny_llama(heads=6, kv_heads=2)
    kernel = torch_beams.beam_decode_dense if fused_decode else torch_beams.beam_pool_dense
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["beams"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch_beams, kernel.__name__, counted)
    prompts = torch.stack([PROMPTS[1], torch.tensor([4, 8, 15, 16, 23, 42, 2, 11])])
    sequences, _ = traced_sequences(model, prompts, torch.ones_like(prompts), fused_decode=fused_decode,
                                    num_beams=3, num_return_sequences=2)
    assert calls and set(calls) == {3}
    assert len(sequences) == 4
    for prompt_ids, generated_ids, log_c in sequences:
        assert_teacher_forced(model, prompt_ids, generated_ids, log_c)


def test_static_cache_rows_equal_the_dynamic_cache_run(gqa_model):
    dynamic, _ = traced_sequences(gqa_model, PROMPTS, MASK)
    static, _ = traced_sequences(gqa_model, PROMPTS, MASK, cache_implementation="static")
    cache = StaticCache(config=gqa_model.config, max_cache_len=40)
    passed_in, _ = traced_sequences(gqa_model, PROMPTS, MASK, **cache_argument(gqa_model, cache))
    for (_, tokens, log_c), (_, tokens_s, log_c_s), (_, tokens_p, log_c_p) in zip(dynamic, static, passed_in):
        assert torch.equal(tokens, tokens_s) and torch.equal(tokens, tokens_p)
        assert log_c_s.shape == log_c.shape == log_c_p.shape  # unused cache slots are not inputs
        assert (log_c - log_c_s).abs().max() <= 1e-5 and (log_c - log_c_p).abs().max() <= 1e-5


def _repetitive_prompt(model):
    """A prompt that contains its own greedy continuation: prompt lookup then finds candidates."""
    base = PROMPTS[1:2]
    with torch.no_grad():
        continuation = model.generate(base, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 8:]
    return torch.cat([base[0], continuation, base[0]])[None]


@pytest.mark.parametrize("fused_decode", [False, True], ids=["exact", "fused"])
@pytest.mark.parametrize("assistant", ["prompt_lookup", "second_model", "itself"])
def test_assisted_decoding_scores_every_verified_row(gqa_model, assistant, fused_decode, monkeypatch):
    from macs_kernels.ops.torch import backend as torch_backend

    # Verify passes of an unpadded prompt take the torch path's causal block (no gathers; fused: the block's
    # attention output too, without sdpa); the rows and tokens below prove it exact.
    op = "decode_attention_dense" if fused_decode else "macs_pool_dense"
    kernel, block_calls = getattr(torch_backend, op), []

    def counting(q, *args, **kwargs):
        block_calls.append(q.shape[2] > 1)  # a block of several rows (one row is a block of 1)
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(torch_backend, op, counting)
    ids = _repetitive_prompt(gqa_model)
    kwargs = {
        "prompt_lookup": dict(prompt_lookup_num_tokens=3),
        "second_model": dict(assistant_model=tiny_llama(heads=3, kv_heads=1, seed=1)),
        "itself": dict(assistant_model=gqa_model),
    }[assistant]
    sequences, tracer = traced_sequences(gqa_model, ids, torch.ones_like(ids), max_new_tokens=10,
                                         fused_decode=fused_decode, **kwargs)
    assert max(p["rows"] for p in tracer.passes) > 1, "no verify pass scored several candidates"
    assert any(block_calls)
    (prompt_ids, generated_ids, log_c), = sequences
    with torch.no_grad():
        plain = gqa_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, pad_token_id=0,
                                   **kwargs)
    assert generated_ids.tolist() == plain[0, ids.shape[1]:].tolist()
    assert_teacher_forced(gqa_model, prompt_ids, generated_ids, log_c)


def test_rejected_candidates_are_dropped(gqa_model):
    # A second random model proposes tokens the main model mostly rejects: the cache is cropped, and rows
    # of rejected candidates are replaced by the rows of the tokens generated instead.
    ids = PROMPTS[1:2]
    assistant = tiny_llama(heads=3, kv_heads=1, seed=5)
    sequences, tracer = traced_sequences(gqa_model, ids, torch.ones_like(ids), max_new_tokens=8,
                                         assistant_model=assistant)
    scored = sum(p["rows"] for p in tracer.passes)
    (prompt_ids, generated_ids, log_c), = sequences
    assert scored > len(generated_ids), "no candidate was rejected: the test would not exercise the crop"
    assert_teacher_forced(gqa_model, prompt_ids, generated_ids, log_c)


@pytest.mark.parametrize("attention", ["softmax", "norm"])
def test_continued_conversation_inputs_are_every_earlier_token(gqa_model, attention):
    cache = DynamicCache(config=gqa_model.config)
    with torch.no_grad():
        turn_1 = gqa_model.generate(PROMPTS[1:2], max_new_tokens=4, do_sample=False, pad_token_id=0,
                                    **cache_argument(gqa_model, cache))
    both_turns = torch.cat([turn_1[0], torch.tensor([3, 8, 12, 60])])[None]
    explanation = explain(gqa_model, IdTokenizer(), input_ids=both_turns, max_new_tokens=5,
                          past_key_values=cache, backend="torch", attention=attention)
    assert torch.equal(explanation.input_ids, both_turns[0])
    assert len(explanation.generated_ids) == 5
    if attention == "norm":  # the first pass's keys are the earlier turns' cache plus the new prompt tokens
        reference = eager_norm_log_c(gqa_model, both_turns[0], explanation.generated_ids)
        assert (explanation.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE
    else:
        assert_teacher_forced(gqa_model, both_turns[0], explanation.generated_ids, explanation.step_log_c)
    fresh = explain(gqa_model, IdTokenizer(), input_ids=both_turns, max_new_tokens=5, backend="torch",
                    attention=attention)
    assert torch.equal(fresh.generated_ids, explanation.generated_ids)
    assert (fresh.step_log_c - explanation.step_log_c).abs().max() <= 1e-5


def test_explain_returns_one_explanation_per_returned_sequence(gqa_model):
    prompt = PROMPTS[1]
    single = explain(gqa_model, IdTokenizer(), input_ids=prompt, max_new_tokens=4, num_beams=3)
    several = explain(gqa_model, IdTokenizer(), input_ids=prompt, max_new_tokens=4, num_beams=3,
                      num_return_sequences=2)
    assert not isinstance(single, list)
    assert isinstance(several, list) and len(several) == 2
    assert torch.equal(several[0].generated_ids, single.generated_ids)  # generate's order: best beam first
    for item in several:
        assert torch.equal(item.input_ids, prompt)
        assert_teacher_forced(gqa_model, prompt, item.generated_ids, item.step_log_c)


# ---- refused modes ------------------------------------------------------------------------------------
def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("generate_kwargs,option", [
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(dola_layers="high"), "dola_layers"),
    (dict(num_beams=2, force_words_ids=[[5]]), "force_words_ids"),
    (dict(num_beams=2, num_beam_groups=2, diversity_penalty=1.0), "num_beam_groups"),
    (dict(custom_generate=lambda **_: None), "custom_generate"),
    (dict(cache_implementation="offloaded"), "cache_implementation"),
    (dict(prefill_chunk_size=4), "prefill_chunk_size"),
    (dict(assistant_early_exit=1), "assistant_early_exit"),
    (dict(token_healing=True), "token_healing"),
    (dict(use_cache=False), "use_cache=False"),
], ids=["contrastive", "dola", "constrained", "group-beams", "custom", "offloaded-cache", "chunked-prefill",
        "early-exit", "token-healing", "no-cache"])
def test_unsupported_modes_are_refused_before_generation(gqa_model, generate_kwargs, option):
    calls, handle = _count_forwards(gqa_model)
    try:
        with pytest.raises(NotImplementedError, match=option):
            explain(gqa_model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=3, **generate_kwargs)
        with pytest.raises(NotImplementedError, match=option):
            with torch.no_grad(), attach(gqa_model):
                gqa_model.generate(PROMPTS[1:2], max_new_tokens=3, pad_token_id=0, **generate_kwargs)
    finally:
        handle.remove()
    assert not calls
    assert gqa_model.config._attn_implementation == "sdpa"


def test_compiled_forward_is_refused_naming_torch_compile():
    model = tiny_llama(heads=3, kv_heads=1)
    model.forward = torch.compile(model.forward)  # compiles lazily: nothing runs unless called
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(NotImplementedError, match="torch.compile"):
            explain(model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=3)
    finally:
        handle.remove()
    assert not calls


def test_stream_refuses_several_sequences_and_beams(gqa_model):
    for kwargs, message in ((dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
                            (dict(num_beams=2), "num_beams")):
        with pytest.raises(ValueError, match=message):
            next(stream(gqa_model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=3, **kwargs))


def test_stream_with_prompt_lookup_yields_every_accepted_token(gqa_model):
    ids = _repetitive_prompt(gqa_model)
    explanation = explain(gqa_model, IdTokenizer(), input_ids=ids, max_new_tokens=8, prompt_lookup_num_tokens=3)
    streamed = list(stream(gqa_model, IdTokenizer(), input_ids=ids, max_new_tokens=8, prompt_lookup_num_tokens=3))
    assert [token for token, _ in streamed] == explanation.generated_ids.tolist()
    assert torch.allclose(torch.stack([z for _, z in streamed]), explanation.step_scores)


# ---- efficient and norm attention follow the cache slots ----------------------------------------------
@pytest.mark.parametrize("attention", ["efficient", "norm"])
@pytest.mark.parametrize("generate_kwargs", [
    dict(cache_implementation="static"), dict(num_beams=3, num_return_sequences=2),
], ids=["static", "beams"])
def test_per_slot_attention_state_follows_static_slots_and_beam_reorders(generate_kwargs, attention):
    """Efficient attention's Gram state and norm attention's value norms are kept per cache slot: a static cache
    writes anywhere, beam search reorders the rows."""
    model = tiny_llama(heads=3, kv_heads=1, layers=2)
    ids = torch.arange(3, 33)  # more keys than D + 1 = 17: the efficient rows are projections, not the softmax rows
    result = explain(model, IdTokenizer(), input_ids=ids, max_new_tokens=4, attention=attention, backend="torch",
                     **generate_kwargs)
    for item in result if isinstance(result, list) else [result]:
        if attention == "efficient":
            reference, _ = efficient_reference(model, ids, item.generated_ids)
        else:
            reference = eager_norm_log_c(model, ids, item.generated_ids)
        assert (item.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE
        softmax = trace_tensors(model, ids, item.generated_ids, backend="torch").log_c
        assert (item.step_log_c - softmax).abs().max() > 0.01
    with pytest.raises(NotImplementedError, match=attention):
        explain(model, IdTokenizer(), input_ids=ids, max_new_tokens=3, attention=attention,
                prompt_lookup_num_tokens=3)


def test_norm_attention_refuses_projections_it_cannot_weigh_before_work():
    """A wrapped o_proj (a LoRA layer, a quantised one: a subclass of nn.Linear), a model without o_proj (GPT-2), and
    a model that changes the attention output before o_proj (a norm, a gate) would be weighed by the wrong matrix
    or vectors: refused, naming the option, before any row is returned."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from macs_kernels import attach

    ids = torch.arange(3, 20)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=1,
                                      eos_token_id=96)).eval()

    class Adapted(torch.nn.Linear):
        pass

    wrapped = tiny_llama(heads=3, kv_heads=1, layers=2)
    projection = wrapped.model.layers[1].self_attn.o_proj
    adapted = Adapted(projection.in_features, projection.out_features, bias=False)
    adapted.load_state_dict(projection.state_dict())
    wrapped.model.layers[1].self_attn.o_proj = adapted
    for model, match in ((gpt2, "layer 0.*GPT2Attention.*no plain torch.nn.Linear `o_proj`"),
                         (wrapped, "layer 1.*found Adapted")):
        with pytest.raises(NotImplementedError, match=f"attention='norm' is not supported for this model: {match}"):
            with attach(model, attention="norm"):
                raise AssertionError("attach accepted the model")
    gated = tiny_llama(heads=3, kv_heads=1, layers=2)
    gated.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda _module, args: (args[0] * 0.5,))
    with pytest.raises(NotImplementedError, match="changes the attention output before o_proj"):
        explain(gated, IdTokenizer(), input_ids=ids, max_new_tokens=2, attention="norm", backend="torch")
    plain = explain(gated, IdTokenizer(), input_ids=ids, max_new_tokens=2, backend="torch")  # softmax rows: fine
    assert plain.step_log_c.shape == (2, len(ids))


def test_a_refused_hand_over_to_continuous_batching_leaves_generate_traced(gqa_model):
    """Inside attach(attention="norm"), continuous batching is refused before the hand-over changes the model: the
    block goes on tracing generate."""
    from transformers import GenerationConfig

    with attach(gqa_model, attention="norm", backend="torch") as tracer:
        with pytest.raises(NotImplementedError, match="attention='norm' is not supported under macs_kernels' "
                                                      "continuous engine"):
            gqa_model.generate_batch([[3, 4, 5]], generation_config=GenerationConfig(max_new_tokens=2))
        with torch.no_grad():
            out = gqa_model.generate(PROMPTS[1:2], max_new_tokens=2, do_sample=False, pad_token_id=0)
        log_c = tracer.rows(0)[0]
    reference = eager_norm_log_c(gqa_model, PROMPTS[1], out[0, PROMPTS.shape[1]:])
    assert (log_c.double() - reference).abs().max() <= LOG_TOLERANCE


def test_norm_rows_on_the_triton_backend_equal_the_reference():
    """The weighted rows are formed in torch and pooled by the backend's row update: Triton's on triton."""
    pytest.importorskip("triton")
    from macs_kernels.ops.triton import LAUNCHES

    model = tiny_llama(heads=3, kv_heads=1, layers=2)
    ids = torch.arange(3, 33)
    LAUNCHES.clear()
    traced = explain(model, IdTokenizer(), input_ids=ids, max_new_tokens=3, attention="norm", backend="triton")
    assert LAUNCHES["_pool_kernel"] == 3 * 2  # every layer of every pass
    reference = eager_norm_log_c(model, ids, traced.generated_ids)
    assert (traced.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE


# ---- concurrency (issue 15) ---------------------------------------------------------------------------
def test_a_forward_from_another_thread_while_a_stream_holds_the_model_raises(gqa_model):
    ids = PROMPTS[1]
    expected = explain(gqa_model, IdTokenizer(), input_ids=ids, max_new_tokens=6)
    gate, passes = threading.Event(), []

    def hold_after_two_passes(*_):
        if threading.current_thread().name == "macs-kernels-stream":
            passes.append(1)
            if len(passes) == 2:
                gate.wait(30)

    handle = gqa_model.register_forward_pre_hook(hold_after_two_passes)
    try:
        generator = stream(gqa_model, IdTokenizer(), input_ids=ids, max_new_tokens=6)
        first = next(generator)
        with pytest.raises(RuntimeError, match="another thread"):
            gqa_model.generate(PROMPTS[1:2], max_new_tokens=2, pad_token_id=0)
        with pytest.raises(RuntimeError, match="another thread"), torch.no_grad():
            gqa_model(PROMPTS[1:2])
        gate.set()
        streamed = [first, *generator]
    finally:
        gate.set()
        handle.remove()
    assert [token for token, _ in streamed] == expected.generated_ids.tolist()
    assert torch.allclose(torch.stack([z for _, z in streamed]), expected.step_scores)
    assert gqa_model.config._attn_implementation == "sdpa"


def test_two_threads_explaining_on_one_model_both_get_their_own_rows(gqa_model):
    prompts = [PROMPTS[1], PROMPTS[2][4:]]
    expected = [explain(gqa_model, IdTokenizer(), input_ids=p, max_new_tokens=5) for p in prompts]
    results: dict[int, list] = {0: [], 1: []}
    errors = []

    def run(index):
        try:
            for _ in range(4):
                results[index].append(explain(gqa_model, IdTokenizer(), input_ids=prompts[index], max_new_tokens=5))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force thread switches inside the attach/generate window
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    for index in (0, 1):
        for item in results[index]:
            assert torch.equal(item.generated_ids, expected[index].generated_ids)
            assert torch.equal(item.step_log_c, expected[index].step_log_c)


def test_variant_backends_named_and_a_passed_window_cache():
    """A backend without variant kernels named for a variant: refused before work, naming it; a window model's
    cache passed in is followed."""
    from transformers import GptOssConfig, GptOssForCausalLM, MistralConfig, MistralForCausalLM

    from macs_kernels.engines.hf_models import check_variants
    from macs_kernels.ops import registry

    gpt_oss = GptOssForCausalLM(GptOssConfig(
        vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
    ))
    assert check_variants(gpt_oss, "generate", "exact") == ("sliding_window", "sinks")
    # numba's kernels take no variant: named, it is refused; chosen automatically, the torch kernels run instead.
    with pytest.raises(NotImplementedError, match="backend='numba' has no kernels for attention logit softcapping"):
        registry.variant_backend(("softcap",), "numba", "numba")
    assert registry.variant_backend(("softcap",), None, "numba") == "torch"
    assert registry.variant_backend(("sinks",), "triton", "triton") == "triton"
    assert registry.variant_backend(("sliding_window", "softcap"), "cuda", "cuda") == "cuda"
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=4, pad_token_id=0,
    )).eval()
    # A cache from a plain forward, its window layers already past their window, continued by generate: followed
    # (tests/conformance/test_variants.py has every generate mode with windows).
    ids = torch.randint(1, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = returned_cache(mistral(ids[:, :6]))
    with torch.no_grad(), attach(mistral, backend="torch") as tracer:
        out = mistral.generate(ids, **cache_argument(mistral, cache), max_new_tokens=3, do_sample=False)
    assert_teacher_forced(mistral, ids[0], out[0, 9:], tracer.rows(0)[0])


# ---- the real default model: one check per mode --------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    return default_model()


def _assert_explanations(model, explanations):
    for item in explanations if isinstance(explanations, list) else [explanations]:
        assert len(item.step_log_c) == len(item.generated_ids) == len(item.generated_tokens)
        assert_teacher_forced(model, item.input_ids, item.generated_ids, item.step_log_c)


@pytest.mark.parametrize("generate_kwargs", [
    dict(num_beams=3, num_return_sequences=2),
    dict(do_sample=True, num_return_sequences=2),
    dict(cache_implementation="static"),
    dict(prompt_lookup_num_tokens=3),
], ids=["beams-k2", "sample-k2", "static", "prompt-lookup"])
def test_default_model_rows_equal_teacher_forced(real, generate_kwargs):
    model, tokenizer = real
    torch.manual_seed(2)
    result = explain(model, tokenizer, qa(0), max_new_tokens=6, backend="torch", **generate_kwargs)
    expected = generate_kwargs.get("num_return_sequences", 1)
    assert (len(result) if isinstance(result, list) else 1) == expected
    _assert_explanations(model, result)


@pytest.mark.slow
def test_default_model_batch_of_three_with_beams_and_its_own_assistant(real):
    model, tokenizer = real
    prompts = [qa(0), "Name a primary colour.", qa(2)]
    _assert_explanations(model, explain(model, tokenizer, prompts, max_new_tokens=6, num_beams=3,
                                        num_return_sequences=2, length_penalty=0.8, early_stopping=True))
    _assert_explanations(model, explain(model, tokenizer, qa(1), max_new_tokens=6, assistant_model=model))


def test_default_model_continued_conversation(real):
    model, tokenizer = real
    encoded = tokenizer.apply_chat_template(qa(0), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        turn_1 = model.generate(encoded, attention_mask=torch.ones_like(encoded), max_new_tokens=6, do_sample=False,
                                **cache_argument(model, cache), pad_token_id=tokenizer.eos_token_id)
    follow_up = tokenizer("<|im_end|>\n<|im_start|>user\nWhen?<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False, return_tensors="pt")["input_ids"]
    both_turns = torch.cat([turn_1, follow_up], dim=1)
    explanation = explain(model, tokenizer, input_ids=both_turns, max_new_tokens=5, past_key_values=cache)
    assert torch.equal(explanation.input_ids, both_turns[0])
    _assert_explanations(model, explanation)


# ---- stop strings: a sequence ends where generate stopped it -------------------------------------------
def test_default_model_stop_strings_end_the_explanation_at_the_stop_string(real):
    from macs_kernels.api.models import load_tokenizer

    model, tokenizer = real
    prompt = "Count from one to ten."  # greedy: "1. 1\n2. 2\n..."
    # generate needs the tokenizer for stop strings: explain passes its own, and accepts the same one again.
    for extra in ({}, {"tokenizer": tokenizer}):
        explanation = explain(model, tokenizer, prompt, max_new_tokens=8, stop_strings=["."], **extra)
        assert explanation.generated_tokens == ["1", "."]
        _assert_explanations(model, explanation)
    streamed = list(stream(model, tokenizer, prompt, max_new_tokens=8, stop_strings=["."]))
    assert [token for token, _ in streamed] == explanation.generated_ids.tolist()
    with pytest.raises(ValueError, match="tokenizer= is another tokenizer than explain's own"):
        explain(model, tokenizer, prompt, max_new_tokens=8, stop_strings=["."], tokenizer=load_tokenizer())



class _StopRowZeroAfter(StoppingCriteria):
    """A caller's own stopping criterion: finishes batch row 0 once it has generated `steps` tokens."""

    def __init__(self, prompt_length: int, steps: int):
        self.prompt_length, self.steps = prompt_length, steps

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[0] = input_ids.shape[1] - self.prompt_length >= self.steps
        return done


@pytest.mark.parametrize("eos", [EOS, None], ids=["pads-follow", "no-eos-criterion"])
def test_a_row_finished_by_a_stopping_criterion_has_only_its_own_rows(eos):
    # generate fills a finished row with pads (pad 0 is not EOS) or, without an end-of-sequence criterion,
    # with whatever it picks while the other rows go on: neither belongs to the sequence.
    model = tiny_llama(heads=3, kv_heads=1)
    model.generation_config.eos_token_id = eos
    criteria = StoppingCriteriaList([_StopRowZeroAfter(PROMPTS.shape[1], 2)])
    with torch.no_grad(), attach(model, backend="torch") as tracer:
        out = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=6, pad_token_id=0, do_sample=False,
                             stopping_criteria=criteria)
    generated = out[:, PROMPTS.shape[1]:]
    assert generated.shape[1] == 6 and bool((generated[0, 2:] == 0).all()) == (eos is not None)
    for b, steps in enumerate([2, 6, 6]):
        log_c, _ = tracer.rows(b)
        assert_teacher_forced(model, PROMPTS[b][MASK[b].bool()], generated[b, :steps], log_c)


def test_stream_keeps_the_callers_stopping_criteria():
    """stream() adds its own criterion (the consumer leaving) to the caller's instead of colliding with it."""
    model = tiny_llama(heads=3, kv_heads=1)
    criteria = StoppingCriteriaList([_StopRowZeroAfter(PROMPTS.shape[1], 2)])
    explanation = explain(model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=6, stopping_criteria=criteria)
    streamed = list(stream(model, IdTokenizer(), input_ids=PROMPTS[1], max_new_tokens=6, stopping_criteria=criteria))
    assert [token for token, _ in streamed] == explanation.generated_ids.tolist() and len(streamed) == 2
    assert torch.allclose(torch.stack([z for _, z in streamed]), explanation.step_scores)


STOPS = ["1.", "Red"]


def _first_stop(tokenizer, generated_ids: list[int], eos: int) -> int:
    """How many tokens a sequence keeps: up to its first end-of-sequence token or the first token whose text
    completes a stop string (both kept), else all of them."""
    for k in range(1, len(generated_ids) + 1):
        text = tokenizer.decode(generated_ids[:k])
        if generated_ids[k - 1] == eos or any(text.endswith(stop) for stop in STOPS):
            return k
    return len(generated_ids)


@pytest.mark.parametrize("pad,generate_kwargs", [
    ("<|im_end|>", {}),
    ("<|endoftext|>", {}),
    ("<|endoftext|>", dict(do_sample=True, num_return_sequences=2)),
    # Without a length penalty beam search returns the short hypotheses that end at a stop string.
    ("<|endoftext|>", dict(num_beams=2, num_return_sequences=2, length_penalty=0.0)),
], ids=["pad-is-eos-greedy", "greedy", "sample-k2", "beams-k2"])
def test_default_model_batch_sequences_end_where_generate_stopped_them(real, pad, generate_kwargs):
    from macs_kernels.api.models import load_tokenizer

    model, _ = real
    tokenizer = load_tokenizer()
    tokenizer.pad_token = pad  # <|endoftext|> (id 0) is not the end-of-sequence token <|im_end|> (id 2)
    eos = tokenizer.eos_token_id
    # Greedy: the first ends at "1." after 2 tokens, the second at "Red" after 8, the third at EOS after 14;
    # generate pads the finished ones while the others go on.
    prompts = ["Count from one to ten.", "Name a primary colour.", qa(1)]
    torch.manual_seed(3)
    result = explain(model, tokenizer, prompts, max_new_tokens=16, stop_strings=STOPS, backend="torch",
                     **generate_kwargs)
    assert len(result) == 3 * generate_kwargs.get("num_return_sequences", 1)
    lengths = [len(item.generated_ids) for item in result]
    for item in result:
        ids = item.generated_ids.tolist()
        assert len(ids) == _first_stop(tokenizer, ids, eos), ids
        assert tokenizer.pad_token_id not in ids or tokenizer.pad_token_id == eos
    if not generate_kwargs:
        assert lengths == [2, 8, 14] and result[2].generated_ids[-1] == eos
    if "num_beams" in generate_kwargs:  # a returned beam ended at a stop string before the longest one
        assert any(n < max(lengths) and item.generated_ids[-1] != eos for n, item in zip(lengths, result))
    for item in result:  # the eager reference alone: trace_tensors would add a forward per token
        reference, _ = eager_macs(model, item.input_ids, item.generated_ids)
        assert item.step_log_c.shape == reference.shape == (len(item.generated_ids), len(item.input_ids))
        assert (item.step_log_c.double() - reference).abs().max() <= LOG_TOLERANCE


def test_the_returned_sequences_rows_live_in_the_tracers_row_store(gqa_model):
    """generate resolves its returned sequences (beam ancestry, stops) once it returns and writes their rows into
    `tracer.store`, the RowStore every engine keeps finished rows in: `rows(i)` reads it, so a released sequence
    is gone for both, and the next sequence starts a store of its own."""
    with torch.no_grad(), attach(gqa_model, backend="torch", keep_pooled=True) as tracer:
        out = gqa_model.generate(PROMPTS[:2], attention_mask=MASK[:2], max_new_tokens=4, num_beams=3,
                                 num_return_sequences=2, pad_token_id=0, do_sample=False)
        stored = [tracer.store.rows(i) for i in range(out.shape[0])]
        for i, rows in enumerate(stored):
            assert torch.equal(tracer.rows(i)[0], rows)
            pooled = tracer.pooled_store.rows(i).view(len(rows), gqa_model.config.num_hidden_layers, -1)
            assert torch.equal(tracer.pooled_rows(i), pooled)
        tracer.store.release(0)
        with pytest.raises(KeyError, match="sequence 0 was released"):
            tracer.rows(0)
        assert 1 in tracer.store
        gqa_model.generate(PROMPTS[2:], attention_mask=MASK[2:], max_new_tokens=2, pad_token_id=0, do_sample=False)
        assert tracer.store.count(0) == 2 and 1 not in tracer.store
        with pytest.raises(IndexError, match="outside"):
            tracer.rows(1)
    assert out.shape[0] == 4
    for i, sequence in enumerate(out):
        prompt, generated = PROMPTS[i // 2][MASK[i // 2].bool()], sequence[PROMPTS.shape[1]:].tolist()
        generated = generated[: generated.index(EOS) + 1] if EOS in generated else generated
        assert_teacher_forced(gqa_model, prompt, torch.tensor(generated), stored[i])
