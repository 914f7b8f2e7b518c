"""Efficient attention (issue 7): ops.efficient_attention, GramState and efficient_rows.

The code under test solves X^T X by Cholesky; the reference (reference.efficient_attention_reference)
projects with an orthonormal basis from the SVD of X, and the null-space directions below come from
torch.linalg.pinv of X: no shared code.
"""
import importlib.util

import pytest
import torch

from macs_kernels import ops
from macs_kernels.core.methods.efficient import GramState, efficient_rows
from macs_kernels.ops.reference import efficient_attention_reference, macs_update_rows_reference
from macs_kernels.ops.torch import efficient as torch_efficient
from tests.ops.cases import DEVICE, backends
from tests.tolerances import RELATIVE_ERROR, relative_error

# Tolerances: RELATIVE_ERROR of the result dtype, for a_eff against the reference and for a_eff X against
# p X per row. float32 results come from a float64 solve, but a_eff = W X^T is rounded to float32 and W's
# entries exceed a_eff's (cancellation over D + 1 terms): measured <= 7e-7 here, allowed 1e-5.

# (batch, heads, kv_heads, rows, keys, dim, kv_start, kv_len, causal): GQA 3:1, left pads, odd sizes;
# the causal case has rows with <= D + 1 keys (returned as is) next to longer ones.
CASES = {
    "decode": (2, 6, 2, 1, 113, 8, [0, 7], [113, 90], False),
    "rows": (1, 3, 3, 4, 60, 5, [3], [59], False),
    "causal": (2, 3, 1, 40, 57, 8, [0, 5], [57, 50], True),
    "head64": (1, 3, 1, 1, 1023, 64, [11], [1000], False),
}


def make_case(name, dtype, *, sharpness=2.0):
    batch, heads, kv_heads, rows, keys, dim, kv_start, kv_len, causal = CASES[name] if isinstance(name, str) else name
    ends = torch_efficient.key_ends(torch.tensor(kv_start), torch.tensor(kv_len), rows, causal)
    inside = torch_efficient.key_mask(torch.tensor(kv_start), ends, keys)[:, None]
    scores = sharpness * torch.randn(batch, heads, rows, keys, dtype=torch.float64)
    p = torch.softmax(scores.masked_fill(~inside, float("-inf")), dim=-1)
    # Entries outside a row's keys must be ignored: fill them with garbage, not zeros.
    p = torch.where(inside, p, 0.25)
    v = 1.5 * torch.randn(batch, kv_heads, keys, dim, dtype=torch.float64)
    return p.to(dtype), v.to(dtype), dict(kv_start=kv_start, kv_len=kv_len, causal=causal), inside, dim


def augmented(v):
    return torch.cat([v.double(), torch.ones(v.shape[:-1] + (1,), dtype=torch.float64)], dim=-1)


def per_row_error(a, p, v, inside):
    """max over rows of ||(a - p) X|| / ||p X|| over each row's keys (X = [V, 1] of its KV head)."""
    heads = p.shape[1]
    x = augmented(v).repeat_interleave(heads // v.shape[1], dim=1)
    p = p.double() * inside
    return ((a.double() - p) @ x).norm(dim=-1).div((p @ x).norm(dim=-1)).max().item()


@pytest.mark.parametrize("backend", backends("efficient_attention"))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_svd_reference_and_reproduces(name, dtype, backend):
    p, v, ranges, inside, dim = make_case(name, dtype)
    a_eff, residual = (x.cpu() for x in ops.efficient_attention(p.to(DEVICE), v.to(DEVICE), backend=backend, **ranges))
    ref, ref_residual = efficient_attention_reference(p, v, **ranges)
    assert a_eff.dtype == residual.dtype == dtype
    assert relative_error(a_eff, ref) <= RELATIVE_ERROR[dtype]
    assert torch.equal(a_eff[~inside.expand_as(a_eff)], torch.zeros_like(a_eff[~inside.expand_as(a_eff)]))
    assert per_row_error(a_eff, p, v, inside) <= RELATIVE_ERROR[dtype]
    assert residual.max().item() <= RELATIVE_ERROR[dtype] and ref_residual.max().item() <= 1e-12
    assert (a_eff.double().sum(-1) - 1.0).abs().max().item() <= RELATIVE_ERROR[dtype]
    # Rows with more than D + 1 keys really move; shorter rows are p itself.
    counts = inside.sum(-1).expand(a_eff.shape[:3])
    change = (a_eff.double() - p.double() * inside).abs().amax(-1)
    assert change[counts > dim + 1].min().item() > 1e-3
    assert torch.all(change[counts <= dim + 1] == 0.0)
    assert (a_eff < 0).any(), "efficient rows of sharp softmax rows have negative entries"


def null_space_projector(v_rows):
    """I - X X^+ (n, n) for X = [V, 1]: it maps any vector into the left null space of X (torch.linalg.pinv)."""
    x = augmented(v_rows)
    return torch.eye(x.shape[0], dtype=torch.float64) - x @ torch.linalg.pinv(x)


@pytest.mark.parametrize("name", ["decode", "causal"])
def test_identifiability(name):
    p, v, ranges, _, _ = make_case(name, torch.float64, sharpness=0.5)
    generator = torch.Generator().manual_seed(1)
    kv_start, kv_len, causal = ranges["kv_start"], ranges["kv_len"], ranges["causal"]
    rows, group = p.shape[2], p.shape[1] // v.shape[1]
    projectors = {}
    shifted = p.clone()  # p + any left-null-space vector of X (can leave the simplex)
    positive = p.clone()  # another softmax row with the same output and sum
    for b in range(p.shape[0]):
        for h in range(p.shape[1]):
            for r in range(rows):
                end = kv_len[b] - rows + r + 1 if causal else kv_len[b]
                if end - kv_start[b] <= v.shape[-1] + 1:
                    continue
                keys = slice(kv_start[b], end)
                if (b, h // group, end) not in projectors:
                    projectors[b, h // group, end] = null_space_projector(v[b, h // group, keys])
                z = torch.randn(end - kv_start[b], dtype=torch.float64, generator=generator)
                direction = projectors[b, h // group, end] @ z
                shifted[b, h, r, keys] += direction
                row = p[b, h, r, keys]
                step = 0.5 * (row / direction.abs()).min()
                positive[b, h, r, keys] = row + step * direction
    assert (positive >= 0).all() and torch.allclose(positive.sum(-1), p.sum(-1), atol=1e-12, rtol=0)
    assert (positive - p).abs().amax(-1).max() > 1e-3
    a_eff, _ = ops.efficient_attention(p, v, backend="torch", **ranges)
    for other in (shifted, positive):
        a_other, _ = ops.efficient_attention(other, v, backend="torch", **ranges)
        assert relative_error(a_other, a_eff) <= 1e-10


def test_singular_gram_falls_back_to_pseudo_inverse(monkeypatch):
    p, v, ranges, inside, _ = make_case("decode", torch.float64)
    v[..., 1] = v[..., 0]  # duplicated channel
    v[1, :, :, 2] = 0.5  # constant channel: parallel to the ones column
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(a.shape) or eigh(a))
    a_eff, residual = ops.efficient_attention(p, v, backend="torch", **ranges)
    assert calls, "a rank-deficient X must take the eigendecomposition path"
    ref, _ = efficient_attention_reference(p, v, **ranges)
    assert relative_error(a_eff, ref) <= 1e-9
    assert residual.max().item() <= 1e-9 and per_row_error(a_eff, p, v, inside) <= 1e-9


def test_solve_coefficients_against_pinv():
    x = torch.randn(4, 50, 7, dtype=torch.float64)
    x[1, :, 3] = x[1, :, 4] - 2 * x[1, :, 0]  # rank-deficient: Cholesky alone cannot solve it
    gram = x.transpose(-1, -2) @ x
    rhs = torch.randn(4, 7, 3, dtype=torch.float64)
    rhs[1] = x[1].T @ torch.randn(50, 3, dtype=torch.float64)  # in the range of G, as o = p X is
    got = torch_efficient.solve_coefficients(gram, rhs, torch_efficient.DEFAULT_RCOND)
    assert relative_error(got, torch.linalg.pinv(gram, hermitian=True) @ rhs) <= 1e-8


def test_gram_state_matches_fresh_computation_after_many_tokens():
    batch, kv_heads, dim, prompt, steps, layers = 3, 2, 8, 20, 400, 2
    pads = torch.tensor([0, 3, 7])
    cache = torch.randn(layers, batch, kv_heads, prompt + steps, dim).to(torch.bfloat16)
    valid = torch.ones(batch, prompt + steps, dtype=torch.bool)
    valid[:, :prompt] = torch.arange(prompt) >= pads[:, None]
    state = GramState(layers)
    for layer in range(layers):
        state.append(layer, cache[layer, :, :, :prompt], valid[:, :prompt])
    for t in range(prompt, prompt + steps):
        for layer in range(layers):
            state.append(layer, cache[layer, :, :, t : t + 1], valid[:, t : t + 1])
    for layer in range(layers):
        fresh = torch.zeros(batch, kv_heads, dim + 1, dim + 1, dtype=torch.float64)
        for b in range(batch):
            x = augmented(cache[layer, b, :, pads[b]:])
            fresh[b] = x.transpose(-1, -2) @ x
        assert relative_error(state.gram(layer), fresh) <= 1e-14
        assert state.tokens(layer).tolist() == (prompt + steps - pads).tolist()
    p = torch.softmax(torch.randn(batch, 6, prompt + steps), dim=-1)
    kv_len = torch.full((batch,), prompt + steps)
    a_rows, res_rows = efficient_rows(p, cache[0], state.gram(0), pads, kv_len, backend="torch")
    a_op, _ = ops.efficient_attention(p[:, :, None], cache[0], kv_len=kv_len, kv_start=pads, backend="torch")
    assert a_rows.shape == p.shape and res_rows.shape == p.shape[:2]
    assert relative_error(a_rows, a_op[:, :, 0]) <= 1e-6 and res_rows.max() <= RELATIVE_ERROR[torch.float32]
    if importlib.util.find_spec("triton") is not None:
        on_device = (x.to(DEVICE) for x in (p, cache[0], state.gram(0), pads, kv_len))
        a_triton, _ = efficient_rows(*on_device, backend="triton")
        assert relative_error(a_triton, a_rows) <= RELATIVE_ERROR[torch.float32]


# Several key tiles split over programs (BLOCK_S is 256 in the interpreter), bf16 values.
LONG = (1, 6, 2, 1, 600, 16, [5], [577], False)


@pytest.mark.parametrize(
    "name,dtype", [("decode", torch.float32), ("decode", torch.float64), ("causal", torch.float32),
                   (LONG, torch.bfloat16)], ids=["decode-f32", "decode-f64", "causal-f32", "long-bf16"],
)
def test_triton_matches_torch(name, dtype):
    pytest.importorskip("triton")
    from macs_kernels.ops.triton import LAUNCHES

    p, v, ranges, _, _ = make_case(name, dtype)
    launches = LAUNCHES["_efficient_back_projection_kernel"]
    got = ops.efficient_attention(p.to(DEVICE), v.to(DEVICE), backend="triton", **ranges)
    assert LAUNCHES["_efficient_back_projection_kernel"] == launches + 1
    want = ops.efficient_attention(p, v, backend="torch", **ranges)
    tolerance = RELATIVE_ERROR[torch.float64 if dtype == torch.float64 else torch.float32]
    assert got[0].dtype == want[0].dtype
    assert relative_error(got[0], want[0]) <= tolerance
    assert got[1].max().item() <= tolerance


def test_efficient_rows_feed_macs_update_rows():
    p, v, ranges, _, _ = make_case("decode", torch.float32)
    gram = torch.zeros(2, 2, 9, 9, dtype=torch.float64)
    for b, (start, end) in enumerate(zip(ranges["kv_start"], ranges["kv_len"])):
        x = augmented(v[b, :, start:end])
        gram[b] = x.transpose(-1, -2) @ x
    rows, _ = efficient_rows(p[:, :, 0], v, gram, ranges["kv_start"], ranges["kv_len"], backend="torch")
    assert (rows < 0).any()
    bounds = dict(input_start=ranges["kv_start"], input_end=[100, 60], kv_len=ranges["kv_len"])
    log_c = torch.zeros(2, 100)
    ops.macs_update_rows(rows, log_c, backend="torch", **bounds)
    assert torch.isfinite(log_c).all()
    assert relative_error(log_c, macs_update_rows_reference(rows, torch.zeros(2, 100), **bounds)) <= 1e-5


def test_bad_arguments_raise():
    p, v, _, _, _ = make_case("causal", torch.float32)
    with pytest.raises(ValueError, match="kv_len must be >= 40"):
        ops.efficient_attention(p, v, kv_len=[30, 50], causal=True)
    with pytest.raises(ValueError, match="v_cache must be"):
        ops.efficient_attention(p, v[:, :, :50], kv_len=[50, 50])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ops.efficient_attention(p[:, :2], v.expand(2, 3, 57, 8)[:, :], kv_len=[50, 50])
    with pytest.raises(ValueError, match=r"multiple of KV heads \(0\)"):
        ops.efficient_attention(p, v[:, :0], kv_len=[50, 50])
    with pytest.raises(TypeError, match="causal must be True or False, got 'no'"):
        ops.efficient_attention(p, v, kv_len=[50, 50], causal="no")
    with pytest.raises(ValueError, match="rcond"):
        ops.efficient_attention(p, v, kv_len=[50, 50], rcond=2.0)
    with pytest.raises(ValueError, match="kv_len"):
        ops.efficient_attention(p, v, kv_len=[58, 50])
    with pytest.raises(ValueError, match="gram must be"):
        efficient_rows(p[:, :, 0], v, torch.zeros(2, 1, 9, 9), 0, 50)
    state = GramState(2)
    with pytest.raises(ValueError, match="valid must be"):
        state.append(0, v, torch.ones(2, 56, dtype=torch.bool))
    state.append(0, v, torch.ones(2, 57, dtype=torch.bool))
    with pytest.raises(ValueError, match="layer 0 holds"):
        state.append(0, v[:, :, :, :4], torch.ones(2, 57, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="nothing was appended"):
        state.gram(1)
