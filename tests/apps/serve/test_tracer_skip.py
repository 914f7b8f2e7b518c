"""ContinuousTracer.skip, which the server uses for requests without attribution: a skipped request gets no
MACS rows (no work) while the request batched beside it is traced as usual."""
from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from macs_kernels.engines.continuous import attach_continuous
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, eager_macs, tiny_llama

pytestmark = NEEDS_CONTINUOUS_BATCHING


def test_a_skipped_request_gets_no_rows_and_its_neighbour_is_traced():
    model = tiny_llama()
    model.set_attn_implementation("sdpa")
    prompts = {"skipped": [1, 5, 9, 14, 3, 7], "traced": [1, 8, 2, 4, 11, 6, 13, 5]}
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    with attach_continuous(model) as tracer:
        manager = model.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, page_size=16, max_batch_tokens=64,
                                                                use_cuda_graph=False),
        )
        manager.start()
        try:
            tracer.skip("skipped")
            for request_id, ids in prompts.items():
                manager.add_request(ids, request_id=request_id, max_new_tokens=3)
            outputs = {}
            while len(outputs) < 2:
                output = manager.get_result(timeout=60)
                assert output is not None, "the manager stopped answering"
                if output.is_finished():
                    outputs[output.request_id] = output
            with pytest.raises(KeyError, match="no MACS rows"):
                tracer.request_rows("skipped")
            log_c, _ = tracer.request_rows("traced")
        finally:
            manager.stop(block=True)
        tracer.release("skipped")
        tracer.release("traced")
    generated = torch.tensor(outputs["traced"].generated_tokens)
    assert log_c.shape == (3, len(prompts["traced"]))
    reference, _ = eager_macs(model, torch.tensor(prompts["traced"]), generated)
    assert (log_c.double() - reference).abs().max() <= 1e-3
