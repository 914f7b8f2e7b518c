"""vLLM with CUDA graphs, emulated without vLLM (its GPU build cannot be installed where a GPU is lent): FLASH_ATTN's
cache layout and the metadata vLLM hands a backend, a decode batch captured once, replayed with new sequence lengths
and block tables written in place, the rows against the eager path and an independent reference.

On a GPU (`gpu` marker) the decode step is captured in a torch.cuda.CUDAGraph; on the CPU the same persistent-buffer
step runs under torch.compile(fullgraph=True) with recompiles refused, which proves the step reads no host value
and branches on no tensor's value."""
import types

import numpy as np
import pytest
import torch

from macs_kernels.core.config import MacsConfig
from macs_kernels.engines.vllm import graphs
from macs_kernels.engines.vllm.tracer import OPTION, VllmTracer, flash_key_pages
from macs_kernels.ops import reference, registry
from macs_kernels.ops.torch.backend import log_floor

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS, LAYERS, MAX_SEQS, MAX_PAGES = 4, 2, 32, 16, 40, 2, 4, 6
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
# Request -> (prompt length, options or None: no attribution). "a" and "b" cross into a new page while decoding.
REQUESTS = {
    "a-0000aaaa": (31, {"alpha": 0.8}),
    "b-0000bbbb": (47, {"pooling": "mean", "redistribute": False}),
    "c-0000cccc": (20, {"pooling": "min", "alpha": 0.5}),
    "d-0000dddd": (26, None),
}
# Decode steps: the runner's batch order (vLLM reorders its batch in place) and which requests run.
DECODE_ORDERS = [["a-0000aaaa", "b-0000bbbb", "c-0000cccc", "d-0000dddd"],
                 ["c-0000cccc", "a-0000aaaa", "d-0000dddd", "b-0000bbbb"],
                 ["c-0000cccc", "d-0000dddd", "a-0000aaaa"]]  # b finished: one padded slot


class Impl:
    """What the tracer reads of FlashAttentionImpl."""

    scale, sliding_window, sinks, logits_soft_cap = DIM ** -0.5, (-1, -1), None, None

    def macs_key_pages(self, layer, kv_cache):
        return flash_key_pages(kv_cache, DIM)


class Runner:
    """What the tracer reads of vLLM's GPU model runner."""

    def __init__(self):
        self.requests = {key: types.SimpleNamespace(
            num_prompt_tokens=n, sampling_params=types.SimpleNamespace(extra_args={} if o is None else {OPTION: o}))
            for key, (n, o) in REQUESTS.items()}
        self.input_batch = types.SimpleNamespace(req_ids=[])
        self.discard_request_mask = types.SimpleNamespace(np=np.zeros(MAX_SEQS, dtype=bool))


class Engine:
    """vLLM's side: FLASH_ATTN caches (logical (blocks, H_kv, block_size, 2 D), each slot's key then value),
    persistent query_start_loc / seq_lens / block-table buffers (the runner's), per-layer keys by request for the
    reference, and the queries of each step."""

    def __init__(self, device, generator):
        self.device, self.generator = device, generator
        self.caches = [torch.full((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), float("nan"), device=device)
                       for _ in range(LAYERS)]
        self.block_table = torch.zeros(MAX_SEQS, MAX_PAGES, dtype=torch.int32, device=device)
        self.free = list(torch.randperm(BLOCKS - 1, generator=generator).add(1).tolist())  # block 0: vLLM's null
        self.pages = {key: [] for key in REQUESTS}
        self.keys = {key: [torch.empty(0, KV_HEADS, DIM) for _ in range(LAYERS)] for key in REQUESTS}

    def step(self, order, new_tokens):
        """Write the step's keys into the caches, fill the block table in batch order; returns (queries per layer
        (T, H, D) on the host, the vLLM-style common metadata with CUDA-graph padding to MAX_SEQS when decoding,
        the eager path's metadata, the padded token count)."""
        counts = [new_tokens.get(key, 1) for key in order]
        for key, count in zip(order, counts):
            start = self.keys[key][0].shape[0]
            while len(self.pages[key]) * BLOCK < start + count:
                self.pages[key].append(self.free.pop())
            positions = torch.arange(start, start + count)
            pages = torch.tensor(self.pages[key])[positions // BLOCK]
            for layer in range(LAYERS):
                new = torch.randn(count, KV_HEADS, DIM, generator=self.generator)
                self.keys[key][layer] = torch.cat([self.keys[key][layer], new])
                self.caches[layer][pages, :, positions % BLOCK, :DIM] = new.to(self.device)
        self.block_table.zero_()  # vLLM's padding rows name its null block
        for i, key in enumerate(order):
            self.block_table[i, : len(self.pages[key])] = torch.tensor(self.pages[key], dtype=torch.int32)
        seq_lens = [self.keys[key][0].shape[0] for key in order]
        decode = all(count == 1 for count in counts)
        padded = MAX_SEQS if decode else len(order)
        ends = np.cumsum([0] + counts + [0] * (padded - len(order)))
        tokens = int(ends[-1]) if not decode else MAX_SEQS
        common = types.SimpleNamespace(
            num_reqs=padded, query_start_loc_cpu=torch.tensor(ends, dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens + [0] * (padded - len(order)), dtype=torch.int32),
            block_table_tensor=self.block_table[:padded])
        eager = types.SimpleNamespace(
            query_start_loc=torch.tensor(ends[: len(order) + 1], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_table=self.block_table[: len(order)])
        queries = [torch.randn(tokens, HEADS, DIM, generator=self.generator) for _ in range(LAYERS)]
        return queries, common, eager, ends


def reference_rows(engine, key, queries_by_step):
    """log c of request `key` per step from contiguous keys: the reference op per layer, the core's floor and log,
    the sum over layers."""
    n, options = REQUESTS[key]
    config = MacsConfig(**options)
    rows = []
    for query_rows, length in queries_by_step:
        total = 0
        for layer in range(LAYERS):
            keys = engine.keys[key][layer][:length]
            pooled = reference.macs_pool_reference(
                query_rows[layer][None, :, None], keys.transpose(0, 1)[None], input_start=torch.tensor([[0]]),
                input_end=torch.tensor([[n]]), kv_len=torch.tensor([[length]]), scale=DIM ** -0.5,
                pooling=config.pooling, redistribute=config.redistribute)[0, 0].float()
            total = total + log_floor(pooled, config.alpha)
        rows.append(total)
    return torch.stack(rows)


def run_engine(device, capture):
    """A prefill step (eager, as FULL_AND_PIECEWISE runs mixed batches) and three decode steps replayed from one
    capture (`capture(step)`: a callable that replays `step`), through the persistent buffers; beside it the eager
    tracer path on the same caches and queries. Returns (graph tracer, eager tracer, engine, reference inputs)."""
    generator = torch.Generator().manual_seed(0)
    engine = Engine(device, generator)
    runner = Runner()
    impl, layers = Impl(), [types.SimpleNamespace(layer_name=name) for name in LAYER_NAMES]
    steps = graphs.GraphSteps(LAYERS, MAX_SEQS, MAX_PAGES * BLOCK, device)
    steps.layers = {name: index for index, name in enumerate(LAYER_NAMES)}
    graph_tracer = VllmTracer(runner, dict.fromkeys(LAYER_NAMES))
    eager_tracer = VllmTracer(runner, dict.fromkeys(LAYER_NAMES))
    queries_buffer = torch.zeros(LAYERS, MAX_SEQS, HEADS, DIM, device=device)  # vLLM's persistent decode inputs

    def decode_layers():
        for layer in range(LAYERS):
            steps.layer(impl, layers[layer], queries_buffer[layer], engine.caches[layer])

    # Engine start: vLLM builds dummy metadata and captures the decode graph before any request, tracer unattached.
    steps.plan(None, types.SimpleNamespace(block_table_tensor=engine.block_table))
    replay = capture(decode_layers)
    inputs = {key: [] for key in REQUESTS}
    orders = [list(REQUESTS)] + DECODE_ORDERS
    for number, order in enumerate(orders):
        runner.input_batch.req_ids = order
        queries, common, eager, ends = engine.step(order, {k: REQUESTS[k][0] for k in order} if number == 0 else {})
        steps.plan(graph_tracer, common)
        if number == 0:  # a mixed batch runs eagerly, on the same buffers
            for layer in range(LAYERS):
                steps.layer(impl, layers[layer], queries[layer].to(device), engine.caches[layer])
        else:
            queries_buffer.zero_()
            for layer in range(LAYERS):
                queries_buffer[layer, : queries[layer].shape[0]] = queries[layer].to(device)
            replay()
        for layer in range(LAYERS):
            eager_tracer.layer(impl, layers[layer], queries[layer][: int(ends[len(order)])].to(device),
                               engine.caches[layer], eager)
        for i, key in enumerate(order):
            inputs[key].append(([q[int(ends[i + 1]) - 1] for q in queries], engine.keys[key][0].shape[0]))
    steps.collect(graph_tracer)  # the last step's rows: a reader asks
    return graph_tracer, eager_tracer, engine, inputs


def check_rows(graph_tracer, eager_tracer, engine, inputs):
    for key, (n, options) in REQUESTS.items():
        if options is None:
            with pytest.raises(KeyError, match="never asked for attribution"):
                graph_tracer.rows(key)
            continue
        rows, n_input = graph_tracer.rows(key)
        eager, _ = eager_tracer.rows(key)
        steps = len(inputs[key])
        assert n_input == n and rows.shape == (steps, n) == eager.shape
        torch.testing.assert_close(rows, eager, rtol=0, atol=1e-5)
        torch.testing.assert_close(rows, reference_rows(engine, key, inputs[key]), rtol=0, atol=1e-4)


def test_captured_steps_on_the_cpu_compile_without_graph_breaks_or_recompiles(monkeypatch):
    # torch's paged kernel: numba's (the CPU default) is not traceable by torch.compile.
    monkeypatch.setattr(registry, "paged_kernels", lambda device, captured=False: registry.Kernels.of("torch"))
    torch._dynamo.reset()

    def capture(step):
        compiled = torch.compile(step, fullgraph=True, backend="eager")

        def replay():
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled()

        return replay

    check_rows(*run_engine(torch.device("cpu"), capture))


@pytest.mark.gpu
def test_a_decode_batch_captured_once_replays_with_new_lengths_and_tables():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    def capture(step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles and autotunes outside the capture
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    check_rows(*run_engine(torch.device("cuda"), capture))


def test_cuda_graph_modes_are_named_and_the_rest_refused():
    def config(mode, enforce_eager=False, dbo=False, sizes=(1, 2, 4)):
        return types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(name=mode),
                                                     cudagraph_capture_sizes=list(sizes)),
            model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
            parallel_config=types.SimpleNamespace(enable_dbo=dbo))

    assert graphs.SUPPORTED_CUDAGRAPH_MODES[0] == "FULL_AND_PIECEWISE"  # vLLM's default
    for mode in graphs.SUPPORTED_CUDAGRAPH_MODES:
        assert graphs.graph_mode(config(mode)) == mode
    assert graphs.graph_mode(config("NONE")) is None
    assert graphs.graph_mode(config("FULL_AND_PIECEWISE", enforce_eager=True)) is None
    assert graphs.graph_mode(config("FULL_AND_PIECEWISE", sizes=())) is None  # vLLM's CPU platform: no graphs
    with pytest.raises(NotImplementedError, match="cudagraph_mode FULL_SOMETHING_NEW: macs_kernels follows"):
        graphs.graph_mode(config("FULL_SOMETHING_NEW"))
    with pytest.raises(NotImplementedError, match="enable_dbo"):
        graphs.graph_mode(config("FULL_AND_PIECEWISE", dbo=True))


@pytest.mark.slow
def test_the_persistent_plan_follows_vllm_cpus_compiled_engine(tiny_path, tiny_reference, monkeypatch):
    """vLLM's CPU build compiles the model (Dynamo, inductor) but captures no graphs, so it would take the eager
    path; made to take the persistent one, its own scheduler and metadata builder drive the plan, the per-request
    options and the rows read back after the last step, in its default compiled mode."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    import macs_kernels.vllm as macs_vllm
    from macs_kernels.api.explanation import Explanation

    from .conftest import largest_difference, make_llm, shut_down
    from .test_engine import token_prompts

    monkeypatch.setattr(graphs, "graph_mode", lambda vllm_config: "FULL_AND_PIECEWISE")
    monkeypatch.setattr(graphs, "ACTIVE", None)
    options = [{}, {"alpha": 0.5, "pooling": "mean"}, {"redistribute": False}, {"alpha": 1.0, "pooling": "min"}]
    llm = make_llm(tiny_path, enforce_eager=False, additional_config=macs_vllm.graph_buffers(4, 512))
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode > 0  # compiled
        assert graphs.ACTIVE is not None and graphs.ACTIVE.vllm_config is llm.llm_engine.vllm_config
        macs_vllm.attach(llm)
        params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                                 extra_args=macs_vllm.attribution(**o)) for o in options]
        params.append(SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))  # no attribution
        outputs = llm.generate(token_prompts([50, 130, 90, 260, 70]), params)
        found = macs_vllm.rows(llm, [output.request_id for output in outputs[:4]], release=True)
        with pytest.raises(LookupError):
            macs_vllm.rows(llm, [outputs[4].request_id])
    finally:
        shut_down(llm)
    for output, option in zip(outputs, options):
        explanation = Explanation(torch.tensor(output.prompt_token_ids), torch.tensor(output.outputs[0].token_ids), [],
                                  [], found[output.request_id], {})
        largest_difference(tiny_reference, [explanation], **option)
