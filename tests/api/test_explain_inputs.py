"""explain() on token ids without a tokenizer, and a continued conversation's cache handed to generate by the
keyword the model takes (transformers 5.24 warns on the old past_key_values)."""
import warnings

import pytest
import torch
from transformers import DynamicCache

from macs_kernels import explain
from macs_kernels.engines.hf_models import cache_argument
from tests.helpers import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("inputs_model"))


def test_token_ids_need_no_tokenizer(chat_model):
    model, tokenizer = chat_model
    ids = torch.tensor(tokenizer("Why is the sky blue?")["input_ids"])
    with_tokenizer = explain(model, tokenizer, input_ids=ids, max_new_tokens=4)
    without = explain(model, None, input_ids=ids, max_new_tokens=4)
    assert torch.equal(without.generated_ids, with_tokenizer.generated_ids)
    assert torch.equal(without.step_log_c, with_tokenizer.step_log_c)
    assert without.input_tokens == [f"#{i}" for i in ids.tolist()] and without.text == ""
    assert without.generated_tokens == [f"#{i}" for i in with_tokenizer.generated_ids.tolist()]
    assert without.top_k(2) == [(i, f"#{ids[i]}", score) for i, _, score in with_tokenizer.top_k(2)]
    with pytest.raises(ValueError, match="a text prompt needs the model's tokenizer; without one, give the prompt as"):
        explain(model, None, "Why is the sky blue?")
    with pytest.raises(ValueError, match="stop_strings= needs the model's tokenizer"):
        explain(model, None, input_ids=ids, stop_strings=["."])


def _first_turn(model, ids):
    """(the first turn's tokens, prompt and answer, (1, n); the cache that holds them) from plain greedy generate."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        turn_1 = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=2, **cache_argument(model, cache))
    return turn_1, cache


def test_a_continued_conversation_hands_its_cache_without_a_deprecation(chat_model):
    """The first turn, then explain() of the second with the first's cache under either name: no FutureWarning
    about past_key_values, and both names give the rows of the same generation."""
    model, tokenizer = chat_model
    first = torch.tensor([tokenizer("Name a colour.")["input_ids"]])
    results = []
    for name in ("past_key_values", "cache"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*past_key_values.* is deprecated", category=FutureWarning)
            turn_1, cache = _first_turn(model, first)
            both = torch.cat([turn_1[0], torch.tensor(tokenizer(" Another?")["input_ids"])])
            results.append(explain(model, tokenizer, input_ids=both, max_new_tokens=3, **{name: cache}))
    by_old_name, by_new_name = results
    assert torch.equal(by_old_name.input_ids, by_new_name.input_ids)
    assert torch.equal(by_old_name.generated_ids, by_new_name.generated_ids)
    assert by_old_name.step_log_c.shape == (len(by_old_name.generated_ids), len(both))  # every earlier token
    torch.testing.assert_close(by_old_name.step_log_c, by_new_name.step_log_c, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="cache= and past_key_values= both given"):
        explain(model, tokenizer, input_ids=both, max_new_tokens=2, cache=cache, past_key_values=cache)


def test_a_prompt_that_does_not_extend_the_cache_is_refused_before_generation(chat_model, monkeypatch):
    """A cache of earlier turns goes with the whole conversation as the prompt: a prompt no longer than the cache (the
    new turn alone, or the earlier turns without a new token) failed deep inside generation (an index out of bounds
    in the tracer, a reshape of 0 elements in the model)."""
    from macs_kernels import attach

    model, tokenizer = chat_model
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    turn_1, cache = _first_turn(model, first)
    cached = cache.get_seq_length()
    generated = []
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: generated.append(1))
    for prompt, length in (("Another?", None), (turn_1[0, :cached], cached), (turn_1[0, :4], 4)):
        given = dict(input_ids=prompt) if length is not None else dict(prompt=prompt)
        if length is None:
            length = len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True)["input_ids"])
        message = f"the cache holds {cached} tokens and the prompt has {length}: with the cache of earlier turns"
        with pytest.raises(ValueError, match=message):
            explain(model, tokenizer, max_new_tokens=2, cache=cache, **given)
    with pytest.raises(ValueError, match=f"the cache holds {cached} tokens and the prompt has 4"):
        with torch.no_grad(), attach(model):
            model.generate(turn_1[:, :4], max_new_tokens=2, pad_token_id=2, **cache_argument(model, cache))
    assert not generated and cache.get_seq_length() == cached


@pytest.fixture
def no_generation(chat_model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("generation ran")

    model, tokenizer = chat_model
    monkeypatch.setattr(model, "generate", refuse)
    return model, tokenizer


def test_a_prompt_past_the_context_window_is_refused_before_generation(no_generation, monkeypatch):
    model, tokenizer = no_generation
    monkeypatch.setattr(model.config, "max_position_embeddings", 16)
    n = len(tokenizer.apply_chat_template([{"role": "user", "content": "word " * 20}],
                                          add_generation_prompt=True)["input_ids"])
    with pytest.raises(ValueError, match=rf"the prompt has {n} tokens; the model's context window holds 16 "):
        explain(model, tokenizer, "word " * 20)
    with pytest.raises(ValueError, match=r"the prompt has 10 tokens and max_new_tokens=7; the model's context window "
                                         r"holds 16 \(config.max_position_embeddings\), so at most 6 new tokens fit"):
        explain(model, None, input_ids=torch.arange(10), max_new_tokens=7)


@pytest.mark.parametrize("rope, window", [({"rope_type": "linear", "factor": 2.0}, 16), ({"rope_type": "dynamic",
                                                                                           "factor": 2.0}, None)])
def test_the_context_window_under_rope_scaling(chat_model, monkeypatch, rope, window):
    """Transformers' configs of scaled models state the scaled window in max_position_embeddings; dynamic scaling
    rescales as the sequence grows, so it has no fixed limit."""
    from macs_kernels.api.generation import context_window

    model, _ = chat_model
    monkeypatch.setattr(model.config, "max_position_embeddings", 16)
    monkeypatch.setattr(model.config, "rope_parameters", {"rope_theta": 10000.0} | rope, raising=False)
    assert context_window(model) == window


def _word_level_tokenizer(words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"[UNK]": 0} | {f"w{i}": i for i in range(1, words)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_a_tokenizer_of_another_model_is_refused_though_its_ids_fit(no_generation):
    model, _ = no_generation
    small = _word_level_tokenizer(500)  # every id it makes lies inside the model's 49152 rows
    with pytest.raises(ValueError, match=r"is it the model's tokenizer\?\): it has 500 tokens and the model's "
                                         r"embedding 49152 rows"):
        explain(model, small, "w1 w2 w3")


def test_a_tokenizer_whose_end_of_sequence_is_not_the_models_is_warned_of(no_generation):
    import copy

    model, tokenizer = no_generation
    other = copy.deepcopy(tokenizer)
    other.eos_token = other.convert_ids_to_tokens(0)
    with pytest.warns(UserWarning, match=r"the tokenizer's end-of-sequence id 0 is none of the model's \[2\]"):
        with pytest.raises(AssertionError, match="generation ran"):
            explain(model, other, "Why is the sky blue?")


def test_misused_arguments_are_named_before_generation(no_generation):
    """Each of these failed inside generate or the chat template, or named the wrong problem."""
    model, tokenizer = no_generation
    encoding = tokenizer("Why is the sky blue?", return_tensors="pt")  # input_ids and attention_mask
    with pytest.raises(ValueError, match="attention_mask= is explain's own: it pads and masks the prompt itself"):
        explain(model, tokenizer, **encoding, max_new_tokens=2)
    base = model.model
    with pytest.raises(TypeError, match=f"{type(base).__name__} cannot generate: explain a model with its "
                                        "language-model head"):
        explain(base, tokenizer, "Hi", max_new_tokens=2)
    with pytest.raises(TypeError, match="the tokenizer must be a tokenizer object .*got the string 'org/name'"):
        explain(model, "org/name", "Hi", max_new_tokens=2)
    for messages in ([{"role": "user", "content": None}], [{"text": "hi"}], [{"role": 1, "content": "hi"}]):
        with pytest.raises(ValueError, match="message 0 must have a string 'role' and a 'content' that is a string"):
            explain(model, tokenizer, messages, max_new_tokens=2)
