"""AT2 features from an sdpa/FlashAttention model: captured post-RoPE queries + the KV cache -> attention_features.

Two ways to get the queries of the target rows (the row that predicts response token t is the query at
position t - 1, i.e. the last query of the forward pass that produced t):

- during generation: `QueryCapture()` inside `attach(model, hooks=[capture])` keeps, per layer, the last
  query of every pass (B, H, D) and the latest key tensor: after generate, `capture.features(...)` gives
  the features of any target token range with one attention_features call per layer;
- one forward (training): `forward_capture` runs the model once over prompt + response[:-1] and keeps the
  last R queries of every layer.

Memory: the queries are L x T x H x D (plus, for each sliding-window layer, its keys and values of every token,
which its own cache drops); the features L x H x N. The (L, H, T, N) attention tensor is never built: each
layer's rows, with the layer's attention variant, are reduced over the target rows inside the op.
"""
from __future__ import annotations

import dataclasses

import torch

from macs_kernels.core.config import AT2_ATTENTIONS
from macs_kernels.core.shards import gather_heads
from macs_kernels.engines.generate import TraceHook, attach
from macs_kernels.ops import attention_features, efficient_attention
from macs_kernels.ops.torch.backend import attended_softmax, window_start
from macs_kernels.ops.torch.features import ROW_CHUNK
from macs_kernels.ops.variant import PLAIN, Variant


class QueryCapture(TraceHook):
    """Per layer: the last `rows` queries of each pass (appended), the latest key and value tensors, and the
    softmax scale the layer used (its own `module.scaling`: GPT-2 divides by layer_idx + 1, Granite uses an
    attention_multiplier, Gemma 3 query_pre_attn_scalar ** -0.5).

    rows=1 (default) is the generation mode. After the traced call, `kv_start` (B,) are the left pads and
    `kv_len` (B,) is the key after the last captured row.

    Each layer's attention variant (`ops.Variant`: sliding window, softcap, sinks) is kept too and passed to the
    ops. A sliding-window layer's cache drops the tokens that slid out, so the capture keeps that layer's keys
    and values of every token itself (the new tokens of each pass appended): the same size as a full layer's
    cache, and every target row's window, whatever the sources, is then scored by the same op as a full layer.
    """

    method = "at2"

    def __init__(self, rows: int = 1):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = rows
        self.queries: list[list[torch.Tensor]] = []
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.scales: list[float | None] = []
        self.variants: list[Variant] = []
        self._window_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kv_start = self.kv_len = None
        self.shards = None

    def begin_pass(self, tracer, prefill: bool) -> None:
        # Under tensor parallelism this rank sees its own heads; features are gathered in global head order.
        self.shards = tracer.shards
        if prefill:
            self.queries = [[] for _ in range(tracer.num_layers)]
            self.keys = [None] * tracer.num_layers
            self.values = [None] * tracer.num_layers
            self.scales = [None] * tracer.num_layers
            self.variants = [PLAIN] * tracer.num_layers
            self._window_buffers = {}
            self.kv_start = tracer.input_start

    def layer(self, tracer, layer_idx, query, key, value, output, scale) -> None:
        if query.shape[2] < self.rows:
            raise ValueError(f"a pass has {query.shape[2]} queries, fewer than the {self.rows} rows to capture")
        variant = tracer.variant
        if variant.window is not None:
            key, value = self._every_token(layer_idx, key, value, variant.key_offset, int(tracer.kv_len.max()))
        if not variant.plain:  # the keys are every token's: slot j holds token j; features need no gradient
            variant = dataclasses.replace(variant, key_offset=0,
                                          sinks=None if variant.sinks is None else variant.sinks.detach())
        self.queries[layer_idx].append(query[:, :, -self.rows:, :].contiguous())
        self.keys[layer_idx] = key
        self.values[layer_idx] = value
        self.scales[layer_idx] = scale
        self.variants[layer_idx] = variant

    def _every_token(self, layer, key, value, key_offset, tokens):
        """A window layer's keys and values of every token so far (`tokens`): the kept ones plus this pass's
        tokens (those after the kept ones; key slot j of the layer's cache holds token key_offset + j, and a static
        window buffer that is not full yet holds no token from slot `tokens` on). Tokens a cache passed in had
        already dropped lie before every captured row's window: zeros stand in for them. They are kept in buffers
        that double when full, so a generation copies each token O(1) times rather than once per pass."""
        key, value = key[:, :, : tokens - key_offset], value[:, :, : tokens - key_offset]
        buffers = self._window_buffers.get(layer)
        count = key_offset if buffers is None else self.keys[layer].shape[2]
        first = count - key_offset
        if first < 0:
            raise RuntimeError("a window layer's cache dropped tokens that no captured pass kept")
        total = count + key.shape[2] - first
        if buffers is None or total > buffers[0].shape[2]:
            capacity = max(total, 2 * (0 if buffers is None else buffers[0].shape[2]))
            grown = tuple(t.new_zeros(*t.shape[:2], capacity, t.shape[3]) for t in (key, value))
            for new, old in zip(grown, buffers or ()):
                new[:, :, :count] = old[:, :, :count]
            buffers = self._window_buffers[layer] = grown
        buffers[0][:, :, count:total] = key[:, :, first:]
        buffers[1][:, :, count:total] = value[:, :, first:]
        return buffers[0][:, :, :total], buffers[1][:, :, :total]

    def end_pass(self, tracer) -> None:
        self.kv_len = tracer.kv_len

    @property
    def n_rows(self) -> int:
        """Captured rows per layer."""
        return sum(q.shape[2] for q in self.queries[0]) if self.queries else 0

    def layer_queries(self, layer: int) -> torch.Tensor:
        return torch.cat(self.queries[layer], dim=2)

    def features(self, *, source_start, source_end, target_start=0, target_end=None, backend=None,
                 attention="softmax"):
        """(B, L, H, N_max) float32: per layer and head, the attention on keys [source_start, source_end)
        (absolute cache slots, (B,) or int) averaged over the target rows [target_start, target_end[b]),
        each layer's rows with the scale it used.

        Row t is the query that predicts response token t (row 0: the prompt's last token).
        target_end: (B,) or int, default all captured rows (pass each item's own length for batches
        whose responses ended at different steps).
        attention="efficient" sums efficient rows (ops.efficient_attention over each row's causal prefix of
        the value cache, a window layer's over the row's window) instead of softmax rows; it materialises one
        layer's (B, H, R, S) rows at a time.
        """
        if attention not in AT2_ATTENTIONS:
            raise ValueError(f"AT2 features take attention in {AT2_ATTENTIONS}, got {attention!r}")
        if not self.queries or not self.queries[0]:
            raise RuntimeError("nothing was captured: run generate/forward inside attach(model, hooks=[capture])")
        total = self.n_rows
        device = self.keys[0].device
        batch = self.keys[0].shape[0]
        end = torch.as_tensor(total if target_end is None else target_end, device=device).long().expand(batch)
        if not 0 <= target_start < int(end.min()) or int(end.max()) > total:
            raise ValueError(f"target rows [{target_start}, {end.tolist()}) must be non-empty within [0, {total})")
        n_rows = end - target_start
        kv_len = self.kv_len - total + end
        stop = int(end.max())
        layers = []
        for layer, key in enumerate(self.keys):
            q = self.layer_queries(layer)[:, :, target_start:stop]
            variant = self.variants[layer]
            if attention == "efficient":
                layers.append(_efficient_features(
                    q, key, self.values[layer], source_start=source_start, source_end=source_end,
                    kv_start=self.kv_start, kv_len=self.kv_len - total + stop, n_rows=n_rows,
                    scale=self.scales[layer], backend=backend, variant=variant,
                ))
                continue
            layers.append(attention_features(
                q, key, source_start=source_start, source_end=source_end, kv_len=kv_len, kv_start=self.kv_start,
                n_rows=n_rows, scale=self.scales[layer], backend=backend, variant=variant,
            ))
        local = torch.stack(layers, dim=1) / n_rows.view(-1, 1, 1, 1).float()
        return gather_heads(local, self.shards, dim=2)


def _efficient_features(q, key, value, *, source_start, source_end, kv_start, kv_len, n_rows, scale, backend,
                        variant):
    """attention_features of efficient rows: q (B, H, R, D) rows r attending [kv_start, kv_len - R + r + 1), rows
    r >= n_rows[b] left out; with the layer's variant (a window row projects onto its window's values). Returns
    (B, H, N_max) float32."""
    batch, heads, rows, dim = q.shape
    kv_heads = key.shape[1]
    # Query heads h = kv_head * G + g share a KV head: one matmul per KV head for all G x R rows.
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * rows, dim).float()
    scores = torch.matmul(grouped, key.float().transpose(-1, -2)).view(batch, heads, rows, -1).mul_(scale)
    row_end = kv_len.view(-1, 1) - rows + torch.arange(1, rows + 1, device=key.device).view(1, -1)
    row_start = window_start(kv_start.view(-1, 1).expand(batch, rows), row_end, variant.window)
    probabilities, _ = attended_softmax(scores, row_start, row_end, softcap=variant.softcap, sinks=variant.sinks)
    valid_rows = torch.arange(rows, device=key.device).view(1, -1) < n_rows.view(-1, 1)
    if variant.window is None:
        a_eff, _ = efficient_attention(probabilities, value, kv_len=kv_len, kv_start=kv_start, causal=True,
                                       backend=backend)
        summed = (a_eff * valid_rows[:, None, :, None]).sum(dim=2)
    else:
        summed = _window_efficient_sum(probabilities, value, row_start, row_end, valid_rows, variant.window, backend)
    return _source_columns(summed, source_start, source_end)


def _window_efficient_sum(probabilities, value, row_start, row_end, valid_rows, window, backend):
    """Efficient rows of a window layer summed over the valid rows: (B, H, S). Each row projects onto the values
    of its own window [row_start, row_end) (at most `window` keys): per chunk of rows, the windows' columns are
    gathered and the rows become the items of one efficient_attention batch (its values R_chunk x W x D)."""
    batch, heads, rows, keys = probabilities.shape
    kv_heads, dim = value.shape[1], value.shape[3]
    width = min(window, keys)
    summed = torch.zeros(batch, heads, keys, dtype=torch.float32, device=value.device)
    for r0 in range(0, rows, ROW_CHUNK):
        chunk = slice(r0, min(rows, r0 + ROW_CHUNK))
        count = chunk.stop - r0
        columns = (row_start[:, chunk, None] + torch.arange(width, device=value.device)).clamp_max(keys - 1)
        p = probabilities[:, :, chunk].gather(-1, columns[:, None].expand(batch, heads, count, width))
        values = value[:, None].expand(batch, count, kv_heads, keys, dim).gather(
            3, columns[:, :, None, :, None].expand(batch, count, kv_heads, width, dim))
        lengths = (row_end - row_start)[:, chunk]
        a_eff, _ = efficient_attention(p.transpose(1, 2).flatten(0, 1)[:, :, None], values.flatten(0, 1),
                                       kv_len=lengths.flatten(), kv_start=0, backend=backend)
        # Columns past a row's window were clamped onto real keys: efficient_attention gave them 0.
        a_eff = a_eff.view(batch, count, heads, width) * valid_rows[:, chunk, None, None]
        summed.scatter_add_(2, columns[:, None].expand(batch, heads, count, width).flatten(2),
                            a_eff.transpose(1, 2).flatten(2).float())
    return summed


def _source_columns(summed, source_start, source_end):
    """Columns [source_start, source_end) ((B,) or int) of summed rows (B, H, S) -> (B, H, N_max), zeros past a
    row's own count."""
    batch, heads, width = summed.shape
    start = torch.as_tensor(source_start, device=summed.device).long().expand(batch)
    counts = torch.as_tensor(source_end, device=summed.device).long().expand(batch) - start
    offsets = torch.arange(int(counts.max()), device=summed.device)
    columns = (start.view(-1, 1) + offsets).clamp_max(width - 1)
    features = summed.gather(2, columns[:, None, :].expand(batch, heads, offsets.numel()))
    return features * (offsets < counts.view(-1, 1))[:, None, :]


@torch.no_grad()
def forward_capture(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> QueryCapture:
    """One forward over prompt + response[:-1] (1-D id tensors); captures the R = len(response) target rows."""
    if response_ids.numel() < 1 or prompt_ids.numel() < 1:
        raise ValueError("the prompt and the response need at least one token each")
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids, response_ids[:-1]]).to(device)[None]
    capture = QueryCapture(rows=response_ids.numel())
    with attach(model, hooks=[capture]):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return capture


def response_token_features(model, prompt_ids, response_ids, context_tokens, *, backend=None) -> torch.Tensor:
    """(L * H, n_context) float32: AT2 features of the context tokens [context_tokens) of the prompt for the
    whole response, averaged over its tokens (one forward)."""
    capture = forward_capture(model, prompt_ids, response_ids)
    features = capture.features(source_start=context_tokens[0], source_end=context_tokens[1], backend=backend)
    return features[0].flatten(0, 1).cpu()
