"""The eval runner scores attnlrp and atman (computed from the model after the generation) on a tiny model with
the default tokenizer: their AUC-PR lines equal those of the methods' own functions on the same generation."""
import json

import numpy as np
import torch

from macs_kernels.apps.evaluation.alignment import align_qa
from macs_kernels.apps.evaluation.baselines import atman, attnlrp
from macs_kernels.apps.evaluation.data import QASample
from macs_kernels.apps.evaluation.methods import DEFAULT_METHODS, parse_methods
from macs_kernels.apps.evaluation.runner import EvalSettings, run_eval
from macs_kernels.apps.evaluation.scoring import score_auc
from tests.helpers import QUESTIONS


def _tiny_model_for_the_default_tokenizer():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from macs_kernels.api.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=2, eos_token_id=2,
                         bos_token_id=1, initializer_range=0.2)
    return LlamaForCausalLM(config).eval(), tokenizer


def test_runner_scores_attnlrp_and_atman(tmp_path):
    model, tokenizer = _tiny_model_for_the_default_tokenizer()
    question, context = QUESTIONS[0]
    answer = "William Shakespeare"
    sample = QASample(0, question, context, ((answer, context.index(answer)),))
    methods = parse_methods("attnlrp,atman")
    assert "attnlrp" not in DEFAULT_METHODS and "atman" not in DEFAULT_METHODS
    settings = EvalSettings(model_name="tiny", dtype="float32", max_new_tokens=3, data="inline", faithfulness_n=0,
                            records_root=str(tmp_path / "records"))
    out = tmp_path / "eval.jsonl"
    run_eval(model, tokenizer, [sample], methods, settings, out, progress=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    generated = torch.tensor(next(line for line in lines if line["kind"] == "sample")["generated_ids"])
    auc = {line["method"]: line for line in lines if line["kind"] == "auc"}
    assert set(auc) == {"attnlrp", "atman"}

    alignment = align_qa(tokenizer, question, context)
    prompt = torch.tensor(alignment.input_ids)
    start, stop = alignment.context_tokens
    labels = alignment.answer_labels(sample.answers)
    want = {"attnlrp": attnlrp.relevance(model, prompt, generated).double().numpy(),
            "atman": atman.relevance(model, prompt, generated).double().numpy()}
    for name, method in zip(("attnlrp", "atman"), methods):
        rank = want[name][:, start:stop]
        assert np.isfinite(rank).all()
        expected = score_auc(method, 0, {"rank": rank, "aggregate": rank.mean(0), "paper_form": rank}, labels)
        assert auc[name]["per_step"] == expected["per_step"]
        assert auc[name]["best"] == expected["best"] and 0 <= auc[name]["best"] <= 1
