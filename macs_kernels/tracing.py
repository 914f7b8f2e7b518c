"""The generation tracer and its transformers integration.

`attach(model, **config)` swaps the model's attention implementation for a registered wrapper around it
(sdpa, eager or flash_attention_2). For every layer of every forward pass the wrapper

1. runs the wrapped implementation and returns its output untouched (on decode steps with a GPU backend,
   the fused decode kernel computes the output and the MACS term together, reading K once);
2. hands the LAST query row and the key cache to the backend's `macs_update`, which adds this layer's
   log-term to an O(N) float32 state;
3. after the last layer, z-scores the state: one row of step scores per forward pass.

The tracer is the only stateful object. A pass whose query is longer than one token, or that finds no
earlier pass, starts a new sequence: every attended key then is an input. Per-layer extensions (AT2 query
capture, row recording for evaluation) hang on the same tracer as `TraceHook`s.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch

from .config import MacsConfig
from .ops import torch_backend
from .ops._dispatch import implementation, resolve_backend

# Registered names must contain neither "flash" nor "sdpa": transformers treats those specially.
WRAPPED_NAMES = {"sdpa": "macs_kernels", "eager": "macs_kernels_eager", "flash_attention_2": "macs_kernels_fa2"}


class TraceHook:
    """Per-layer extension point: subclasses see each pass and each layer's tensors."""

    def begin_pass(self, tracer: "Tracer", prefill: bool) -> None:
        pass

    def layer(self, tracer: "Tracer", layer_idx: int, query, key, value, output, scale: float) -> None:
        """`scale`: the softmax scale this layer used (its own `module.scaling` or the call's `scaling`)."""

    def end_pass(self, tracer: "Tracer") -> None:
        pass


class Tracer:
    """MACS state of the sequences that pass through one model.

    After a generate/forward call, `step_log_c` and `step_scores` hold one (B, N_max) float32 row per
    forward pass (log consistency and z-scores), `n_input` the inputs per item and `input_start` the
    left pads per item.
    """

    def __init__(self, config: MacsConfig, num_layers: int, device: torch.device, hooks=()):
        self.config = config
        self.num_layers = num_layers
        self.hooks = list(hooks)
        self.backend = resolve_backend(config.backend, device)
        self._macs_update = implementation(self.backend, "macs_update")
        self._macs_update_rows = implementation(self.backend, "macs_update_rows")
        self._macs_zscore = implementation(self.backend, "macs_zscore")
        fused = config.fused_decode if config.fused_decode is not None else self.backend != "torch"
        self._fused_decode = implementation(self.backend, "decode_attention") if fused else None
        # Efficient rows have torch and Triton kernels; with cuda named, the best of those runs them.
        self._efficient_backend = config.backend if config.backend in ("torch", "triton") else None
        self.reset()

    def reset(self) -> None:
        self.step_log_c: list[torch.Tensor] = []
        self.step_scores: list[torch.Tensor] = []
        self.input_start = None
        self.input_end = None
        self.kv_len = None
        self.n_input = None
        self.n_input_list: list[int] | None = None
        self._log_c = None
        self.prefill = False
        self._unpadded = self._dense = False
        self._attended = None
        self._gram = None
        if self.config.attention == "efficient":
            from .efficient import GramState

            self._gram = GramState(self.num_layers)

    # ---- one forward pass -------------------------------------------------------------------------
    def _begin_pass(self, query: torch.Tensor, key: torch.Tensor, mask) -> None:
        q_len, keys = query.shape[2], key.shape[2]
        attended = _attended_keys(mask, query.shape[0], keys, key.device)
        kv_len = keys - attended.flip(-1).int().argmax(-1)
        self.prefill = q_len > 1 or keys == q_len or self.n_input is None
        if self.prefill:
            input_start = attended.int().argmax(-1)
            counts = attended.sum(-1)
            # One host sync per sequence: the inputs must be one contiguous run of keys,
            # and the last query (a prompt token, not a right pad) attends its own slot.
            ends_at_query = (kv_len == q_len) | (kv_len == keys)
            if bool(((kv_len - input_start != counts) | (counts == 0) | ~ends_at_query).any()):
                raise ValueError(
                    "the attention mask is not left padding (attended keys must form one run ending at the "
                    "last key); pad on the left"
                )
            self.reset()
            self.prefill = True
            # No mask on the prefill: no pads, every item's inputs are keys [0, N).
            self._unpadded = mask is None
            self.input_start, self.input_end = input_start, kv_len
            self._attended = attended
            self.n_input = kv_len - input_start
            self.n_input_list = self.n_input.tolist()
        self.kv_len = kv_len
        # No mask now either: every key slot is attended, so the torch path needs no masks nor gathers.
        self._dense = self._unpadded and mask is None and self.backend == "torch"
        self._log_c = torch.zeros(query.shape[0], max(self.n_input_list), dtype=torch.float32, device=key.device)
        for hook in self.hooks:
            hook.begin_pass(self, self.prefill)

    def _end_pass(self) -> None:
        log_c = self._log_c
        # A NaN anywhere in an attention row reaches the state; -inf (underflow at alpha = 1) is legitimate.
        if bool(torch.isnan(log_c).any()):
            raise FloatingPointError(
                "NaN in an attention row during generation: the model produced non-finite attention; "
                "no scores were computed for this step"
            )
        self.step_log_c.append(log_c)
        self.step_scores.append(self._macs_zscore(log_c, self.n_input))
        for hook in self.hooks:
            hook.end_pass(self)

    def softmax_rows(self, query_last: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
        """The last query's softmax rows (B, H, S) over the attended keys (zeros elsewhere), float32."""
        scores = torch_backend.grouped_scores(query_last, key, scale)
        return torch_backend.attended_softmax(scores, self.input_start, self.kv_len)[0]

    def efficient_rows(self, layer: int, query_last, key, value, scale: float) -> torch.Tensor:
        """The last query's efficient rows (B, H, S), after adding this pass's values to the Gram state.

        The Gram state follows the cache by appending its newest slot on decode steps, so it assumes a
        dynamic cache (new tokens at the end), the default of generate().
        """
        from .efficient import efficient_rows

        if self.prefill:
            new_values, valid = value, self._attended
        else:
            new_values = value[:, :, -1:]
            valid = torch.ones(value.shape[0], 1, dtype=torch.bool, device=value.device)
        self._gram.append(layer, new_values, valid)
        rows, _ = efficient_rows(
            self.softmax_rows(query_last, key, scale), value, self._gram.gram(layer), self.input_start,
            self.kv_len, backend=self._efficient_backend,
        )
        return rows

    def _update_kwargs(self) -> dict:
        config = self.config
        return dict(
            input_start=self.input_start, input_end=self.input_end, kv_len=self.kv_len,
            alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
        )

    def attention(self, module, query, key, value, attention_mask, inner, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if layer == 0:
            self._begin_pass(query, key, attention_mask)
        scale = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
        query_last = query[:, :, -1, :]
        fused = (
            self._fused_decode is not None and not self.prefill and self._gram is None
            and not kwargs.get("output_attentions", False) and not module.training
        )
        config = self.config
        if fused:
            if self._dense:
                out = torch_backend.decode_attention_dense(
                    query_last, key, value, self._log_c, n_input=self.n_input_list[0], scale=scale,
                    alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
                )
            else:
                out, _ = self._fused_decode(
                    query_last, key, value, kv_start=self.input_start, kv_len=self.kv_len, scale=scale,
                    log_c=self._log_c, input_end=self.input_end, alpha=config.alpha, pooling=config.pooling,
                    redistribute=config.redistribute,
                )
            result = (out.unsqueeze(1), None)
        else:
            result = inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            if self._gram is not None:
                rows = self.efficient_rows(layer, query_last, key, value, scale)
                self._macs_update_rows(rows, self._log_c, **self._update_kwargs())
            elif self._dense:
                torch_backend.macs_update_dense(
                    query_last, key, self._log_c, n_input=self.n_input_list[0], scale=scale, alpha=config.alpha,
                    pooling=config.pooling, redistribute=config.redistribute,
                )
            else:
                self._macs_update(query_last, key, self._log_c, scale=scale, lse=None, **self._update_kwargs())
        for hook in self.hooks:
            hook.layer(self, layer, query, key, value, result[0], scale)
        if layer == self.num_layers - 1:
            self._end_pass()
        return result

    # ---- results ----------------------------------------------------------------------------------
    def rows(self, item: int, steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(step_log_c, step_scores) of batch item `item`: (steps, N_item) float32 tensors on the CPU."""
        if not self.step_log_c:
            raise RuntimeError("nothing was traced: run a forward or generate call inside attach()")
        n = self.n_input_list[item]
        steps = len(self.step_log_c) if steps is None else steps
        log_c = torch.stack([row[item, :n] for row in self.step_log_c[:steps]]).cpu()
        scores = torch.stack([row[item, :n] for row in self.step_scores[:steps]]).cpu()
        return log_c, scores


def _attended_keys(mask, batch: int, keys: int, device) -> torch.Tensor:
    """(B, S) bool: which keys the LAST query attends, from whatever mask the wrapped implementation uses."""
    if mask is None:
        return torch.ones(batch, keys, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask (B, S), 1 = token
        return mask.bool()
    row = mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        return row.expand(batch, keys)
    return (row > torch.finfo(row.dtype).min / 2).expand(batch, keys)  # additive float mask


def _model_eager(module):
    """The eager attention function of the module's own modeling file (transformers keeps eager out of
    the registry)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise TypeError(f"{type(module).__name__} has no module-level eager_attention_forward to wrap")
    return function


def _traced_attention(wrapped: str):
    from transformers import AttentionInterface

    registry = AttentionInterface()

    def forward(module, query, key, value, attention_mask, **kwargs):
        tracer = getattr(module, "_macs_tracer", None)
        if tracer is None:
            raise RuntimeError(
                f"{type(module).__name__} runs macs_kernels attention but no tracer is attached; "
                "use macs_kernels.attach(model)"
            )
        inner = _model_eager(module) if wrapped == "eager" else registry[wrapped]
        return tracer.attention(module, query, key, value, attention_mask, inner, **kwargs)

    return forward


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for wrapped, name in WRAPPED_NAMES.items():
        AttentionInterface.register(name, _traced_attention(wrapped))
        # Without a mask function of our own, transformers passes no mask and padded batches go wrong.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[wrapped])


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    modules = {}
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            modules[module.layer_idx] = module
    return modules


def check_model(model) -> dict[int, torch.nn.Module]:
    """The model's attention modules by layer, or a clear error when MACS cannot trace this model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers model")
    if not getattr(model, "_supports_attention_backend", False):
        raise TypeError(
            f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, "
            "so macs_kernels cannot trace it"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or []
    if any("sliding" in str(kind) for kind in layer_types) or (
        getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True)
    ):
        raise NotImplementedError(
            "sliding-window attention layers are not supported: their cache keeps only the window, so key "
            "slots no longer map to tokens"
        )
    modules = _attention_modules(model)
    if sorted(modules) != list(range(len(modules))) or not modules:
        raise TypeError(f"could not find one attention module per layer in {type(model).__name__}")
    return modules


@contextlib.contextmanager
def attach(model, *, hooks=(), **config):
    """Trace every generate/forward call on `model` inside the block; yields the `Tracer`.

    config: MacsConfig fields (alpha, pooling, redistribute, attention, backend). The model's previous
    attention implementation (sdpa, eager or flash_attention_2) is wrapped, and restored on exit.
    """
    macs_config = MacsConfig(**config)
    modules = check_model(model)
    previous = model.config._attn_implementation
    if previous in WRAPPED_NAMES.values():
        raise RuntimeError("a macs_kernels tracer is already attached to this model")
    if previous not in WRAPPED_NAMES:
        raise ValueError(f"cannot wrap attention implementation {previous!r}; use one of {list(WRAPPED_NAMES)}")
    device = next(model.parameters()).device
    tracer = Tracer(macs_config, len(modules), device, hooks)
    _register()
    for module in modules.values():
        module._macs_tracer = tracer
    model.set_attn_implementation(WRAPPED_NAMES[previous])
    try:
        yield tracer
    finally:
        model.set_attn_implementation(previous)
        for module in modules.values():
            del module._macs_tracer
