import math

import numpy as np
import pytest
import torch

from macs_kernels.apps.evaluation.faithfulness import (
    faithfulness_curves,
    greedy_generate,
    masked_positions,
    masked_variants,
    masking_order,
    rouge_l_f1,
    teacher_forced_scores,
)
from macs_kernels.apps.evaluation.metrics import FRACTIONS, curve_auc

N, T = 23, 5


@pytest.fixture(scope="module")
def models():
    """The same tiny random Llama (GQA 4:2) under sdpa and eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # Ops this small only pay thread start-up and, on a shared machine, wait for busy cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=60, pad_token_id=60, rope_theta=50.0,
                         initializer_range=0.3)  # large weights: outputs depend visibly on every input
    sdpa = LlamaForCausalLM(config).eval()
    sdpa.config._attn_implementation = "sdpa"
    eager = LlamaForCausalLM(config).eval()
    eager.load_state_dict(sdpa.state_dict())
    eager.config._attn_implementation = "eager"
    yield {"sdpa": sdpa, "eager": eager}
    torch.set_num_threads(threads)


def _ids(length, seed):
    return torch.randint(1, 60, (1, length), generator=torch.Generator().manual_seed(seed))


def _capture_positions(model):
    seen = []
    handle = model.model.rotary_emb.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].flatten().tolist()), with_kwargs=True)
    return seen, handle


def _scores_by_deletion(model, prompt, generated, masked):
    """Independent reference: drop the masked tokens from the sequence, give the rest their original positions."""
    ids = torch.cat([prompt, generated], dim=1)[0]
    keep = [i for i in range(ids.numel()) if i not in set(masked)]
    with torch.no_grad():
        logits = model(input_ids=ids[keep][None], position_ids=torch.tensor([keep]),
                       attention_mask=torch.ones(1, len(keep), dtype=torch.long)).logits[0].double()
    rows = logits[len(keep) - T - 1:-1]
    target = generated[0]
    nll = torch.nn.functional.cross_entropy(rows, target).item()
    return math.exp(nll), rows.gather(1, target[:, None]).mean().item()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_masked_teacher_forcing_equals_deleting_the_tokens_at_their_positions(models, attention):
    model = models[attention]
    prompt, generated = _ids(N, 2), _ids(T, 3)
    masked = [4, 7, 8, 15]
    got = teacher_forced_scores(model, prompt, generated, masked)
    ppl, logit = _scores_by_deletion(model, prompt, generated, masked)
    assert got["perplexity"] == pytest.approx(ppl, rel=1e-5)
    assert got["mean_logit"] == pytest.approx(logit, rel=1e-5, abs=1e-6)
    unmasked = teacher_forced_scores(model, prompt, generated)
    assert unmasked["perplexity"] == pytest.approx(_scores_by_deletion(model, prompt, generated, [])[0], rel=1e-5)
    assert abs(unmasked["perplexity"] - got["perplexity"]) > 1e-4  # the mask changed something


def test_positions_passed_are_the_original_ones(models):
    model = models["sdpa"]
    prompt, generated = _ids(N, 2), _ids(T, 3)
    seen, handle = _capture_positions(model)
    try:
        teacher_forced_scores(model, prompt, generated, [5, 6, 9])
        tokens = greedy_generate(model, prompt, max_new_tokens=4, masked=[5, 6, 9], eos_token_id=[])
    finally:
        handle.remove()
    assert tokens.shape == (1, 4)
    # Teacher forcing: the prompt, then the generation after it; regeneration: the prompt, then one per step.
    assert seen == [list(range(N)), list(range(N, N + T - 1)), list(range(N)), [N], [N + 1], [N + 2]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_greedy_generation(models, attention):
    model = models[attention]
    prompt = _ids(N, 4)
    plain = greedy_generate(model, prompt, max_new_tokens=6, eos_token_id=[])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=60)
    assert plain.tolist() == reference[:, N:].tolist()
    # Masked: each step's argmax of a cache-free forward over the kept tokens at their original positions.
    masked = [3, 10, 11, 12]
    got = greedy_generate(model, prompt, max_new_tokens=6, masked=masked, eos_token_id=[])
    sequence = prompt[0].tolist()
    keep = [i for i in range(N) if i not in masked]
    with torch.no_grad():
        for _ in range(6):
            logits = model(input_ids=torch.tensor([[sequence[i] for i in keep]]), position_ids=torch.tensor([keep]),
                           attention_mask=torch.ones(1, len(keep), dtype=torch.long)).logits
            sequence.append(int(logits[0, -1].argmax()))
            keep.append(len(sequence) - 1)
    assert got[0].tolist() == sequence[N:]
    assert got.tolist() != plain.tolist()
    eos = sequence[N + 1]
    stopped = greedy_generate(model, prompt, max_new_tokens=6, masked=masked, eos_token_id=eos)
    assert stopped[0].tolist() == sequence[N:N + sequence[N:].index(eos) + 1]


def test_a_batch_of_masked_variants_equals_each_run_alone(models):
    model = models["sdpa"]
    prompt, generated = _ids(N, 6), _ids(T, 7)
    masked_sets = [(), (4, 7, 8), (3, 10, 11, 12), tuple(range(1, N, 2))]
    batch, again = masked_variants(model, prompt, generated, masked_sets, regenerate_tokens=8, eos_token_id=[])
    for masked, got in zip(masked_sets, batch):
        alone = teacher_forced_scores(model, prompt, generated, masked)
        assert got["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-5)
        assert got["mean_logit"] == pytest.approx(alone["mean_logit"], rel=1e-5, abs=1e-6)
    alone = [greedy_generate(model, prompt, max_new_tokens=8, masked=masked, eos_token_id=[]) for masked in masked_sets]
    assert [ids.tolist() for ids in again] == [ids.tolist() for ids in alone]
    # An end-of-sequence id that some rows produce: those rows stop there, the others run on.
    eos = alone[1][0, 2].item()
    expected = [ids[0, :ids[0].tolist().index(eos) + 1] if eos in ids[0].tolist() else ids[0] for ids in alone]
    _, got = masked_variants(model, prompt, None, masked_sets, regenerate_tokens=8, eos_token_id=eos)
    assert [ids[0].tolist() for ids in got] == [ids.tolist() for ids in expected]
    assert len({len(ids) for ids in expected}) > 1  # rows really ended at different lengths


def test_bad_input_is_refused(models):
    from transformers import AttentionInterface

    model = models["sdpa"]
    with pytest.raises(ValueError, match="masked positions"):
        teacher_forced_scores(model, _ids(N, 2), _ids(T, 3), [0])
    with pytest.raises(ValueError, match=r"\(1, length"):
        teacher_forced_scores(model, _ids(N, 2)[0], _ids(T, 3))
    AttentionInterface.register("evaltest_nomask", AttentionInterface["sdpa"])
    model.config._attn_implementation = "evaltest_nomask"
    try:
        with pytest.raises(ValueError, match="no registered mask function"):
            greedy_generate(model, _ids(N, 2), max_new_tokens=2, masked=[3])
    finally:
        model.config._attn_implementation = "sdpa"


def test_masking_order_and_fractions():
    scores = [0.1, 0.9, 0.5, 0.9, -1.0]
    assert masking_order(scores, "mif").tolist() == [1, 3, 2, 0, 4]
    assert masking_order(scores, "lif").tolist() == [4, 0, 2, 1, 3]
    assert masked_positions(masking_order(scores, "mif"), 0.4, 10) == [11, 13]
    assert masked_positions(np.arange(200), 0.01, 5) == [5, 6]
    assert masked_positions(np.arange(30), 0.05, 0) == [0, 1]  # 1.5: the nearest count
    assert masked_positions(np.arange(10)[::-1], 0.15, 0) == [8, 9]  # 0.15 * 10 = 1.4999999999999998
    assert masked_positions(np.arange(30), 0.0, 0) == []


def test_rouge_l_f1():
    # LCS "the cat on mat" = 4 tokens: P = 4/4, R = 4/6.
    assert rouge_l_f1("the cat sat on the mat", "The cat on mat") == pytest.approx(0.8)
    assert rouge_l_f1("Paris", "London") == 0.0


class _DigitsTokenizer:
    """Decodes ids as space-separated numbers: ROUGE-L then compares the token sequences."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 60))


def test_faithfulness_curves(models):
    model = models["sdpa"]
    prompt = _ids(N, 5)
    generated = greedy_generate(model, prompt, max_new_tokens=T, eos_token_id=[])
    context = (3, 21)
    scores = np.linspace(-1, 1, 18)[np.random.default_rng(0).permutation(18)]
    result = faithfulness_curves(model, _DigitsTokenizer(), prompt, generated, context, scores, max_new_tokens=T)
    curves = result["curves"]
    for metric in ("perplexity", "mean_logit", "rouge_l"):
        assert curves["mif"][metric][0] == curves["lif"][metric][0]
        assert result["srg"][metric] == pytest.approx(
            curve_auc(curves["lif"][metric]) - curve_auc(curves["mif"][metric]))
    assert curves["mif"]["rouge_l"][0] == 1.0
    # f = .10 of 18 tokens: the 2 highest-scored context tokens (MIF).
    top = sorted(3 + i for i in np.argsort(-scores)[:2])
    # The curves run every variant in one batch: equal to one by one within float rounding.
    assert curves["mif"]["perplexity"][3] == pytest.approx(
        teacher_forced_scores(model, prompt, generated, top)["perplexity"], rel=1e-5)
    again = greedy_generate(model, prompt, max_new_tokens=T, masked=top)
    assert curves["mif"]["rouge_l"][3] == pytest.approx(rouge_l_f1(
        _DigitsTokenizer().decode(generated[0]), _DigitsTokenizer().decode(again[0])))

    random = faithfulness_curves(model, _DigitsTokenizer(), prompt, generated, context, None, max_new_tokens=T,
                                 rng=np.random.default_rng(7), regenerate=False)
    assert set(random["srg"]) == {"perplexity", "mean_logit"}
    first, second = np.random.default_rng(7).permutation(18), np.random.default_rng(7).permutation(18)
    assert first.tolist() == second.tolist()  # so the two orders below are the rng's first two draws
    rng = np.random.default_rng(7)
    mif_order, lif_order = rng.permutation(18), rng.permutation(18)
    for order, name in ((mif_order, "mif"), (lif_order, "lif")):
        masked = masked_positions(order, FRACTIONS[-1], 3)
        assert random["curves"][name]["perplexity"][-1] == pytest.approx(teacher_forced_scores(
            model, prompt, generated, masked)["perplexity"], rel=1e-5)
    with pytest.raises(ValueError, match="needs an rng"):
        faithfulness_curves(model, _DigitsTokenizer(), prompt, generated, context, None, max_new_tokens=T)


@pytest.mark.slow
def test_default_model_masking_the_context_of_a_qa_prompt():
    from macs_kernels.api.models import load_model
    from macs_kernels.apps.evaluation.alignment import align_qa

    model, tokenizer = load_model()
    context = "The Rhine flows through Cologne. Cologne Cathedral is a Gothic church."
    alignment = align_qa(tokenizer, "Which river flows through Cologne?", context)
    prompt = torch.tensor([alignment.input_ids])
    generated = greedy_generate(model, prompt, max_new_tokens=4)
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert generated.tolist() == reference[:, prompt.shape[1]:].tolist()
    start = alignment.context_tokens[0]
    masked = [start + i for i in np.flatnonzero(alignment.span_labels(4, 9))]  # "Rhine"
    got = teacher_forced_scores(model, prompt, generated, masked)
    ids = torch.cat([prompt, generated], dim=1)[0]
    keep = [i for i in range(ids.numel()) if i not in masked]
    with torch.no_grad():
        logits = model(input_ids=ids[keep][None], position_ids=torch.tensor([keep]),
                       attention_mask=torch.ones(1, len(keep), dtype=torch.long)).logits[0, -generated.shape[1] - 1:-1]
    nll = torch.nn.functional.cross_entropy(logits.double(), generated[0]).item()
    assert got["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert got["perplexity"] > teacher_forced_scores(model, prompt, generated)["perplexity"]
