"""The attention variants of today's open models, declared once for every op that recomputes probabilities."""
from __future__ import annotations

import dataclasses
import math

import torch

from macs_kernels.ops._checks import invalid_entry, values_to_check
from macs_kernels.ops.torch.row import window_ranges, window_start

# The variants as the support table's layouts (core.support.LAYOUTS), each described for a refusal.
LAYOUTS = {
    "sliding_window": "sliding-window attention layers",
    "softcap": "attention logit softcapping (attn_logit_softcapping)",
    "sinks": "attention sinks (per-head sink logits)",
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """How one layer's attention differs from softmax(q . k * scale) over every key its row may see.

    window: a sliding-window layer (Mistral, Qwen2, Gemma 2/3, gpt-oss): the query at token t attends tokens
        [t - window + 1, t] only (transformers' convention; FlashAttention's window_size=(window - 1, 0)).
    key_offset: the token that key slot 0 holds (a sliding-window cache drops the tokens that slid out, so key
        slot j holds token j + key_offset); an int, or a tensor broadcasting against the ops' ranges.
    softcap: logits capped to softcap * tanh(s / softcap) before the softmax (Gemma 2's
        attn_logit_softcapping).
    sinks: (H,) per-head sink logits in the softmax denominator only (gpt-oss's `module.sinks`): a row's
        probabilities over real keys sum to less than 1.
    """

    window: int | None = None
    key_offset: int | torch.Tensor = 0
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {self.window!r}")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not (
                isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap) and self.softcap > 0)):
            raise ValueError(f"softcap must be a finite float > 0 or None, got {self.softcap!r}")
        if self.sinks is not None and (not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1):
            raise ValueError("sinks must be a (H,) tensor of per-head sink logits or None")

    @property
    def plain(self) -> bool:
        """Whether this is plain softmax attention over a cache whose slots are the tokens. A tensor key_offset
        counts as a variant whatever it holds: reading it would cost a host sync (the variant kernels take any
        offset, 0 included)."""
        return (self.window is None and self.softcap is None and self.sinks is None
                and isinstance(self.key_offset, int) and self.key_offset == 0)

    def arguments(self) -> tuple[str, ...]:
        """The names of the arguments that make this a variant (window, softcap, sinks, key_offset): what a backend
        without variant kernels is refused for."""
        names = tuple(name for name in ("window", "softcap", "sinks") if getattr(self, name) is not None)
        return names if isinstance(self.key_offset, int) and self.key_offset == 0 else (*names, "key_offset")

    def kwargs(self) -> dict:
        """The public ops' keyword arguments of this variant (macs_pool, macs_pool_paged, decode_attention)."""
        return {"window": self.window, "key_offset": self.key_offset, "softcap": self.softcap, "sinks": self.sinks}

    def key_slots(self, input_start, input_end, kv_len, scored: bool = True) -> tuple[tuple, dict]:
        """A row's ranges in token positions -> what every backend's kernel takes (the one conversion, for the
        public ops and the row plans alike): the (attended start, input end, kv_len) in key slots of a cache whose
        slot 0 holds token key_offset, and the kernel's variant arguments `score_start` (where a window's input
        columns start, before its first attended slot; None without a window or when no row is `scored`),
        `softcap` and `sinks`."""
        attend, start, end, length = window_ranges(input_start, input_end, kv_len, self.key_offset, self.window)
        score_start = None if self.window is None or not scored else start
        # The kernels read the sinks as a contiguous (H,) vector (Triton's combine took a column of a wider tensor
        # for one).
        sinks = None if self.sinks is None else self.sinks.contiguous()
        return (attend, end, length), {"score_start": score_start, "softcap": self.softcap, "sinks": sinks}

    def check(self, heads: int, input_start: torch.Tensor, kv_len: torch.Tensor, keys: int,
              validate: bool | None = None) -> int:
        """Check against an op's arguments (ranges in token positions, `keys` cache slots); returns the token
        count the cache covers (key_offset + keys): what kv_len may reach. Values are checked where and when
        `validate` says (see ops._checks)."""
        if self.sinks is not None and (self.sinks.shape[0] != heads or self.sinks.device != input_start.device):
            raise ValueError(f"sinks must hold one logit per query head ({heads}) on {input_start.device}, got "
                             f"{tuple(self.sinks.shape)} on {self.sinks.device}")
        if not isinstance(self.key_offset, int) or self.key_offset < 0:
            raise ValueError(f"an op's key_offset must be an int >= 0, got {self.key_offset!r}")
        values = values_to_check(validate, input_start, kv_len)
        if values is not None:
            message = (f"a row attends tokens before key_offset={self.key_offset}, which the cache does not hold "
                       "(a sliding-window cache keeps the window's tokens only)")
            if invalid_entry(window_start(*values, self.window) >= self.key_offset, message) is not None:
                raise ValueError(message)
        return self.key_offset + keys


PLAIN = Variant()


def of_arguments(variant: Variant | None, window=None, key_offset=0, softcap=None, sinks=None) -> Variant:
    """The variant of a public op's call: its optional arguments window, key_offset, softcap, sinks (as
    flash_attn_with_kvcache takes window_size, softcap), or `variant`, the same four in one ops.Variant (what the
    engines hold per layer); not both."""
    given = (window is not None or softcap is not None or sinks is not None
             or not (isinstance(key_offset, int) and key_offset == 0))
    if variant is None:
        return Variant(window=window, key_offset=key_offset, softcap=softcap, sinks=sinks) if given else PLAIN
    if given:
        raise ValueError("give variant= or its arguments (window, key_offset, softcap, sinks), not both")
    return variant
