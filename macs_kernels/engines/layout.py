"""Reading a transformers pass's layout: which key slots each query attends (from whatever mask the wrapped
attention implementation takes), where a sliding-window layer's slots start in tokens (from the cache the model
updates), and whether a batch is left padding. Everything here reads tensors the model hands its attention
function; nothing keeps MACS state.
"""
from __future__ import annotations

import torch

from macs_kernels.engines.hf_models import window_key_offset


def last_row_attended(mask, batch: int, keys: int, device) -> torch.Tensor:
    """(B, S) bool: which keys the LAST query attends, from whatever mask the wrapped implementation uses."""
    if mask is None:
        return torch.ones(batch, keys, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask (B, S), 1 = token
        return mask.bool()
    return _attended(mask[:, 0, -1, :]).expand(batch, keys)


def any_row_attended(mask, batch: int, keys: int, device) -> torch.Tensor:
    """(B, S) bool: which keys ANY query of the pass attends (a window's last query does not attend them all)."""
    if mask is None or mask.dim() == 2:
        return last_row_attended(mask, batch, keys, device)
    return _attended(mask[:, 0]).any(dim=1).expand(batch, keys)


def _attended(mask_rows: torch.Tensor) -> torch.Tensor:
    if mask_rows.dtype == torch.bool:
        return mask_rows
    return mask_rows > torch.finfo(mask_rows.dtype).min / 2  # additive float mask


def row_ends(mask, batch, q_len, keys, rows, device) -> torch.Tensor:
    """(B, rows) int64: last attended key + 1 of the pass's last `rows` queries (each one's causal end).

    Without a mask, sdpa runs causal attention aligned at the first key: a multi-token pass then starts at
    slot 0 (a static cache's prefill hands over every slot), a one-token pass attends every slot. A
    flash-attention padding mask aligns the queries with the last keys."""
    if mask is None:
        first = keys if q_len == 1 else q_len - rows + 1
        return (first + torch.arange(rows, device=device)).expand(batch, rows)
    if mask.dim() == 2:
        return (keys - rows + 1 + torch.arange(rows, device=device)).expand(batch, rows)
    attended = _attended(mask[:, 0, -rows:, :]).expand(batch, rows, keys)
    return keys - attended.flip(-1).int().argmax(-1).long()


class PassLayout:
    """Where a pass's keys are: `windowed` models' window layers hold only their window, their slot j is token
    j + the offset their cache layer says (`cache`: the cache of the pass in progress, set by a pre-hook on layer 0
    and dropped when the pass ends, the caller's to free)."""

    def __init__(self, windowed: bool):
        self.windowed = windowed
        self.cache = None

    def key_offset(self, layer: int, keys: int) -> int:
        """The token that key slot 0 of `layer` holds in this pass (0 but for a window layer's cache)."""
        return window_key_offset(self.cache, layer, keys) if self.windowed else 0

    def attended(self, mask, batch: int, keys: int, device) -> torch.Tensor:
        """(B, S) bool: the keys whose first attended one starts each sequence's inputs (a window's last query does
        not attend them all: where inputs start, every query row says)."""
        read = any_row_attended if self.windowed else last_row_attended
        return read(mask, batch, keys, device)

    @staticmethod
    def dropped_pads(start, last_end, offset: int, positions):
        """Where the inputs of a sequence start when layer 0's window cache already dropped its first tokens (a
        cache passed in): the last query's position id counts the attended tokens before it (generate's
        position ids), so the pads are its slot less its position. The window's mask must agree."""
        if positions is None or positions.dim() != 2:
            raise NotImplementedError(
                "a sliding-window model's cache passed in without (B, S) position_ids: the tracer cannot tell where "
                "the inputs its window layers no longer hold start"
            )
        counted = last_end - 1 - positions[:, -1].to(last_end.device).expand_as(last_end)
        seen_all = start == offset  # the window's first slot attended: the pads, if any, lie before it
        if bool(((counted < 0) | (seen_all & (counted > offset)) | (~seen_all & (counted != start))).any()):
            raise ValueError(
                "the position_ids do not count the attended tokens of a left-padded sequence (attended keys must "
                "form one run ending at the last key, position ids counting them from 0); pad on the left"
            )
        return counted

    def check_left_padding(self, start, last_end, end, mask, batch, q_len, slots, offset, static: bool) -> None:
        """One host sync per sequence: the attended keys must be one contiguous run, the last query (a prompt token,
        not a right pad) attends its own slot, and the inputs are not empty. Without a mask there are no pads. The
        mask covers layer 0's `slots` key slots, from token `offset` on."""
        bad = end <= start
        if mask is not None:
            counts = self.attended(mask, batch, slots, start.device).sum(-1)
            ends_at_query = (last_end - offset == q_len) | (last_end - offset == slots) | static
            bad = bad | (last_end - start.clamp(min=offset) != counts) | ~ends_at_query
        if bool(bad.any()):
            raise ValueError(
                "the attention mask is not left padding (attended keys must form one run ending at the "
                "last key); pad on the left"
            )
