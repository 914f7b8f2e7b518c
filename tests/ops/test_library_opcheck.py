"""The torch.ops.macs_kernels operators on CPU: schemas, fake kernels and torch.compile support (opcheck),
results against the float64 references, and the cuda backend's absence handled as the dispatcher expects."""
import pytest
import torch

from macs_kernels import reference
from macs_kernels.ops import _dispatch, library  # noqa: F401 - library defines torch.ops.macs_kernels
from tests.tolerances import RELATIVE_ERROR, relative_error

ops = torch.ops.macs_kernels

BATCH, HEADS, KV_HEADS, KEYS, DIM, N_MAX = 2, 6, 2, 13, 8, 9
# Row 0: left pad 2, inputs 2..9, generated 9..13. Row 1: inputs 0..5, generated 5..8, unused slots after.
INPUT_START, INPUT_END, KV_LEN = [2, 0], [9, 5], [13, 8]


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


def _decode_args(with_log_c):
    q = torch.randn(BATCH, HEADS, DIM)
    k_cache = torch.randn(BATCH, KV_HEADS, KEYS, DIM)
    v_cache = torch.randn(BATCH, KV_HEADS, KEYS, 5)
    start, end, length = _indices(INPUT_START, INPUT_END, KV_LEN)
    log_c = -torch.rand(BATCH, N_MAX) if with_log_c else None
    return (q, k_cache, v_cache, start, length, 0.3, log_c, end if with_log_c else None, 0.8, "mean", False)


CASES = {
    "macs_update": lambda: _update_args(None),
    "macs_update_lse": lambda: _update_args(True),
    "macs_update_rows": lambda: (
        torch.rand(BATCH, HEADS, KEYS), -torch.rand(BATCH, N_MAX), *_indices(INPUT_START, INPUT_END, KV_LEN),
        0.2, "min", True,
    ),
    "macs_zscore": lambda: (-3 * torch.rand(BATCH, N_MAX), torch.tensor([9, 4])),
    "decode_attention": lambda: _decode_args(False),
    "decode_attention_log_c": lambda: _decode_args(True),
}


def _cuda_kernels_missing():
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import macs_kernels.ops.cuda  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_cuda_kernels_missing() is not None,
                                                        reason=str(_cuda_kernels_missing())))],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case, device):
    op = getattr(ops, case.removesuffix("_lse").removesuffix("_log_c"))
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in CASES[case]()]
    torch.library.opcheck(op, args)


def test_cpu_kernels_equal_references():
    q, k_cache, log_c, start, end, length, scale, alpha, pooling, redistribute, _ = _update_args(None)
    expected = reference.macs_update_reference(
        q, k_cache, log_c, input_start=start, input_end=end, kv_len=length, scale=scale, alpha=alpha,
        pooling=pooling, redistribute=redistribute,
    )
    ops.macs_update(q, k_cache, log_c, start, end, length, scale, alpha, pooling, redistribute, None)
    assert relative_error(log_c, expected) < RELATIVE_ERROR[torch.float32]

    args = _decode_args(True)
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


def test_fake_kernels_under_torch_compile():
    args = _decode_args(False)
    compiled = torch.compile(lambda *a: ops.decode_attention(*a), backend="eager", fullgraph=True)
    out, lse = compiled(*args)
    expected_out, expected_lse = ops.decode_attention(*args)
    assert out.shape == (BATCH, HEADS, 5) and lse.dtype == torch.float32
    assert relative_error(out, expected_out) < RELATIVE_ERROR[torch.float32]
    assert relative_error(lse, expected_lse) < RELATIVE_ERROR[torch.float32]


def test_cuda_backend_absent_without_extension(monkeypatch):
    """Without macs_kernels._C, importing the cuda backend names the missing build; dispatch treats it as absent."""
    try:
        import macs_kernels._C  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("macs_kernels._C is built here")
    import importlib

    with pytest.raises(ImportError, match="macs_kernels._C is not built"):
        importlib.import_module("macs_kernels.ops.cuda")
    # A CUDA device without the extension: the automatic choice falls through to the next backend.
    monkeypatch.setattr(_dispatch, "why_unavailable", lambda name, device: None if name == "torch" else "absent")
    assert _dispatch.resolve_backend(None, torch.device("cuda")) == "torch"


@pytest.mark.parametrize(
    "available, expected",
    [({"cuda", "triton", "torch"}, "cuda"), ({"triton", "torch"}, "triton"), ({"torch"}, "torch")],
)
def test_automatic_choice_prefers_cuda_then_triton(monkeypatch, available, expected):
    monkeypatch.setattr(_dispatch, "why_unavailable", lambda name, device: None if name in available else "absent")
    assert _dispatch.resolve_backend(None, torch.device("cuda")) == expected
    assert _dispatch.resolve_backend(None, torch.device("cpu")) == "torch"
