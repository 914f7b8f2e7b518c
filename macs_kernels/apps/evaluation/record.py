"""One generation, every configuration: the per-layer, per-head attention rows of each step, recorded once.

`RowRecorder` is a TraceHook. For each forward pass (step k produces generated token k) and layer it keeps
the last query's softmax rows over the N inputs (H, N) and, per head, the attention mass that fell on
generated tokens (H,): exactly what MACS needs for any alpha, pooling and redistribution. With
`attentions=("efficient", "norm")` it also keeps the efficient rows (macs_kernels.core.methods.efficient) and the
norm-weighted rows (macs_kernels.core.methods.norm) of the same query in the same form, under "efficient_rows",
"norm_rows" and so on. `macs_from_record` then scores any configuration from the record with the float64 reference,
without touching the model.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from macs_kernels.core.config import DEFAULT_ALPHA, MacsConfig
from macs_kernels.engines.generate import TraceHook, attach, check_model
from macs_kernels.ops.torch import backend as torch_backend

# The rows a record may keep besides the softmax ones (MacsConfig.attention), each under "<attention>_rows/_mass".
RECORDED_ATTENTIONS = ("efficient", "norm")


class RowRecorder(TraceHook):
    """Records each pass's rows of one sequence (batch 1), float32 on the CPU.

    After a generation, `record(steps)` returns {"rows": (steps, L, H, N), "mass": (steps, L, H)} (and
    "<attention>_rows"/"<attention>_mass" for each of `attentions`) as numpy float32 arrays.
    """

    def __init__(self, model, *, attentions=()):
        unknown = set(attentions) - set(RECORDED_ATTENTIONS)
        if unknown:
            raise ValueError(f"a record keeps the rows of {RECORDED_ATTENTIONS} besides softmax, not {sorted(unknown)}")
        self.modules = check_model(model)
        self.num_layers = len(self.modules)
        self.efficient, self.norm = "efficient" in attentions, "norm" in attentions
        self.fields = ("rows", "mass", *(f"{a}_{f}" for a in RECORDED_ATTENTIONS if a in attentions
                                         for f in ("rows", "mass")))
        if self.efficient:
            from macs_kernels.core.methods.efficient import GramState

            self._gram_state = GramState
        if self.norm:  # refused before work, as attach(attention="norm") refuses
            from macs_kernels.core.methods.norm import check_projections
            from macs_kernels.engines.hf_models import check_variants

            check_variants(model, "generate", "norm")
            check_projections(model, self.modules)
            self._grams: dict = {}
        self.watching = None  # norm: the norm.OutputWatch around the generation (generate_record)
        self.passes: list[dict[str, torch.Tensor]] = []
        self.residual_max = 0.0

    def begin_pass(self, tracer, prefill: bool) -> None:
        if len(tracer.n_input_list) != 1:
            raise ValueError(
                f"RowRecorder records one sequence at a time (batch 1); this batch has {len(tracer.n_input_list)}"
            )
        if prefill:
            self.passes = []
            self.residual_max = 0.0
            if self.efficient:
                self.grams = self._gram_state(self.num_layers)
            if self.norm:
                from macs_kernels.core.methods.norm import NormState

                self.norms = NormState(self._grams)
        n, layers = tracer.n_input_list[0], self.num_layers
        self._start, self._n, self._kv_len = int(tracer.input_start[0]), n, int(tracer.kv_len[0])
        self._pass = {
            name: torch.zeros((layers, 0, n) if "rows" in name else (layers, 0))
            for name in self.fields
        }
        self._layer_values: dict[str, list] = {name: [] for name in self._pass}

    def _keep(self, prefix: str, rows: torch.Tensor) -> None:
        start, stop = self._start, self._start + self._n
        self._layer_values[prefix + "rows"].append(rows[0, :, start:stop].float().cpu())
        self._layer_values[prefix + "mass"].append(rows[0, :, stop:self._kv_len].sum(-1).float().cpu())

    def layer(self, tracer, layer_idx: int, query, key, value, output, scale) -> None:
        rows = tracer.softmax_rows(query[:, :, -1, :], key, scale)
        self._keep("", rows)
        if self.efficient and tracer.variant.window is not None:
            eff, residual = tracer.window_efficient_rows(query[:, :, -1, :], key, value, scale)
            self.residual_max = max(self.residual_max, float(residual.max()))
            self._keep("efficient_", eff)
        elif self.efficient:
            from macs_kernels.core.methods.efficient import efficient_rows

            new = query.shape[2]
            positions = torch.arange(key.shape[2] - new, key.shape[2], device=key.device)
            self.grams.append(layer_idx, value[:, :, -new:], (positions >= self._start)[None])
            eff, residual = efficient_rows(
                rows, value, self.grams.gram(layer_idx), tracer.input_start, tracer.kv_len
            )
            self.residual_max = max(self.residual_max, float(residual.max()))
            self._keep("efficient_", eff)
        if self.norm:
            from macs_kernels.core.methods.norm import norm_weighted_rows

            if self.watching is not None:
                self.watching.saw(layer_idx, output)
            norms = self.norms.update(layer_idx, self.modules[layer_idx], value, tracer.prefill, tracer.kv_len)
            self._keep("norm_", norm_weighted_rows(rows, norms))

    def end_pass(self, tracer) -> None:
        self.passes.append({name: torch.stack(values) for name, values in self._layer_values.items()})

    def record(self, steps: int | None = None) -> dict[str, np.ndarray]:
        if not self.passes:
            raise RuntimeError("nothing was recorded: run a generation inside attach(model, hooks=[recorder])")
        passes = self.passes[:steps]
        return {name: torch.stack([p[name] for p in passes]).numpy() for name in passes[0]}


@torch.inference_mode()
def generate_record(model, tokenizer, prompt_ids: torch.Tensor, *, max_new_tokens: int, attentions=(),
                    backend: str | None = None) -> tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]:
    """Greedy generation from prompt_ids (N,) with every step's rows recorded, as explain() generates.

    Returns (record, generated_ids (T,), step_log_c (T, N) of the tracer's own paper-default MACS); the
    rows stop at the first end-of-sequence token (included), as explain()'s do.
    """
    from macs_kernels.api.generation import encode_prompts, eos_ids, generation_kwargs

    ids, mask, _ = encode_prompts(tokenizer, input_ids=prompt_ids)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    recorder = RowRecorder(model, attentions=attentions)
    with contextlib.ExitStack() as stack:
        if recorder.norm:
            from macs_kernels.core.methods.norm import OutputWatch

            recorder.watching = stack.enter_context(OutputWatch(recorder.modules))
        tracer = stack.enter_context(attach(model, hooks=[recorder], **MacsConfig(backend=backend).as_dict()))
        output = model.generate(ids, attention_mask=mask, **generation_kwargs(model, tokenizer, max_new_tokens, {}))
    generated = output[0, ids.shape[1]:].cpu()
    eos = eos_ids(model, tokenizer)
    steps = next((k + 1 for k, t in enumerate(generated.tolist()) if t in eos), len(generated))
    step_log_c, _ = tracer.rows(0, steps)
    record = recorder.record(steps)
    record["residual_max"] = np.float32(recorder.residual_max)
    return record, generated[:steps], step_log_c


def macs_from_record(record: dict, *, alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True,
                     attention: str = "softmax") -> np.ndarray:
    """log c (steps, N) float64 of one MACS configuration, from a RowRecorder record.

    The float64 formula of reference.macs_step_reference (pooled_row_reference, layer_log_term_reference),
    computed for every step and layer at once: a layer's row is its N input columns plus the mass on
    generated tokens, which is all the formula reads of them (their sum), so the record reproduces the full
    rows' log c. Layers are summed in order, as the reference does.
    """
    MacsConfig(alpha=alpha, pooling=pooling, redistribute=redistribute, attention=attention)
    prefix = "" if attention == "softmax" else f"{attention}_"
    if prefix + "rows" not in record:
        raise ValueError(f"this record has no {attention} rows; record them with attentions=({attention!r},)")
    rows = torch.from_numpy(np.asarray(record[prefix + "rows"], dtype=np.float64))  # (steps, L, H, N)
    mass = torch.from_numpy(np.asarray(record[prefix + "mass"], dtype=np.float64))  # (steps, L, H)
    n_input = rows.shape[-1]
    inputs = rows + mass.unsqueeze(-1) / n_input if redistribute else rows
    pooled = {"max": inputs.amax(dim=2), "mean": inputs.mean(dim=2), "min": inputs.amin(dim=2)}[pooling]
    terms = torch_backend.log_floor(pooled, alpha)  # (steps, L, N)
    log_c = torch.zeros(rows.shape[0], n_input, dtype=torch.float64)
    for layer in range(rows.shape[1]):
        log_c = log_c + terms[:, layer]
    return log_c.numpy()


def attention_mean_from_record(record: dict) -> np.ndarray:
    """(steps, N) float64: the last query's softmax rows over the inputs, averaged over layers and heads."""
    return np.asarray(record["rows"], dtype=np.float64).mean(axis=(1, 2))


@torch.no_grad()
def rollout_rows(model, prompt_ids: torch.Tensor, generated_ids: torch.Tensor) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema) of each step's last query over the inputs: (steps, N) float64.

    One eager forward with output_attentions over prompt + generation (the model is switched to eager for
    it and restored). Per layer: heads averaged, identity added, rows renormalised; layers multiplied,
    the first layer applied first. Row k is the query at position N - 1 + k (it produced token k).
    """
    n, steps = prompt_ids.shape[-1], generated_ids.shape[-1]
    ids = torch.cat([prompt_ids.reshape(-1), generated_ids.reshape(-1)[: steps - 1]])[None]
    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attentions = model(ids.to(device), output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(previous)
    length = ids.shape[1]
    eye = torch.eye(length, dtype=torch.float64)
    rollout = eye
    for layer in attentions:
        mixed = layer[0].double().cpu().mean(0) + eye
        rollout = (mixed / mixed.sum(-1, keepdim=True)) @ rollout
    return rollout[n - 1: n - 1 + steps, :n].numpy()
