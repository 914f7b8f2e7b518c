"""The torch.ops.macs_kernels operators: schemas (the contract the CUDA extension implements), fake kernels
and torch.compile support (opcheck), and their default kernel (the torch path) against the float64
references."""
import pytest
import torch

from macs_kernels import ops as public_ops  # noqa: F401 - importing the ops declares the operators
from macs_kernels.ops import reference, why_unavailable
from tests.tolerances import RELATIVE_ERROR, relative_error

ops = torch.ops.macs_kernels

BATCH, HEADS, KV_HEADS, KEYS, DIM, N_MAX = 2, 6, 2, 13, 8, 9
# Row 0: left pad 2, inputs 2..9, generated 9..13. Row 1: inputs 0..5, generated 5..8, unused slots after.
INPUT_START, INPUT_END, KV_LEN = [2, 0], [9, 5], [13, 8]

# The operator contract with csrc/ (argument order matters: the C++ kernels take these positionally).
# The schema inferred from a Python int is SymInt; a C++ kernel taking int64_t is accepted for it.
SCHEMAS = {
    "macs_update": "(Tensor q, Tensor k_cache, Tensor(a2!) log_c, Tensor input_start, Tensor input_end, "
                   "Tensor kv_len, float scale, float alpha, str pooling, bool redistribute, Tensor? lse) -> ()",
    "macs_update_rows": "(Tensor rows, Tensor(a1!) log_c, Tensor input_start, Tensor input_end, Tensor kv_len, "
                        "float alpha, str pooling, bool redistribute) -> ()",
    "macs_zscore": "(Tensor log_c, Tensor n_input) -> Tensor",
    "attention_features": "(Tensor q, Tensor k_cache, Tensor source_start, Tensor source_end, Tensor kv_start, "
                          "Tensor kv_len, Tensor n_rows, SymInt n_max, float scale, Tensor? lse, SymInt? window=None, "
                          "float? softcap=None, Tensor? sinks=None) -> Tensor",
    "decode_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_start, Tensor kv_len, float scale, "
                        "Tensor(a6!)? log_c, Tensor? input_end, float alpha, str pooling, bool redistribute, "
                        "Tensor(a11!)? pooled, Tensor? score_start=None, float? softcap=None, "
                        "Tensor? sinks=None) -> (Tensor, Tensor)",
    "macs_pool": "(Tensor q, Tensor k_cache, Tensor(a2!) out, Tensor input_start, Tensor input_end, Tensor kv_len, "
                 "float scale, str pooling, bool redistribute, Tensor? lse, Tensor? score_start=None, "
                 "float? softcap=None, Tensor? sinks=None) -> ()",
    "macs_pool_paged": "(Tensor q, Tensor k_pages, Tensor block_table, Tensor(a3!) out, Tensor input_start, "
                       "Tensor input_end, Tensor kv_len, float scale, str pooling, bool redistribute, Tensor? lse, "
                       "Tensor? score_start=None, float? softcap=None, Tensor? sinks=None) -> ()",
    "efficient_attention": "(Tensor p, Tensor v_cache, Tensor kv_start, Tensor kv_len, bool causal, float rcond, "
                           "Tensor? gram=None) -> (Tensor, Tensor)",
}


def _indices(*values):
    return [torch.tensor(v, dtype=torch.int64) for v in values]


def _update_args(lse):
    q = torch.randn(BATCH, HEADS, DIM)
    k_cache = torch.randn(BATCH, KV_HEADS, KEYS, DIM)
    log_c = -torch.rand(BATCH, N_MAX)
    start, end, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    if lse is not None:
        scores = torch.einsum("bhd,bhsd->bhs", q, k_cache.repeat_interleave(HEADS // KV_HEADS, 1)) * 0.3
        positions = torch.arange(KEYS)
        outside = (positions < start[:, None]) | (positions >= length[:, None])
        lse = scores.masked_fill(outside[:, None], float("-inf")).logsumexp(-1)
    return (q, k_cache, log_c, start, end, length, 0.3, 0.8, "max", True, lse)


def _decode_args(state):
    q = torch.randn(BATCH, HEADS, DIM)
    k_cache = torch.randn(BATCH, KV_HEADS, KEYS, DIM)
    v_cache = torch.randn(BATCH, KV_HEADS, KEYS, 5)
    start, end, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    log_c = -torch.rand(BATCH, N_MAX) if state == "log_c" else None
    pooled = torch.zeros(BATCH, N_MAX) if state == "pooled" else None
    return (q, k_cache, v_cache, start, length, 0.3, log_c, None if state is None else end, 0.8, "mean", False,
            pooled)


def _pool_args():
    rows = 3
    start, end, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    causal = length[:, None] - rows + 1 + torch.arange(rows)
    return (torch.randn(BATCH, HEADS, rows, DIM), torch.randn(BATCH, KV_HEADS, KEYS, DIM),
            torch.zeros(BATCH, rows, N_MAX), start[:, None].repeat(1, rows), end[:, None].repeat(1, rows), causal,
            0.3, "max", True, None)


def _variant_args(length):
    """A sliding window of 2 keys over rows ending at `length` ((B,) or (B, R)): inputs before the window are
    unseen (all of them in some rows), and item 1's first input slid out before slot 0. In the operators' slot
    arguments: (attended start, score_start, softcap, sinks)."""
    shape = (BATCH,) + (1,) * (length.dim() - 1)
    start = torch.tensor(INPUT_START).view(shape).expand(length.shape)
    score_start = (start - torch.tensor([0, 1]).view(shape)).contiguous()
    return torch.maximum(start, length - 2).contiguous(), score_start, 2.0, torch.randn(HEADS)


def _pool_variant_args():
    q, k_cache, out, _, end, length, *rest = _pool_args()
    attend, score_start, softcap, sinks = _variant_args(length)
    return (q, k_cache, out, attend, end, length, *rest, score_start, softcap, sinks)


def _decode_variant_args(state):
    q, k_cache, v_cache, start, length, scale, log_c, end, *rest = _decode_args(state)
    attend, score_start, softcap, sinks = _variant_args(length)
    if state == "log_c":  # a window's columns come with pooled only
        return (q, k_cache, v_cache, start, length, scale, log_c, end, *rest, None, softcap, sinks)
    return (q, k_cache, v_cache, attend, length, scale, log_c, end, *rest, score_start, softcap, sinks)


def _paged_args(pool_args=None):
    """_pool_args's keys in pages of 4 slots, numbered in reverse; int32 table ending in -1 for item 1."""
    q, k_cache, out, *rest = _pool_args() if pool_args is None else pool_args
    pages_per_item = -(-KEYS // 4)
    padded = torch.nn.functional.pad(k_cache, (0, 0, 0, pages_per_item * 4 - KEYS))
    k_pages = padded.transpose(1, 2).reshape(BATCH * pages_per_item, 4, KV_HEADS, DIM).flip(0)
    table = (BATCH * pages_per_item - 1 - torch.arange(BATCH * pages_per_item)).view(BATCH, pages_per_item)
    table[1, -(-KV_LEN[1] // 4):] = -1
    return (q, k_pages, table.int(), torch.zeros_like(out), *rest)


def _features_args():
    start, end, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    return (torch.randn(BATCH, HEADS, 3, DIM), torch.randn(BATCH, KV_HEADS, KEYS, DIM), start, end, start, length,
            torch.tensor([3, 2]), N_MAX, 0.3, None)


def _efficient_args():
    p = torch.softmax(torch.randn(BATCH, HEADS, 1, KEYS), dim=-1)
    start, _, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    return (p, torch.randn(BATCH, KV_HEADS, KEYS, 4), start, length, False, 1e-10)


CASES = {
    "macs_update": lambda: _update_args(None),
    "macs_update/lse": lambda: _update_args(True),
    "macs_update_rows": lambda: (
        torch.rand(BATCH, HEADS, KEYS), -torch.rand(BATCH, N_MAX), *_indices(INPUT_START, INPUT_END, KV_LEN),
        0.2, "min", True,
    ),
    "macs_zscore": lambda: (-3 * torch.rand(BATCH, N_MAX), torch.tensor([9, 4])),
    "decode_attention": lambda: _decode_args(None),
    "decode_attention/log_c": lambda: _decode_args("log_c"),
    "decode_attention/pooled": lambda: _decode_args("pooled"),
    "decode_attention/log_c+variant": lambda: _decode_variant_args("log_c"),
    "decode_attention/pooled+variant": lambda: _decode_variant_args("pooled"),
    "macs_pool": _pool_args,
    "macs_pool/variant": _pool_variant_args,
    "macs_pool_paged": _paged_args,
    "macs_pool_paged/variant": lambda: _paged_args(_pool_variant_args()),
    "attention_features": _features_args,
    # A window of 3 tokens, a softcap and (H,) sink logits.
    "attention_features/variant": lambda: (*_features_args(), 3, 2.0, torch.randn(HEADS)),
    "efficient_attention": _efficient_args,
}


@pytest.mark.parametrize("op", sorted(SCHEMAS))
def test_schema_is_the_contract(op):
    assert str(getattr(ops, op).default._schema) == f"macs_kernels::{op}{SCHEMAS[op]}"


def _device_params():
    reason = "no CUDA device" if not torch.cuda.is_available() else why_unavailable("cuda", "cuda")
    marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])
    return ["cpu", pytest.param("cuda", marks=marks)]


@pytest.mark.parametrize("device", _device_params())
@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case, device):
    op = case.split("/")[0]
    if device == "cuda" and why_unavailable("cuda", device, op):
        pytest.skip(why_unavailable("cuda", device, op))
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in CASES[case]()]
    torch.library.opcheck(getattr(ops, op), args)


def test_cpu_kernels_equal_references():
    q, k_cache, log_c, start, end, length, scale, alpha, pooling, redistribute, _ = _update_args(None)
    expected = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, alpha=alpha,
        pooling=pooling, redistribute=redistribute,
    )
    ops.macs_update(q, k_cache, log_c, start, end, length, scale, alpha, pooling, redistribute, None)
    assert relative_error(log_c, expected) < RELATIVE_ERROR[torch.float32]

    args = _decode_args("log_c")
    q, k_cache, v_cache, start, length, scale, log_c, end = args[:8]
    expected_log_c = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, alpha=0.8,
        pooling="mean", redistribute=False,
    )
    expected_out, expected_lse = reference.decode_attention_reference(
        q, k_cache, v_cache, kv_start=start, kv_len=length, scale=scale
    )
    out, lse = ops.decode_attention(*args)
    assert relative_error(out, expected_out) < RELATIVE_ERROR[torch.float32]
    assert relative_error(lse, expected_lse) < RELATIVE_ERROR[torch.float32]
    assert relative_error(log_c, expected_log_c) < RELATIVE_ERROR[torch.float32]

    log_c, counts = CASES["macs_zscore"]()
    z = ops.macs_zscore(log_c, counts)
    assert relative_error(z, reference.macs_zscore_reference(log_c, counts)) < RELATIVE_ERROR[torch.float32]

    pool_args = _pool_args()
    q, k_cache, out, start, end, length, scale, pooling, redistribute, _ = pool_args
    ops.macs_pool(q, k_cache, out, start, end, length, scale, pooling, redistribute, None)
    expected = reference.macs_pool_reference(q, k_cache, input_start=start, input_end=end, kv_len=length, scale=scale,
                                             pooling=pooling, redistribute=redistribute)
    assert relative_error(out[..., : expected.shape[-1]], expected) < RELATIVE_ERROR[torch.float32]
    assert not out[..., expected.shape[-1]:].any()

    q, k_pages, table, paged_out, *_ = _paged_args(pool_args)
    ops.macs_pool_paged(q, k_pages, table, paged_out, start, end, length, scale, pooling, redistribute, None)
    assert relative_error(paged_out[..., : expected.shape[-1]], expected) < RELATIVE_ERROR[torch.float32]


def test_fake_kernels_under_torch_compile():
    args = _decode_args(None)
    compiled = torch.compile(lambda *a: ops.decode_attention(*a), backend="eager", fullgraph=True)
    out, lse = compiled(*args)
    expected_out, expected_lse = ops.decode_attention(*args)
    assert out.shape == (BATCH, HEADS, 5) and lse.dtype == torch.float32
    assert relative_error(out, expected_out) < RELATIVE_ERROR[torch.float32]
    assert relative_error(lse, expected_lse) < RELATIVE_ERROR[torch.float32]
