"""The torch form of MACS rows over a packed key tensor (continuous batching's layout, B = 1): every request's
keys back to back, each query row scored against its own request's keys only; and over a paged cache. These
classes say where each row's keys lie; the row's formulas are torch_row's."""
from __future__ import annotations

import functools

import torch

from macs_kernels.ops._checks import check_options
from macs_kernels.ops.torch.row import (
    POOLS,
    cap_logits_,
    generated_mass,
    grouped_output,
    grouped_queries,
    input_probabilities,
    input_slots,
    key_scores,
    outside_range,
    softmax,
    spread,
    window_start,
)


class Segments:
    """Key ranges of R query rows over a packed key tensor, and the constants every layer of a pass shares.

    Row r attends keys [starts[r], starts[r] + lengths[r]), which hold its tokens offsets[r], offsets[r] + 1,
    ... (offsets > 0 for a sliding-window layer's cache, which drops the tokens that slid out); tokens
    [0, n_input[r]) are its inputs, the rest generated tokens (their attention is spread over the inputs where
    redistribute[r]). window: the layer's sliding window (a row attends its last `window` tokens), or None.
    """

    def __init__(self, starts, lengths, n_input, redistribute, device, offsets=None, window=None):
        offsets = [0] * len(starts) if offsets is None else list(offsets)
        if not (len(starts) == len(lengths) == len(n_input) == len(redistribute) == len(offsets)) or not starts:
            raise ValueError("starts, lengths, n_input, redistribute and offsets must be equally long and not empty")
        if any(n < 1 or n > offset + length for n, length, offset in zip(n_input, lengths, offsets)):
            raise ValueError(f"every row needs 1 <= n_input <= its token count, got {n_input} for {lengths} keys "
                             f"after {offsets} dropped tokens")
        self.starts, self.lengths, self.n_input = list(starts), list(lengths), list(n_input)
        self.offsets, self.window = offsets, window
        self.n_max, self.length_max = max(self.n_input), max(self.lengths)
        self.device = device
        lengths_t = torch.tensor(self.lengths, device=device)
        offsets_t = torch.tensor(offsets, device=device)
        self.n_input_t = torch.tensor(self.n_input, device=device).view(-1, 1, 1)
        # (R, L_max): each row's generated keys (slots from its N-th token on) where it redistributes.
        redistributes = torch.tensor(redistribute, dtype=torch.bool, device=device).view(-1, 1)
        self.generated = ~outside_range(self.length_max, self.n_input_t.view(-1) - offsets_t, lengths_t) & redistributes
        # (R, 1, L_max) keys of a row outside its window, and each input's slot (inputs that slid out of the cache
        # get no attention): None when every row attends all its keys and they are its tokens.
        self.before_window = None
        if window is not None:
            attended = window_start(torch.zeros_like(lengths_t), lengths_t, window)
            self.before_window = outside_range(self.length_max, attended, lengths_t).unsqueeze(1)
        self.input_keys = None
        if any(offsets):
            self.input_keys = input_slots(-offsets_t, self.n_max, self.length_max, windowed=True)
        as_index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        self.input_start = as_index([self.starts])
        self.input_end = as_index([[s + n for s, n in zip(self.starts, self.n_input)]])
        self.kv_len = as_index([[s + length for s, length in zip(self.starts, self.lengths)]])
        # The rows in token positions (inputs [0, N), tokens [0, offset + length)) and the token each row's key
        # slot 0 would hold: the ranges of the variant kernels (ops.Variant).
        self.token_ranges = (
            torch.zeros_like(self.input_start), as_index([self.n_input]),
            as_index([[o + length for o, length in zip(offsets, self.lengths)]]),
            as_index([[o - s for o, s in zip(offsets, self.starts)]]),
        )
        self._scores = None

    def _score_buffer(self, kv_heads: int, group: int) -> tuple[torch.Tensor, list]:
        """The (R, H_kv, G, L_max) float32 score buffer of the pass and each row's (H_kv, G, length) view.

        Every layer writes the same per-row ranges, so the -inf padding past a row's length is written once
        per pass, not per layer."""
        if self._scores is None or self._scores[0].shape[1:3] != (kv_heads, group):
            scores = torch.full(
                (len(self.starts), kv_heads, group, self.length_max), float("-inf"), dtype=torch.float32,
                device=self.device,
            )
            self._scores = scores, [scores[r, :, :, :length] for r, length in enumerate(self.lengths)]
        return self._scores

    def probabilities(self, q, key, scale: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax rows (R, H, L_max) float32 of q (H, R, D) over each row's own keys of key (H_kv, S, D),
        zeros past a row's length and before its window. One product per row over its own keys: R x S for the
        whole packed tensor would cost R times more. softcap, sinks: the layer's logit cap and (H,) sink
        logits (`ops.Variant`)."""
        heads, rows, _ = q.shape
        kv_heads = key.shape[0]
        grouped = grouped_queries(q.transpose(0, 1), kv_heads, scale)  # (R, H_kv, G, D)
        scores, row_scores = self._score_buffer(kv_heads, heads // kv_heads)
        for r, (start, length) in enumerate(zip(self.starts, self.lengths)):
            key_scores(grouped[r], key[:, start : start + length], out=row_scores[r])
            cap_logits_(row_scores[r], softcap)  # the row's own keys only: the padding stays -inf
        scores = scores.view(rows, heads, self.length_max)
        if self.before_window is not None:
            scores = scores.masked_fill(self.before_window, float("-inf"))
        return softmax(scores, sinks)

    def outputs(self, probabilities, value) -> torch.Tensor:
        """Attention outputs (R, H, D) float32 of softmax rows (R, H, L_max) over each row's own values of
        value (H_kv, S, D): what the engine's attention returns for these query rows."""
        rows, heads, _ = probabilities.shape
        out = torch.empty(rows, heads, value.shape[-1], dtype=torch.float32, device=value.device)
        for r, (start, length) in enumerate(zip(self.starts, self.lengths)):
            grouped_output(probabilities[r : r + 1, :, :length], value[None, :, start : start + length],
                           out=out[r : r + 1])
        return out

    def input_rows(self, probabilities) -> torch.Tensor:
        """(R, H, N_max): each input token's probability (a view of `probabilities` when the keys are the
        tokens; inputs that slid out of a window's cache get 0); entries past a row's N are not inputs."""
        if self.input_keys is None:
            return probabilities[:, :, : self.n_max]
        return input_probabilities(probabilities, self.input_keys)

    def spread_inputs(self, probabilities) -> torch.Tensor:
        """(R, H, N_max): each input's probability plus, where the row redistributes, an N-th of its mass on
        generated keys; entries past a row's N are not inputs."""
        return spread(self.input_rows(probabilities), generated_mass(probabilities, self.generated), self.n_input_t)


def macs_pool_packed(q, key, segments: Segments, *, scale, pooling="max") -> torch.Tensor:
    """MACS's head-pooled rows m' (before the floor) of R query rows over a packed key tensor: the torch form
    of `ops.macs_pool` with per-row ranges (B = 1), computing each row against its own keys only.

    q: (H, R, D), one row per request; key: (H_kv, S, D), the requests' keys back to back (continuous
    batching's layout); segments: each row's key range, input count and redistribution.
    Returns float32 (R, N_max); entries past a row's N are unspecified.
    """
    check_options(pooling=pooling)
    if q.dim() != 3 or key.dim() != 3 or q.shape[0] % key.shape[0] or q.shape[2] != key.shape[2]:
        raise ValueError(f"q (H, R, D) and key (H_kv, S, D) with H a multiple of H_kv, got {tuple(q.shape)}, "
                         f"{tuple(key.shape)}")
    ends = [start + length for start, length in zip(segments.starts, segments.lengths)]
    if q.shape[1] != len(segments.starts) or max(ends) > key.shape[1]:
        raise ValueError("segments must give one key range per query row, inside the key tensor")
    return POOLS[pooling](segments.spread_inputs(segments.probabilities(q, key, float(scale))))


class Pages:
    """Where R query rows' keys lie in a paged cache (serving engines' layout): row r attends the first
    lengths[r] keys of its item, key j in page block_table[r, j // page_size] at slot j % page_size.

    Built once per pass from the rows' block-table rows; every layer then gathers only the pages the rows
    attend (no padding to the longest row) and scores them in one batched product.
    """

    def __init__(self, block_table: torch.Tensor, lengths, page_size: int):
        if block_table.dim() != 2 or block_table.shape[0] != len(lengths) or not lengths:
            raise ValueError(f"block_table must be (R, pages) with R = {len(lengths)} rows, got "
                             f"{tuple(block_table.shape)}")
        device = block_table.device
        self.page_size, self.rows = page_size, len(lengths)
        counts = [-(-length // page_size) for length in lengths]
        if max(counts) > block_table.shape[1]:
            raise ValueError(f"a row attends {max(lengths)} keys but block_table holds {block_table.shape[1]} pages "
                             f"of {page_size}")
        self.pages_max = max(counts)
        owner = torch.repeat_interleave(torch.arange(self.rows, device=device), torch.tensor(counts, device=device))
        column = torch.cat([torch.arange(count, device=device) for count in counts])
        self.owner, self.column = owner, column
        self.pages = block_table[owner, column].long()
        # (R, 1, L) keys past a row's length (its last page's tail, and the pages it does not have)
        self.lengths = torch.tensor(lengths, device=device)
        keys = self.pages_max * page_size
        self.outside = outside_range(keys, torch.zeros_like(self.lengths), self.lengths).unsqueeze(1)

    def probabilities(self, q, k_pages, scale: float, window: int | None = None,
                      sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Softmax rows (R, H, pages_max * page_size) float32 of q (R, H, D) over each row's own keys of
        k_pages (P, page_size, H_kv, D), any strides; zeros past a row's length, and with a sliding `window`
        zeros before its last `window` keys (pages there may be freed: read, never attended); with (H,) sink
        logits in the denominator (gpt-oss) a row sums to less than 1; logits capped to softcap * tanh(s /
        softcap) first when softcap is set (Gemma 2)."""
        rows, heads, _ = q.shape
        kv_heads = k_pages.shape[2]
        # (pages, H_kv, D, page_size): the product's right operand; free for a page-transposed cache (vLLM's
        # CPU layout), one copy of the attended pages otherwise.
        keys = k_pages.permute(0, 2, 3, 1).index_select(0, self.pages)
        grouped = grouped_queries(q, kv_heads, scale).index_select(0, self.owner)
        page_scores = key_scores(grouped, keys.transpose(-1, -2)).view(len(self.pages), heads, self.page_size)
        scores = torch.empty(rows, heads, self.pages_max, self.page_size, dtype=torch.float32, device=q.device)
        scores[self.owner, :, self.column] = page_scores
        cap_logits_(scores, softcap)
        outside = self.outside
        if window is not None:
            attended = window_start(torch.zeros_like(self.lengths), self.lengths, window)
            outside = outside_range(self.pages_max * self.page_size, attended, self.lengths).unsqueeze(1)
        return softmax(scores.view(rows, heads, -1).masked_fill_(outside, float("-inf")), sinks)
