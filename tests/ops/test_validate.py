"""Index values are checked where it is free, or where the caller asks (issue 48; ops._checks): CPU tensors on
the host by default (a ValueError naming the row), device tensors not at all by default (no launch, no sync),
validate=True everywhere (device values copied to the host once), validate=False nowhere. Device tensors are
simulated on this CPU machine by patching `_checks.on_host`: the rule, not the device, is under test."""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.apps.bench.aten import AtenOps
from macs_kernels.ops import _checks

B, H, H_KV, S, D, N_MAX = 2, 4, 2, 23, 8, 11  # odd sizes


def _data():
    torch.manual_seed(0)
    q = torch.randn(B, H, D)
    k, v = torch.randn(2, B, H_KV, S, D)
    return q, k, v, torch.zeros(B, N_MAX)


def _bad_ranges():
    # Row 1 ends past the cache: kv_len 24 > S = 23.
    return {"kv_start": torch.tensor([0, 3]), "input_end": torch.tensor([5, 9]), "kv_len": torch.tensor([17, 24])}


def test_the_default_checks_host_values_and_names_the_row():
    q, k, v, pooled = _data()
    with pytest.raises(ValueError, match=r"row 1: need 0 <= input_start < input_end <= kv_len <= S=23, got "
                                         r"input_start=3, input_end=9, kv_len=24"):
        ops.decode_attention(q, k, v, scale=0.3, pooled=pooled, backend="torch", **_bad_ranges())


def test_the_default_launches_nothing_for_device_values(on_device):
    start, end, length = torch.tensor([0, 3]), torch.tensor([5, 9]), torch.tensor([17, 24])
    table, rows_start, rows_length = torch.full((B, 6), -1, dtype=torch.int32), start[:, None], length[:, None]
    with AtenOps() as counted:
        _checks.check_ranges(start, end, length, S, N_MAX)
        _checks.check_pages_in_use(table, lambda: rows_start, rows_length, 4, 6)
    assert counted.ops == []


def test_validate_true_reads_device_values_on_the_host(on_device):
    q, k, v, pooled = _data()
    with pytest.raises(ValueError, match=r"row 1: need 0 <= input_start < input_end <= kv_len <= S=23"):
        ops.decode_attention(q, k, v, scale=0.3, pooled=pooled, backend="torch", validate=True, **_bad_ranges())


@pytest.mark.parametrize("value, validates", [("1", True), ("0", False), ("", False)])
def test_the_environment_switch_is_read_from_macs_kernels_validate(monkeypatch, value, validates):
    monkeypatch.setenv("MACS_KERNELS_VALIDATE", value)
    assert _checks.validate_from_environment() is validates


def test_the_environment_switch_validates_every_call(on_device, monkeypatch):
    monkeypatch.setattr(_checks, "VALIDATE_EVERY_CALL", True)
    log_c = torch.zeros(B, N_MAX)
    q, k, _, _ = _data()
    with pytest.raises(ValueError, match=r"row 0: 15 input tokens do not fit log_c's 11 columns"):
        ops.macs_update(q, k, log_c, input_start=[0, 0], input_end=[15, 5], kv_len=[20, 20], scale=0.3,
                        backend="torch")


def test_validate_false_checks_no_values_even_on_the_host():
    start, end, length = torch.tensor([5]), torch.tensor([1]), torch.tensor([99])
    with AtenOps() as counted:
        assert _checks.values_to_check(False, start) is None
        _checks.check_ranges(start, end, length, S, validate=False)
    assert counted.ops == []


@pytest.mark.parametrize("validate", [1, "yes"])
def test_validate_must_be_a_bool_or_none(validate):
    q, k, v, pooled = _data()
    with pytest.raises(TypeError, match="validate must be True, False or None"):
        ops.decode_attention(q, k, v, kv_len=[17, 20], scale=0.3, backend="torch", validate=validate)


def test_every_public_op_with_index_values_takes_validate():
    import inspect

    for name in ("attention_features", "decode_attention", "efficient_attention", "macs_pool", "macs_pool_paged",
                 "macs_update", "macs_update_rows", "macs_zscore"):
        parameter = inspect.signature(getattr(ops, name)).parameters["validate"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None, name


def test_a_cache_longer_than_32_bit_key_offsets_is_refused_before_any_work():
    """The kernels count a tile's keys in 32 bits: a cache of more than MAX_KEYS keys per item is refused from its
    shape (stride-0 views: nothing that large is allocated), contiguous or paged, by every op that reads one."""
    q, _, _, pooled = _data()
    huge = torch.zeros(1, 1, 1, D).expand(B, H_KV, _checks.MAX_KEYS + 1, D)
    ranges = dict(input_start=0, input_end=5, kv_len=torch.tensor([9, 10]), scale=1.0, backend="torch")
    message = rf"k_cache: {_checks.MAX_KEYS + 1} keys per item, more than the kernels' 32-bit key offsets reach"
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(q, huge, huge, kv_start=0, input_end=5, kv_len=torch.tensor([9, 10]), scale=1.0,
                             pooled=pooled, backend="torch")
    with pytest.raises(ValueError, match=message):
        ops.macs_update(q, huge, torch.zeros(B, N_MAX), **ranges)
    with pytest.raises(ValueError, match=message):
        ops.macs_pool(q, huge, **ranges)
    pages = torch.zeros(6, 1, H_KV, D).expand(6, 2**29, H_KV, D)
    with pytest.raises(ValueError, match=r"k_pages through block_table: 2147483648 keys per item"):
        ops.macs_pool_paged(q, pages, torch.zeros(B, 4, dtype=torch.int32), **ranges)
