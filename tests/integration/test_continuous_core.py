"""Continuous batching on the core: requests the engine offloads and restarts keep their rows and options,
fused decode passes and efficient attention run inside the batch; every row against the eager reference."""
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestState

from macs_kernels.engines.continuous import attach_continuous
from macs_kernels.ops.torch.packed import Segments
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, eager_macs, tiny_llama
from tests.integration.test_integration_efficient import _efficient_reference as efficient_reference

pytestmark = NEEDS_CONTINUOUS_BATCHING

LOG_C_TOLERANCE = 1e-3
GREEDY = {"do_sample": False, "eos_token_id": -1, "pad_token_id": 0}


@pytest.fixture
def tiny():
    model = tiny_llama(heads=6, kv_heads=2)  # GQA 3:1, head_dim 16
    model.set_attn_implementation("sdpa")
    return model


def generate(model, prompts, max_new_tokens, cb_config, configure=None, **config):
    """generate_batch inside attach_continuous: ({request id: output}, {request id: step_log_c})."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, **GREEDY)
    with attach_continuous(model, **config) as tracer:
        for request_id, options in (configure or {}).items():
            tracer.configure(request_id, **options)
        outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config)
        rows = {request_id: tracer.request_rows(request_id)[0] for request_id in outputs}
    return outputs, rows


def assert_equal_reference(log_c, log_ref):
    assert log_c.shape == log_ref.shape
    assert (log_c.double() - log_ref).abs().max() <= LOG_C_TOLERANCE


def test_requests_the_engine_offloads_and_restarts_keep_their_rows_and_options(tiny, monkeypatch):
    # 16 pages of 4 tokens hold 64 of the 132 tokens three requests need: the engine soft-resets requests
    # (re-queued under the same id with their tokens appended to the prompt), as a loaded server does.
    restarts = []
    restart = RequestState.create_equivalent_initial_request

    def counted(state):
        restarts.append((state.request_id, len(state.generated_tokens)))
        return restart(state)

    monkeypatch.setattr(RequestState, "create_equivalent_initial_request", counted)
    prompts = [list(range(1, 25)), list(range(30, 54)), list(range(60, 84))]
    options = {"req_0": {"alpha": 0.5, "pooling": "mean"}, "req_2": {"redistribute": False}}
    cb_config = ContinuousBatchingConfig(max_batch_tokens=16, page_size=4, num_blocks=16)
    outputs, rows = generate(tiny, prompts, 20, cb_config, configure=options)
    assert any(generated > 0 for _, generated in restarts), f"no request was restarted mid-generation: {restarts}"
    for (request_id, output), prompt in zip(outputs.items(), prompts):
        generated = torch.tensor(output.generated_tokens)
        assert list(output.prompt_ids) == prompt and len(generated) == 20
        log_ref, _ = eager_macs(tiny, torch.tensor(prompt), generated, **options.get(request_id, {}))
        assert_equal_reference(rows[request_id], log_ref)


def test_fused_decode_passes_compute_the_output_from_the_scored_probabilities(tiny, monkeypatch):
    calls = []
    outputs_of = Segments.outputs

    def counted(segments, probabilities, value):
        calls.append(len(segments.starts))
        return outputs_of(segments, probabilities, value)

    monkeypatch.setattr(Segments, "outputs", counted)
    prompts = [list(range(1, 12)), [1, 5, 6, 7, 20, 21], list(range(30, 47))]
    cb_config = ContinuousBatchingConfig(max_batch_tokens=8, page_size=4, num_blocks=48)
    plain, _ = generate(tiny, prompts, 6, cb_config)
    fused, rows = generate(tiny, prompts, 6, cb_config, fused_decode=True)
    assert calls and max(calls) == len(prompts), "decode passes of every request must be fused"
    for request_id, prompt in zip(fused, prompts):
        generated = fused[request_id].generated_tokens
        assert generated == plain[request_id].generated_tokens
        log_ref, _ = eager_macs(tiny, torch.tensor(prompt), torch.tensor(generated))
        assert_equal_reference(rows[request_id], log_ref)


@pytest.mark.parametrize("fused_decode", [None, True])
def test_efficient_attention_requests_share_the_batch_with_softmax_ones(tiny, fused_decode):
    """With the engine's fused_decode=True too: its softmax requests fuse, the efficient ones (which never fuse) do
    not, and asking for them is no conflict."""
    # Prompts longer than head_dim + 1 keys: efficient rows then differ from softmax rows.
    prompts = [list(range(1, 30)), list(range(31, 52)), list(range(60, 85))]
    cb_config = ContinuousBatchingConfig(max_batch_tokens=16, page_size=4, num_blocks=64)
    options = {"req_0": {"attention": "efficient"}, "req_2": {"attention": "efficient"}}
    outputs, rows = generate(tiny, prompts, 5, cb_config, configure=options, fused_decode=fused_decode)
    for (request_id, output), prompt in zip(outputs.items(), prompts):
        generated = torch.tensor(output.generated_tokens)
        softmax_ref, _ = eager_macs(tiny, torch.tensor(prompt), generated)
        if request_id in options:
            log_ref, _ = efficient_reference(tiny, torch.tensor(prompt), generated)
            assert (log_ref - softmax_ref).abs().max() > 10 * LOG_C_TOLERANCE, "efficient rows must differ here"
        else:
            log_ref = softmax_ref
        assert_equal_reference(rows[request_id], log_ref)


def test_a_streaming_reader_gets_each_row_once(tiny):
    prompt = list(range(1, 14))
    gen = GenerationConfig(max_new_tokens=6, **GREEDY)
    cb_config = ContinuousBatchingConfig(max_batch_tokens=8, page_size=4, num_blocks=48)
    with attach_continuous(tiny) as tracer:
        manager = tiny.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
        manager.start()
        try:
            request_id = manager.add_request(prompt, request_id="s", streaming=True)
            cursor, pieces, tokens = 0, [], 0
            while True:
                output = manager.get_result(request_id=request_id, timeout=30)
                assert output is not None, "the manager stopped answering"
                # The engine may already be a pass ahead of this output: read up to its tokens, as a server does.
                new, cursor = tracer.read_rows(request_id, cursor, len(output.generated_tokens))
                assert cursor == len(output.generated_tokens) and len(new) == cursor - tokens
                pieces.append(new)
                tokens = cursor
                if output.is_finished():
                    break
        finally:
            manager.stop(block=True)
        streamed = torch.cat(pieces)
        assert torch.equal(streamed, tracer.request_rows(request_id)[0])
    log_ref, _ = eager_macs(tiny, torch.tensor(prompt), torch.tensor(output.generated_tokens))
    assert_equal_reference(streamed, log_ref)
