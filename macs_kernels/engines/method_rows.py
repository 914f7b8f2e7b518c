"""The rows that the efficient and norm methods pool in a generate pass, and the softmax rows hooks read: each
needs the layer's attention row of the last query first (over its variant's keys, in token positions), then the
method's state kept across the passes of a sequence (efficient: the Gram matrices of each layer's values; norm:
the value norms through the output projection)."""
from __future__ import annotations

import dataclasses

import torch

from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import Variant


@dataclasses.dataclass
class RowRanges:
    """Where the last query of the pass in progress attends: inputs [start, end) and keys up to kv_len (B,) each,
    in token positions; `variant`: the attention of the layer in progress."""

    start: torch.Tensor
    end: torch.Tensor
    kv_len: torch.Tensor
    variant: Variant


def layer_softmax(ranges: RowRanges, query_last, key, scale):
    """(rows (B, H, S) over the layer's own key slots, their attended [start, end) slots (B,) each)."""
    variant = ranges.variant
    scores = torch_backend.grouped_scores(query_last, key, scale)
    attend, _, _, length = torch_backend.window_ranges(ranges.start, ranges.end, ranges.kv_len, variant.key_offset,
                                                       variant.window)
    rows, _ = torch_backend.attended_softmax(scores, attend, length, softcap=variant.softcap, sinks=variant.sinks)
    return rows, attend, length


def in_tokens(ranges: RowRanges, rows: torch.Tensor) -> torch.Tensor:
    offset = ranges.variant.key_offset
    return torch.nn.functional.pad(rows, (offset, 0)) if offset else rows


def softmax_rows(ranges: RowRanges, query_last: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """The last query's softmax rows (B, H, S) over the attended keys (zeros elsewhere), float32: with the layer's
    variant, over token positions (a window layer's rows padded with zeros for the tokens its cache dropped)."""
    return in_tokens(ranges, layer_softmax(ranges, query_last, key, scale)[0])


def window_efficient_rows(ranges: RowRanges, query_last, key, value, scale: float, backend: str | None):
    """(efficient rows (B, H, S) in token positions, residual (B, H)) of the last query of a window layer: its
    softmax row projected onto its window's values (the layer's cache holds the window only, so their Gram matrix
    is recomputed, O(W D^2))."""
    from macs_kernels.ops import efficient_attention

    rows, attend, length = layer_softmax(ranges, query_last, key, scale)
    projected, residual = efficient_attention(rows[:, :, None], value, kv_start=attend, kv_len=length, backend=backend)
    return in_tokens(ranges, projected[:, :, 0]), residual[:, :, 0]


class MethodRows:
    """The efficient or norm method's state across a sequence's passes, and its rows (B, H, S) per layer.

    norm_grams: each layer's head Gram matrices of attention="norm", kept across sequences (they depend on the
    weights only); `output_watch` (norm.OutputWatch) is set by attach."""

    def __init__(self, attention: str, num_layers: int, efficient_backend: str | None):
        self.attention, self.num_layers, self.efficient_backend = attention, num_layers, efficient_backend
        self.norm_grams: dict = {}
        self.output_watch = None
        self.gram = self.norms = None
        self.reset()

    @property
    def active(self) -> bool:
        return self.gram is not None or self.norms is not None

    def reset(self) -> None:
        """A new sequence starts: the states of the previous one go."""
        if self.attention == "efficient":
            from macs_kernels.core.methods.efficient import GramState

            self.gram = GramState(self.num_layers)
        if self.attention == "norm":
            from macs_kernels.core.methods.norm import NormState

            self.norms = NormState(self.norm_grams)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        for state in (self.gram, self.norms):
            if state is not None:
                state.reorder(beam_idx)

    def rows(self, ranges: RowRanges, layer: int, module, query_last, key, value, scale: float, prefill: bool):
        """The method's rows of the last query of `layer`, after adding this pass's values to its state."""
        if self.gram is not None:
            return self._efficient(ranges, layer, query_last, key, value, scale, prefill)
        from macs_kernels.core.methods.norm import norm_weighted_rows

        norms = self.norms.update(layer, module, value, prefill, ranges.kv_len)
        return norm_weighted_rows(softmax_rows(ranges, query_last, key, scale), norms)

    def _efficient(self, ranges: RowRanges, layer: int, query_last, key, value, scale: float, prefill: bool):
        """A window layer's row projects onto its window's values (the keys it attends): their Gram matrix is
        recomputed from the layer's cache, which holds the window only."""
        from macs_kernels.core.methods.efficient import efficient_rows

        if ranges.variant.window is not None:
            return window_efficient_rows(ranges, query_last, key, value, scale, self.efficient_backend)[0]
        self.gram.append(layer, *_gram_values(ranges, value, prefill))
        rows, _ = efficient_rows(softmax_rows(ranges, query_last, key, scale), value, self.gram.gram(layer),
                                 ranges.start, ranges.kv_len, backend=self.efficient_backend)
        return rows


def _gram_values(ranges: RowRanges, value, prefill: bool):
    """(values (B, H_kv, T, D), valid (B, T)) of this pass's new slots in one full layer's value cache: every
    attended slot on a sequence's first pass (prompt, earlier turns), then the new token's slot (a static
    cache writes it anywhere)."""
    if prefill:
        slots = torch.arange(value.shape[2], device=value.device)
        return value, (slots >= ranges.start[:, None]) & (slots < ranges.kv_len[:, None])
    index = (ranges.kv_len - 1).view(-1, 1, 1, 1).expand(-1, value.shape[1], 1, value.shape[3])
    return value.gather(2, index), torch.ones(value.shape[0], 1, dtype=torch.bool, device=value.device)
