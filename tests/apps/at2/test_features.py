"""ops.attention_features against the float64 reference and against eager output_attentions on the
default model; AT2 features captured during generation against the one-forward recomputation."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import attach, ops
from macs_kernels.api.explanation import encode_prompts
from macs_kernels.apps.at2.features import QueryCapture, forward_capture
from macs_kernels.ops import reference
from tests.helpers import default_model, eager_attentions, qa
from tests.tolerances import RELATIVE_ERROR, relative_error

# (B, H, H_kv, R, D, S): GQA 3:1 and 1:1, odd sizes, a row count above one row tile
SHAPES = [(1, 3, 1, 1, 64, 113), (2, 6, 2, 7, 64, 113), (3, 4, 4, 37, 16, 90), (2, 9, 3, 70, 64, 211)]
TRITON_SHAPES = [(1, 3, 1, 1, 64, 113), (2, 6, 2, 7, 64, 113), (2, 2, 1, 37, 16, 90)]


def _case(batch, heads, kv_heads, rows, dim, keys, dtype, ragged):
    q = torch.randn(batch, heads, rows, dim).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim).to(dtype)
    pads = torch.tensor([0, 5, 2][:batch])  # left pads
    kv_len = torch.tensor([keys, keys - 3, keys - 1][:batch])
    n_rows = torch.tensor([rows, max(rows - 4, 0), max(rows - 1, 1)][:batch]) if ragged else None
    starts = pads + torch.tensor([3, 0, 11][:batch])
    ends = kv_len - torch.tensor([0, 2, 1][:batch]) if rows > 1 else kv_len
    return q, k, dict(source_start=starts, source_end=ends, kv_len=kv_len, kv_start=pads, n_rows=n_rows,
                      scale=dim ** -0.5)


def _lse(q, k, args):
    """Float64 log-sum-exp of each row over its causal keys, via the reference's softmax row."""
    batch, heads, rows, _ = q.shape
    group = heads // k.shape[1]
    n_rows = args["n_rows"] if args["n_rows"] is not None else torch.full((batch,), rows)
    lse = torch.zeros(batch, heads, rows, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for r in range(int(n_rows[b])):
                end = int(args["kv_len"][b] - n_rows[b]) + r + 1
                lse[b, h, r] = reference.softmax_row_reference(
                    q[b, h, r], k[b, h // group, int(args["kv_start"][b]):end], args["scale"])[1]
    return lse


def _check(backend, shape, dtype, ragged, with_lse):
    q, k, args = _case(*shape, dtype, ragged)
    lse = _lse(q, k, args).float() if with_lse else None
    got = ops.attention_features(q, k, lse=lse, backend=backend, **args)
    ref = reference.attention_features_reference(q, k, **args)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert relative_error(got, ref) <= RELATIVE_ERROR[torch.float32 if dtype == torch.float64 else dtype]
    width = (args["source_end"] - args["source_start"]).tolist()
    for b, n in enumerate(width):
        assert not got[b, :, n:].any(), "columns past an item's sources must be 0"


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "n_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_matches_reference(shape, dtype, ragged, with_lse):
    _check("torch", shape, dtype, ragged, with_lse)


@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "n_rows"])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=str)
def test_triton_matches_reference(shape, ragged, with_lse):
    triton_backend = pytest.importorskip("macs_kernels.ops.triton")
    before = dict(triton_backend.LAUNCHES)
    _check("triton", shape, torch.float32, ragged, with_lse)
    launched = {name: n - before.get(name, 0) for name, n in triton_backend.LAUNCHES.items()}
    assert launched.get("_features_kernel") == 1 and launched.get("_features_lse_kernel", 0) == (0 if with_lse else 1)


def test_triton_half_precision():
    pytest.importorskip("macs_kernels.ops.triton")
    _check("triton", (2, 6, 2, 7, 64, 113), torch.float16, True, False)


def test_a_row_sees_only_its_causal_prefix():
    """Row r of R attends up to key kv_len - R + r: a key after the first row's end gets nothing from it."""
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 10, 8)
    last = ops.attention_features(q[:, :, 1:], k, source_start=9, source_end=10, kv_len=10, scale=1.0)
    both = ops.attention_features(q, k, source_start=9, source_end=10, kv_len=10, scale=1.0)
    assert torch.equal(both, last)  # the key 9 is only the last row's own key


@pytest.mark.parametrize("bad, message", [
    (dict(source_start=0, source_end=0), "source_start < source_end"),
    (dict(source_end=12), "kv_len <= S"),
    (dict(kv_start=3), "kv_start <= source_start"),
    (dict(n_rows=4), "n_rows=4"),
    (dict(lse=torch.zeros(1, 2, 2)), "lse must be"),
])
def test_bad_arguments_raise(bad, message):
    args = dict(source_start=1, source_end=5, kv_len=10, scale=1.0) | bad
    with pytest.raises(ValueError, match=message):
        ops.attention_features(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 10, 8), **args)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- on the default model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_and_tokenizer():
    return default_model()


@pytest.fixture(scope="module")
def prompt_and_response(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    prompt_ids = encode_prompts(tokenizer, qa(0))[0][0]
    response_ids = torch.tensor(tokenizer(" Hamlet was written by William Shakespeare.")["input_ids"])
    return prompt_ids, response_ids


def _eager_rows(model, prompt_ids, response_ids):
    """Per layer (H, R, S): eager output_attentions over prompt + response[:-1], the last R rows."""
    return [a[:, -response_ids.numel():].double() for a in eager_attentions(model, prompt_ids, response_ids)]


def test_one_forward_features_match_eager_output_attentions(model_and_tokenizer, prompt_and_response):
    model, _ = model_and_tokenizer
    assert model.config._attn_implementation == "sdpa"
    prompt_ids, response_ids = prompt_and_response
    capture = forward_capture(model, prompt_ids, response_ids)
    rows = _eager_rows(model, prompt_ids, response_ids)
    for start, end in ((40, 70), (0, prompt_ids.numel())):  # part of the context, the whole prompt
        got = capture.features(source_start=start, source_end=end)[0]
        ref = torch.stack([layer[:, :, start:end].sum(1) / response_ids.numel() for layer in rows])
        assert relative_error(got, ref) <= RELATIVE_ERROR[torch.float32]


def test_efficient_features_match_svd_projection_of_eager_rows(model_and_tokenizer, prompt_and_response):
    model, _ = model_and_tokenizer
    prompt_ids, response_ids = prompt_and_response
    capture = forward_capture(model, prompt_ids, response_ids)
    rows = _eager_rows(model, prompt_ids, response_ids)
    start, end, n_rows = 40, 70, response_ids.numel()
    got = capture.features(source_start=start, source_end=end, attention="efficient")[0]
    softmax = capture.features(source_start=start, source_end=end)[0]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ref = torch.zeros_like(got, dtype=torch.float64)
    for layer, layer_rows in enumerate(rows):
        values = capture.values[layer][0]
        keys = layer_rows.shape[-1]
        for h in range(layer_rows.shape[0]):
            for r in range(n_rows):
                prefix = keys - n_rows + r + 1
                a_eff = reference.efficient_row_reference(layer_rows[h, r, :prefix], values[h // group, :prefix])
                ref[layer, h] += a_eff[start:end]
    ref /= n_rows
    assert relative_error(got, ref) <= 1e-4  # float32 Gram solves against an SVD in float64
    assert relative_error(softmax, ref) > 1e-2  # and the efficient features are not the softmax ones


def test_features_captured_during_generation_equal_one_forward(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = [qa(0), qa(2)]
    ids, mask, _ = encode_prompts(tokenizer, prompts)
    capture = QueryCapture()
    with attach(model, hooks=[capture]), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    generated = out[:, ids.shape[1]:]
    pads = (mask == 0).sum(1)
    alone = [forward_capture(model, ids[b, pads[b]:], generated[b]) for b in range(2)]
    # Sources: the prompt's tokens from 20 on; targets: rows [1, 4), all rows, and ragged ends (n_rows).
    for start, end in ((1, 3), (0, 4), (0, torch.tensor([4, 2]))):
        batch = capture.features(source_start=pads + 20, source_end=torch.full_like(pads, ids.shape[1]),
                                 target_start=start, target_end=end)
        for b in range(2):
            n = ids.shape[1] - int(pads[b])
            stop = end if isinstance(end, int) else int(end[b])
            ref = alone[b].features(source_start=20, source_end=n, target_start=start, target_end=stop)[0]
            assert relative_error(batch[b, ..., :n - 20], ref) <= RELATIVE_ERROR[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "lse"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gpu_backends_match_reference(shape, with_lse, dtype, backend):
    q, k, args = _case(*shape, dtype, True)
    lse = _lse(q, k, args).float().cuda() if with_lse else None
    cuda_args = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    got = ops.attention_features(q.cuda(), k.cuda(), lse=lse, backend=backend, **cuda_args)
    assert relative_error(got, reference.attention_features_reference(q, k, **args)) <= RELATIVE_ERROR[dtype]


def test_registered_operator_passes_opcheck():
    q, k, args = _case(2, 6, 2, 7, 16, 40, torch.float32, True)
    index = [args[name].long() for name in ("source_start", "source_end", "kv_start", "kv_len", "n_rows")]
    n_max = int((args["source_end"] - args["source_start"]).max())
    torch.library.opcheck(torch.ops.macs_kernels.attention_features, (q, k, *index, n_max, args["scale"], None))
