"""The cuda backend (macs_kernels._C) against the float64 references, on a pairwise grid of shapes and options.

The split-KV ops choose their split kernel by shape (ops/cuda/__init__.py): the grid's dtypes and head dimensions
reach each of them (fp16/bf16 at D 64 and 128: the tensor-core kernel; float32 at D 64 and 128, and fp16/bf16 at D
256: the pipelined one; D 72, and float32 at D 256: split_kernel). Needs a CUDA device and the built extension;
skips with the reason otherwise, so a GPU session runs it as is.
"""
import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.grids import pairwise
from tests.ops.cases import CUDA_BACKEND_DEVICE as DEVICE
from tests.ops.cases import assert_close_log_c, assert_relative_score_bound, why_no_cuda_backend
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(why_no_cuda_backend() is not None, reason=str(why_no_cuda_backend()))]


FACTORS = {
    "keys": (1, 113, 1023),
    "dim": (64, 72, 128, 256),
    "group": (1, 3, 4, 8),
    "batch": (1, 3),
    "pooling": ("max", "mean", "min"),
    "alpha": (0.2, 0.8, 1.0),
    "redistribute": (True, False),
    "with_lse": (True, False),
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
}


CASES = pairwise(FACTORS)
CASE_IDS = ["-".join(str(v).replace("torch.", "") for v in case.values()) for case in CASES]
KV_HEADS = 2


def ranges(keys, batch):
    """(input_start, input_end, kv_len) per row: left pads, generated tokens, unused cache slots, N = 1."""
    if keys == 1:
        return [0] * batch, [1] * batch, [1] * batch
    rows = [(0, keys // 2, keys), (3, keys - 20, keys - 7), (keys // 3, keys // 3 + 1, keys // 3 + 6)][:batch]
    return tuple(list(column) for column in zip(*rows))


def make_inputs(case, device=DEVICE):
    heads = KV_HEADS * case["group"]
    q = 2 * torch.randn(case["batch"], heads, case["dim"], device=device)
    k_cache = torch.randn(case["batch"], KV_HEADS, case["keys"], case["dim"], device=device)
    v_cache = torch.randn(case["batch"], KV_HEADS, case["keys"], case["dim"], device=device)
    start, end, length = ranges(case["keys"], case["batch"])
    n_max = max(e - s for s, e in zip(start, end)) + 2  # columns past N_b must stay as they are
    log_c = -torch.rand(case["batch"], n_max, device=device)
    dtype = case["dtype"]
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), log_c, start, end, length


def reference_lse(q, k_cache, start, length, scale):
    group = q.shape[1] // k_cache.shape[1]
    return torch.tensor([
        [reference.softmax_row_reference(q[b, h], k_cache[b, h // group, start[b]:length[b]], scale)[1].item()
         for h in range(q.shape[1])]
        for b in range(q.shape[0])
    ], dtype=torch.float32, device=q.device)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_macs_update(case):
    q, k_cache, _, log_c, start, end, length = make_inputs(case)
    scale = case["dim"] ** -0.5
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    expected = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, **options
    )
    lse = reference_lse(q, k_cache, start, length, scale) if case["with_lse"] else None
    ops.macs_update(q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, lse=lse,
                    backend="cuda", **options)
    assert_close_log_c(log_c, expected, case["dtype"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_macs_update_rows(case):
    q, _, _, log_c, start, end, length = make_inputs(case)
    heads, keys = q.shape[1], case["keys"]
    # Efficient-attention rows: mostly small positive, some negative (pooling clamps them).
    rows = (torch.rand(case["batch"], heads, keys, device=DEVICE) - 0.1).div(max(keys, 2) ** 0.5).to(case["dtype"])
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    expected = reference.macs_update_rows_reference(
        rows, log_c, input_start=start, input_end=end, kv_len=length, **options
    )
    ops.macs_update_rows(rows, log_c, input_start=start, input_end=end, kv_len=length, backend="cuda", **options)
    assert_close_log_c(log_c, expected, case["dtype"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_attention(case):
    q, k_cache, v_cache, log_c, start, end, length = make_inputs(case)
    scale = case["dim"] ** -0.5
    fused = case["with_lse"]  # the factor doubles as "with the MACS update" here
    options = dict(alpha=case["alpha"], pooling=case["pooling"], redistribute=case["redistribute"])
    expected_out, expected_lse = reference.decode_attention_reference(
        q, k_cache, v_cache, kv_start=start, kv_len=length, scale=scale
    )
    expected_log_c = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, **options
    )
    out, lse = ops.decode_attention(
        q, k_cache, v_cache, kv_start=start, kv_len=length, scale=scale, log_c=log_c if fused else None,
        input_end=end if fused else None, backend="cuda", **options,
    )
    tolerance = RELATIVE_ERROR[case["dtype"]]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert relative_error(out, expected_out) < tolerance
    assert relative_error(lse, expected_lse) < tolerance
    if fused:
        assert_close_log_c(log_c, expected_log_c, case["dtype"])


@pytest.mark.parametrize(
    "batch, kv_heads, group, keys, dim, dtype",
    [
        (3, 8, 4, 5000, 128, torch.bfloat16),  # many tiles per split: the online softmax rescales
        (2, 2, 4, 5000, 128, torch.float32),  # the same on the pipelined kernel
        (3, 8, 4, 5000, 72, torch.bfloat16),  # and on split_kernel
        (1, 2, 16, 300, 256, torch.float16),  # G * D_v = 4096: 256 threads, > 48 KB shared memory
        (2, 3, 3, 700, 66, torch.float32),  # rows not 16-byte aligned: element-wise loads
    ],
)
def test_decode_attention_long_and_odd_shapes(batch, kv_heads, group, keys, dim, dtype):
    heads = kv_heads * group
    q = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    # Views, as a model hands them over: a transposed query and caches with spare capacity.
    k_cache = torch.randn(batch, keys + 9, kv_heads, dim, device=DEVICE).to(dtype).transpose(1, 2)[:, :, :keys]
    v_cache = torch.randn(batch, kv_heads, keys, dim, device=DEVICE).to(dtype)
    start = [5 * b for b in range(batch)]
    length = [keys - 2 * b for b in range(batch)]
    end = [s + (n - s) // 2 for s, n in zip(start, length)]
    log_c = -torch.rand(batch, max(e - s for s, e in zip(start, end)), device=DEVICE)
    scale = dim ** -0.5
    expected_out, expected_lse = reference.decode_attention_reference(
        q, k_cache, v_cache, kv_start=start, kv_len=length, scale=scale
    )
    expected_log_c = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale
    )
    out, lse = ops.decode_attention(q, k_cache, v_cache, kv_start=start, kv_len=length, scale=scale, log_c=log_c,
                                    input_end=end, backend="cuda")
    assert relative_error(out, expected_out) < RELATIVE_ERROR[dtype]
    assert relative_error(lse, expected_lse) < RELATIVE_ERROR[dtype]
    assert relative_error(log_c, expected_log_c) < RELATIVE_ERROR[dtype]


@pytest.mark.parametrize("n_max", [1, 113, 1023, 5000])
def test_macs_zscore(n_max):
    log_c = -3 * torch.rand(4, n_max, device=DEVICE)
    log_c[2] = -2.0  # constant: std 0, zeros
    log_c[3] = float("-inf")  # all attention underflowed: zeros
    counts = [n_max, max(1, n_max // 2), n_max, n_max]
    z = ops.macs_zscore(log_c, counts, backend="cuda")
    assert relative_error(z, reference.macs_zscore_reference(log_c, counts)) < RELATIVE_ERROR[torch.float32]


def test_cuda_equals_torch_backend_through_the_operators():
    case = dict(CASES[0], keys=113, batch=3)
    q, k_cache, v_cache, log_c, start, end, length = make_inputs(case)
    got = ops.decode_attention(q, k_cache, v_cache, kv_start=start, kv_len=length, scale=0.1, log_c=log_c.clone(),
                               input_end=end, backend="cuda")
    want = ops.decode_attention(q, k_cache, v_cache, kv_start=start, kv_len=length, scale=0.1,
                                log_c=log_c.clone(), input_end=end, backend="torch")
    for g, w in zip(got, want):
        assert relative_error(g, w) < RELATIVE_ERROR[case["dtype"]]


def test_launcher_errors_are_readable():
    q = torch.randn(1, 4, 64, device=DEVICE, dtype=torch.float16)
    k_cache = torch.randn(1, 2, 10, 64, device=DEVICE)
    index = torch.tensor([0], device=DEVICE)
    log_c = torch.zeros(1, 5, device=DEVICE)
    with pytest.raises(RuntimeError, match="q and k_cache must share a dtype"):
        torch.ops.macs_kernels.macs_update(q, k_cache, log_c, index, index + 5, index + 10, 0.1, 0.8, "max", True, None)
    with pytest.raises(RuntimeError, match="pooling must be"):
        torch.ops.macs_kernels.macs_update(q, k_cache.half(), log_c, index, index + 5, index + 10, 0.1, 0.8, "median",
                                           True, None)
    with pytest.raises(RuntimeError, match="input_end must be int32 or int64"):
        torch.ops.macs_kernels.macs_update(q, k_cache.half(), log_c, index, (index + 5).short(), index + 10, 0.1, 0.8,
                                           "max", True, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "window, softcap, with_sinks",
    [(64, None, False), (200, 30.0, True), (None, 20.0, False), (None, None, True), (700, 50.0, True)],
)
def test_variants_over_row_chunks_and_key_splits(dtype, window, softcap, with_sinks):
    """ops.Variant on the cuda backend (the launchers' score_start, softcap and sinks) over 1023 keys (several key
    splits, windows across split boundaries), 8 query heads per KV head (two row chunks of the 3 verify rows),
    against the float64 reference over every token's keys."""
    batch, kv_heads, group, rows, keys, dim = 2, 2, 8, 3, 1023, 64
    heads = kv_heads * group
    q = 2 * torch.randn(batch, heads, rows, dim, device=DEVICE).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, device=DEVICE).to(dtype)
    v = torch.randn(batch, kv_heads, keys, dim, device=DEVICE).to(dtype)
    sinks = 2 * torch.randn(heads, device=DEVICE) if with_sinks else None
    input_start = torch.tensor([[0] * rows, [5] * rows], device=DEVICE)
    input_end = torch.tensor([[400] * rows, [300] * rows], device=DEVICE)
    kv_len = torch.tensor([[1021, 1022, 1023], [1000, 1001, 1002]], device=DEVICE)
    scale = dim ** -0.5
    expected, expected_out = reference.variant_pool_reference(
        q, k, v, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale, window=window,
        softcap=softcap, sinks=sinks,
    )
    # A sliding-window cache holds the tokens its rows still attend, from key_offset on.
    offset = 1000 - window if window is not None else 0
    variant = ops.Variant(window=window, key_offset=offset, softcap=softcap, sinks=sinks)
    out = ops.macs_pool(q, k[:, :, offset:], input_start=input_start, input_end=input_end, kv_len=kv_len,
                        scale=scale, variant=variant, backend="cuda")
    tolerance = RELATIVE_ERROR[dtype]
    assert relative_error(out, expected) < tolerance
    pooled = torch.empty(batch, expected.shape[-1], device=DEVICE)
    attention, _ = ops.decode_attention(
        q[:, :, -1], k[:, :, offset:], v[:, :, offset:], kv_start=input_start[:, -1], kv_len=kv_len[:, -1],
        input_end=input_end[:, -1], scale=scale, pooled=pooled, variant=variant, backend="cuda",
    )
    assert relative_error(pooled, expected[:, -1]) < tolerance
    assert relative_error(attention, expected_out[:, -1]) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap, with_sinks", [(None, None, False), (37, None, False), (None, 20.0, True)])
def test_attention_features_computing_its_lse(dtype, window, softcap, with_sinks):
    """attention_features without a given lse (its lse pass stages each key tile once for a block of 8 rows) against
    the float64 reference: GQA 3:1, 13 rows (a partial block), fewer valid rows than R, left pads, 1023 keys."""
    batch, kv_heads, group, rows, keys, dim = 2, 2, 3, 13, 1023, 64
    heads = kv_heads * group
    q = 2 * torch.randn(batch, heads, rows, dim, device=DEVICE).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, device=DEVICE).to(dtype)
    sinks = 2 * torch.randn(heads, device=DEVICE) if with_sinks else None
    index = dict(source_start=torch.tensor([2, 40], device=DEVICE), source_end=torch.tensor([1000, 990], device=DEVICE),
                 kv_start=torch.tensor([0, 35], device=DEVICE), kv_len=torch.tensor([1023, 1001], device=DEVICE),
                 n_rows=torch.tensor([13, 9], device=DEVICE))
    scale = dim ** -0.5
    expected = reference.attention_features_reference(q.cpu(), k.cpu(), scale=scale, window=window, softcap=softcap,
                                                      sinks=None if sinks is None else sinks.cpu(),
                                                      **{name: value.cpu() for name, value in index.items()})
    variant = ops.Variant(window=window, softcap=softcap, sinks=sinks)
    features = ops.attention_features(q, k, scale=scale, variant=variant, backend="cuda", **index)
    assert relative_error(features, expected.to(features.device)) < RELATIVE_ERROR[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pooling", ["max", "min"])
def test_the_log_c_update_keeps_log_p_within_2_to_the_minus_11(dtype, pooling):
    """The tensor-core kernel (16-bit inputs at D 64) keeping its scores as float16 relative to a running max per 16
    keys (SplitParams::relative_scores): each log c increment within 2^-11 of its size."""
    assert_relative_score_bound(dtype, pooling, "cuda", DEVICE)
