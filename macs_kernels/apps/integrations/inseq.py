"""MACS as an attribution method of inseq (https://github.com/inseq-team/inseq).

    import inseq
    import macs_kernels.apps.integrations.inseq  # registers the method "macs"
    attribution_model = inseq.load_model(model, "macs", tokenizer=tokenizer, pooling="mean")
    out = attribution_model.attribute("The capital of France is", generation_args={"max_new_tokens": 8})

Like inseq's own "attention" method this is a final-step method: one teacher-forced trace
(`macs_kernels.trace_tensors`) of the whole generation gives every step. For each generated token the
target attributions hold MACS's scores over the prompt tokens, Explanation.step_scores's definition
(z-scores of log c, `macs_kernels.api.explanation.log_zscores`), and NaN over earlier generated tokens
(MACS spreads their attention over the prompt instead of scoring them). Load keyword arguments are
MacsConfig fields. Needs a decoder-only model whose attention macs_kernels can trace (sdpa or eager).
"""
from __future__ import annotations

import torch
from inseq.attr.feat.feature_attribution import FeatureAttribution
from inseq.data import FeatureAttributionStepOutput

from macs_kernels.api.explanation import log_zscores
from macs_kernels.apps.interop import trace_tensors
from macs_kernels.core.config import MacsConfig


class MacsAttribution(FeatureAttribution):
    """MACS scores (z-scores of log c) of the prompt tokens for every generated token."""

    method_name = "macs"

    def __init__(self, attribution_model, **config):
        super().__init__(attribution_model)
        if attribution_model.is_encoder_decoder:
            raise NotImplementedError("MACS is defined for decoder-only models")
        self.config = MacsConfig(**config).as_dict()
        # Scores come from the trace, not from a target function or gradients.
        self.use_predicted_target = False
        self.is_final_step_method = True
        self._prompt_end = None

    def attribute(self, batch, attributed_fn, attr_pos_start=None, attr_pos_end=None, **kwargs):
        # The prompt ends where attribution starts; attribute_step only sees token ids.
        self._prompt_end = attr_pos_start
        return super().attribute(batch, attributed_fn, attr_pos_start, attr_pos_end, **kwargs)

    def attribute_step(self, attribute_fn_main_args, attribution_args={}) -> FeatureAttributionStepOutput:  # noqa: B006
        prefix_ids, target_ids, _, prefix_mask = attribute_fn_main_args["additional_forward_args"][:4]
        ids = torch.cat([prefix_ids, target_ids.view(-1, 1).to(prefix_ids.device)], dim=1)
        mask = torch.cat([prefix_mask, torch.ones_like(target_ids.view(-1, 1)).to(prefix_mask.device)], dim=1)
        prompt_end = self._prompt_end
        batch, length = ids.shape
        scores = torch.full((batch, length, length), float("nan"))
        model = self.attribution_model.model
        for item in range(batch):
            pads = int((mask[item] == 0).sum())  # inseq pads decoder-only batches on the left
            traced = trace_tensors(model, ids[item, pads:prompt_end], ids[item, prompt_end:], **self.config)
            for step, row in enumerate(log_zscores(traced.log_c)):
                scores[item, pads:prompt_end, prompt_end - 1 + step] = row
        return FeatureAttributionStepOutput(source_attributions=None, target_attributions=scores, step_scores={})
