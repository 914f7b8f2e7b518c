"""ops.macs_pool_paged (macs_pool over a paged KV cache read through a block table) on every backend, against
the float64 reference on the same keys laid out contiguously, and against transformers' own paged cache.

Pages are scattered in a shuffled order, items share prefix pages (prefix caching), tables end in -1, and
the unused slots of every page and every page no item uses hold NaN: a result that reads one is NaN.
"""
from __future__ import annotations

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import reference
from tests.grids import case_ids, pairwise
from tests.helpers import NEEDS_CONTINUOUS_BATCHING
from tests.ops.cases import DEVICE, POOLINGS, backends
from tests.tolerances import RELATIVE_ERROR, relative_error

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def paged(k, kv_len, page_size, generator, shared_prefix_pages=0, spare_pages=3):
    """k (B, H_kv, S, D) in pages: (k_pages (P, page_size, H_kv, D), block_table (B, S / page_size) int32).

    Item b's pages past its longest row (kv_len (B,)) get -1 in the table; its first `shared_prefix_pages`
    pages are item 0's (k must hold the same keys there); pages are numbered in a random order, with spare
    pages of NaN in between."""
    batch, kv_heads, keys, dim = k.shape
    per_item = -(-keys // page_size)
    padded = torch.nn.functional.pad(k, (0, 0, 0, per_item * page_size - keys), value=float("nan"))
    used = [-(-int(length) // page_size) for length in kv_len]
    owners = [(b, j) for b in range(batch) for j in range(used[b]) if b == 0 or j >= shared_prefix_pages]
    numbers = torch.randperm(len(owners) + spare_pages, generator=generator)
    k_pages = torch.full((len(owners) + spare_pages, page_size, kv_heads, dim), float("nan"), dtype=k.dtype)
    table = torch.full((batch, per_item), -1, dtype=torch.int32)
    for (b, j), number in zip(owners, numbers.tolist()):
        k_pages[number] = padded[b, :, j * page_size:(j + 1) * page_size].transpose(0, 1)
        table[b, j] = number
    table[1:, :shared_prefix_pages] = table[0, :shared_prefix_pages]
    return k_pages.to(DEVICE), table.to(DEVICE)


CASES = pairwise({
    "dtype": (torch.float32, torch.float16, torch.bfloat16), "heads": ((3, 1), (9, 3), (4, 2), (2, 2)),
    "pooling": POOLINGS, "redistribute": (True, False), "rows": (1, 3), "page_size": (1, 7, 16, 64),
    "shape": ((41, 16), (113, 64), (300, 64)),
})


@pytest.mark.parametrize("backend", backends("macs_pool_paged"))
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_macs_pool_paged_matches_reference_on_contiguous_keys(case, backend):
    (heads, kv_heads), rows, (keys, dim), page_size = case["heads"], case["rows"], case["shape"], case["page_size"]
    generator = torch.Generator().manual_seed(heads * 5 + rows + page_size)
    batch = 3
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(case["dtype"])
    shared = min(2, (keys // 4) // page_size)  # whole pages of a common prefix, inside every item's inputs
    k[1:, :, :shared * page_size] = k[0, :, :shared * page_size]
    q = torch.randn(batch, heads, rows, dim, generator=generator).to(case["dtype"]).to(DEVICE)
    # Rows of a verify block (row r attends one key more than row r - 1) on items of different lengths.
    last = torch.tensor([keys, keys - 9, keys // 2 + rows])
    kv_len = last[:, None] - rows + 1 + torch.arange(rows)
    start = torch.zeros(batch, rows, dtype=torch.int64)
    end = (kv_len[:, :1] - rows - 3).clamp_min(1).expand(batch, rows)
    k_pages, table = paged(k, last, page_size, generator, shared_prefix_pages=shared)
    ranges = dict(input_start=start.to(DEVICE), input_end=end.to(DEVICE), kv_len=kv_len.to(DEVICE))
    options = dict(scale=dim ** -0.5, pooling=case["pooling"], redistribute=case["redistribute"])
    block = q[:, :, 0] if rows == 1 else q
    row_ranges = {name: value[:, 0] for name, value in ranges.items()} if rows == 1 else ranges
    got = ops.macs_pool_paged(block, k_pages, table, backend=backend, **row_ranges, **options)
    want = reference.macs_pool_reference(q, k.to(DEVICE), **ranges, **options)
    want = want[:, 0] if rows == 1 else want
    assert got.shape == want.shape and got.dtype == torch.float32
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]


@pytest.mark.parametrize("backend", backends("macs_pool_paged"))
def test_macs_pool_paged_equals_macs_pool_with_lse_out_and_an_int64_table(backend):
    """The same keys paged or contiguous give the same m' (given lse and out buffer honoured alike)."""
    generator = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 37, 16, generator=generator)
    q = torch.randn(2, 6, 2, 16, generator=generator).to(DEVICE)
    ranges = dict(input_start=torch.tensor([[0, 0], [4, 4]], device=DEVICE),
                  input_end=torch.tensor([[20, 20], [30, 30]], device=DEVICE),
                  kv_len=torch.tensor([[32, 33], [36, 37]], device=DEVICE), scale=0.25)
    lse = torch.randn(2, 6, 2, generator=generator).abs().add(3.0).to(DEVICE)
    k_pages, table = paged(k, torch.tensor([33, 37]), 8, generator)
    out = torch.full((2, 2, 26), 5.0, device=DEVICE)
    got = ops.macs_pool_paged(q, k_pages, table.long(), lse=lse, out=out, backend=backend, **ranges)
    # The numba backend has the paged op only: its contiguous twin is torch's.
    want = ops.macs_pool(q, k.to(DEVICE), lse=lse, backend="torch" if backend == "numba" else backend, **ranges)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", backends("macs_pool_paged"))
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("extra", ["", "sinks", "softcap"])
def test_macs_pool_paged_with_a_window_reads_only_the_window(backend, pooling, extra):
    """A sliding-window layer's rows: keys before kv_len - window get probability 0 (inputs there get only the
    spread), equal to macs_pool with that window on the contiguous keys; the pages wholly before every row's
    window are NaN (an engine may free them) and never read. With sinks (gpt-oss), each head's sink logit joins
    the denominator; with a softcap (Gemma 2) the logits are capped first."""
    generator = torch.Generator().manual_seed(7)
    k = torch.randn(2, 2, 70, 16, generator=generator)
    q = torch.randn(2, 4, 2, 16, generator=generator).to(DEVICE)
    ranges = dict(input_start=torch.zeros(2, 2, dtype=torch.int64, device=DEVICE),
                  input_end=torch.tensor([[50, 50], [40, 40]], device=DEVICE),
                  kv_len=torch.tensor([[69, 70], [55, 56]], device=DEVICE), scale=0.25, pooling=pooling)
    k_pages, table = paged(k, torch.tensor([70, 56]), 8, generator)
    window = 20
    for b, first in enumerate((69 - window, 55 - window)):
        k_pages[table[b, :first // 8].long()] = float("nan")
    # Sink logits around the rows' largest scores, so that they change every probability.
    variant = dict(sinks=torch.tensor([3.0, -1.0, 6.0, 0.5], device=DEVICE)) if extra == "sinks" else {}
    variant |= dict(softcap=0.5) if extra == "softcap" else {}
    got = ops.macs_pool_paged(q, k_pages, table, backend=backend, window=window, **variant, **ranges)
    want = ops.macs_pool(q, k.to(DEVICE), backend="torch", variant=ops.Variant(window=window, **variant), **ranges)
    if extra:
        plain = ops.macs_pool(q, k.to(DEVICE), backend="torch", variant=ops.Variant(window=window), **ranges)
        assert (want - plain).abs().max() > 1e-2
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Inputs before the window get the spread alone, alike.
    torch.testing.assert_close(got[0, 0, :69 - window], got[0, 0, :1].expand(69 - window))
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        ops.macs_pool_paged(q, k_pages, table, backend=backend, window=0, **ranges)


VARIANT_CASES = pairwise({
    "dtype": (torch.float32, torch.bfloat16), "heads": ((3, 1), (4, 2)), "page_size": (16, 5, 1),
    "window": (4, 17, 1000), "extra": ("", "sinks", "softcap", "sinks+softcap"), "pooling": POOLINGS,
    "rows": (1, 2),
})


@pytest.mark.parametrize("backend", backends("macs_pool_paged"))
@pytest.mark.parametrize("case", VARIANT_CASES, ids=case_ids(VARIANT_CASES))
def test_macs_pool_paged_variants_match_the_reference(case, backend):
    """Sliding windows shorter than the generated keys, ending inside the inputs and longer than every row, with
    sinks and softcaps, against the float64 reference over every token's keys; each item's pages wholly before
    its rows' windows are NaN and -1 in the table (freed by the engine), so a kernel that reads one fails."""
    (heads, kv_heads), rows, page_size, window = case["heads"], case["rows"], case["page_size"], case["window"]
    generator = torch.Generator().manual_seed(heads * 7 + rows + page_size + window)
    k = (torch.randn(2, kv_heads, 45, 24, generator=generator) * 2).to(case["dtype"])
    q = (torch.randn(2, heads, rows, 24, generator=generator) * 2).to(case["dtype"])
    last = torch.tensor([45, 31])
    kv_len = last[:, None] - rows + 1 + torch.arange(rows)
    start, end = torch.tensor([[3], [0]]).expand(2, rows), torch.tensor([[30], [20]]).expand(2, rows)
    k_pages, table = paged(k, last, page_size, generator)
    for b in range(2):
        freed = table[b, : max(0, int(kv_len[b, 0]) - window) // page_size].long()
        k_pages[freed] = float("nan")
        table[b, : len(freed)] = -1
    sinks = torch.randn(heads, generator=generator) * 2 + 4 if "sinks" in case["extra"] else None
    softcap = 1.5 if "softcap" in case["extra"] else None
    options = dict(scale=24 ** -0.5, pooling=case["pooling"])
    want, _ = reference.variant_pool_reference(q, k, k, input_start=start, input_end=end, kv_len=kv_len,
                                               window=window, softcap=softcap, sinks=sinks, **options)
    ranges = dict(input_start=start, input_end=end, kv_len=kv_len)
    block = q[:, :, 0] if rows == 1 else q
    ranges = {name: (value[:, 0] if rows == 1 else value).to(DEVICE) for name, value in ranges.items()}
    got = ops.macs_pool_paged(block.to(DEVICE), k_pages, table, backend=backend, window=window,
                              sinks=None if sinks is None else sinks.to(DEVICE), softcap=softcap, **ranges, **options)
    want = want[:, 0] if rows == 1 else want
    assert got.shape == want.shape and not got.isnan().any()
    assert relative_error(got, want) <= RELATIVE_ERROR[torch.float32]


def _bad_call(**changes):
    q, k_pages = torch.randn(2, 2, 8), torch.randn(6, 4, 1, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    arguments = dict(q=q, k_pages=k_pages, block_table=table, input_start=0, input_end=3,
                     kv_len=torch.tensor([10, 7]), scale=1.0, backend="torch") | changes
    return ops.macs_pool_paged(**arguments)


@pytest.mark.parametrize("changes,message", [
    (dict(block_table=torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32)), r"block_table\[1, 1\] = -1"),
    (dict(block_table=torch.tensor([[0, 1, 6], [3, 4, -1]], dtype=torch.int32)), r"block_table\[0, 2\] = 6 .*< 6"),
    (dict(block_table=torch.tensor([[0.0, 1, 2], [3, 4, 5]])), "block_table must be int32 or int64"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), r"block_table must be \(2, pages\)"),
    (dict(k_pages=torch.randn(6, 4, 1, 16)), r"k_pages must be \(pages, page_size >= 1, H_kv, 8\)"),
    (dict(k_pages=torch.randn(6, 4, 3, 8)), r"multiple of KV heads \(3\)"),
    (dict(kv_len=torch.tensor([13, 7])), "kv_len=13"),
    (dict(window=0), "window must be an int >= 1"),
    (dict(softcap=float("inf")), "softcap must be a finite float > 0"),
    (dict(sinks=torch.zeros(3)), r"sinks must hold one logit per query head \(2\)"),
    (dict(sinks=torch.zeros(2), lse=torch.zeros(2, 2)), "lse cannot be given with sinks"),
    # A window of 3 attends keys [7, 10) of item 0: page 1 is read, page 0 may be freed.
    (dict(window=3, block_table=torch.tensor([[-1, -1, 2], [-1, 4, -1]], dtype=torch.int32)),
     r"block_table\[0, 1\] = -1"),
])
def test_macs_pool_paged_rejects_bad_arguments(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _bad_call(**changes)


@pytest.mark.parametrize("backend", backends("macs_pool_paged"))
def test_pages_before_every_rows_window_may_be_freed(backend):
    """Table entries before each item's window may be -1 (an engine freed those pages); the rows are unchanged."""
    generator = torch.Generator().manual_seed(2)
    q, k_pages = (torch.randn(shape, generator=generator).to(DEVICE) for shape in ((2, 2, 8), (6, 4, 1, 8)))
    options = dict(input_start=0, input_end=torch.tensor([7, 8], device=DEVICE), scale=1.0, window=5,
                   kv_len=torch.tensor([10, 11], device=DEVICE), backend=backend)  # windows [5, 10), [6, 11)
    tables = (torch.tensor(rows, dtype=torch.int32, device=DEVICE) for rows in ([[0, 1, 2], [3, 4, 5]],
                                                                                [[-1, 1, 2], [-1, 4, 5]]))
    kept, freed = (ops.macs_pool_paged(q, k_pages, table, **options) for table in tables)
    assert (kept[:, 6] > kept[:, 0]).all()  # an input inside the window gets attention, one before it the spread
    torch.testing.assert_close(freed, kept, rtol=0, atol=0)


@NEEDS_CONTINUOUS_BATCHING
def test_transformers_paged_cache_through_its_own_block_table(monkeypatch):
    """In a real generate_batch run (tiny GQA model, page size 4, shared prefixes), the op reads the engine's
    page views through the block table transformers' fill_block_table writes (the table its flash decode
    kernel gets) and gives, for every request of a decode pass, the m' of the keys the engine itself read
    back for that request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from tests.helpers import tiny_llama

    model = tiny_llama(heads=6, kv_heads=2)
    model.set_attn_implementation("sdpa")
    checked = []
    original = PagedAttentionCache.update

    def update(self, key_states, value_states, layer_idx, kwargs):
        keys, values = original(self, key_states, value_states, layer_idx, kwargs)
        cu_q, cu_k = (kwargs[name].tolist() for name in ("cu_seq_lens_q", "cu_seq_lens_k"))
        if layer_idx == 1 and len(cu_q) > 2 and all(b - a == 1 for a, b in zip(cu_q, cu_q[1:])):
            checked.append(_compare_pass(self, layer_idx, keys[0], cu_k, kwargs["read_index"]))
        return keys, values

    monkeypatch.setattr(PagedAttentionCache, "update", update)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two whole pages shared by every request
    prompts = [prefix + [20 + i] * (2 + 3 * i) for i in range(3)]
    model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1,
                                                    pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=64, page_size=4, num_blocks=48),
    )
    assert checked and all(error <= RELATIVE_ERROR[torch.float32] for error in checked), checked


def _compare_pass(cache, layer_idx, packed_keys, cu_k, read_index):
    """macs_pool_paged over the engine's pages vs macs_pool over its packed keys, for every request."""
    allocator = cache.layer_to_allocator[layer_idx]
    read = read_index[allocator.index].tolist()
    lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
    table = torch.full((len(lengths), max(lengths) // allocator.tokens_per_page + 1), -1, dtype=torch.int32)
    owners = []
    for i, length in enumerate(lengths):
        # The request whose cache the engine read for segment i: its read indices are that segment's.
        owner = next(request_id for request_id in allocator.block_table
                     if allocator.get_read_indices(request_id, length - 1, 1) == read[cu_k[i]:cu_k[i + 1]])
        owners.append(owner)
        rows = torch.full((len(cache.cache_allocators), table.shape[1]), -1, dtype=torch.int32)
        cache.fill_block_table(owner, length - 1, 1, rows)
        table[i] = rows[allocator.index]
    assert len(set(owners)) == len(owners)
    kv_heads, dim = packed_keys.shape[0], packed_keys.shape[-1]
    contiguous = torch.zeros(len(lengths), kv_heads, max(lengths), dim)
    for i, length in enumerate(lengths):
        contiguous[i, :, :length] = packed_keys[:, cu_k[i]:cu_k[i + 1]]
    q = torch.randn(len(lengths), 3 * kv_heads, dim, generator=torch.Generator().manual_seed(len(owners)))
    ranges = dict(input_start=0, input_end=torch.tensor(lengths) - 2, kv_len=torch.tensor(lengths), scale=0.3)
    k_pages, _ = allocator.get_cache_for_block_table(layer_idx)
    got = ops.macs_pool_paged(q, k_pages, table, backend="torch", **ranges)
    return relative_error(got, reference.macs_pool_reference(q[:, :, None], contiguous, **{
        name: (value[:, None] if isinstance(value, torch.Tensor) else value) for name, value in ranges.items()})[:, 0])
