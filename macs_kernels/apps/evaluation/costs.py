"""The price of each method: seconds and peak memory per generated token, measured on the evaluation's samples.

Two kinds of method. In-generation methods (MACS and its ablations through explain(); AT2 through
AT2Attributor.explain; attention-mean from the recorded rows of every layer and head) cost a greedy
generation with the method attached: their time is that whole generation. After-generation methods
(rollout, AttnLRP, AtMan) run on a finished generation: their time is their own pass, the generation not
included. "generation" (plain greedy decoding) is measured beside them as the baseline both kinds add to.
Peak memory is the peak above what the process held just before the method started: on CPU the resident
set size (Linux's VmHWM, reset through /proc/self/clear_refs), on CUDA torch's peak allocation.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from macs_kernels.apps.evaluation.methods import MODEL_METHODS, Method

COST_VERSION = 1
# The baseline row of the cost table: plain greedy decoding, no attribution.
GENERATION = "generation"
_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def measured(device: torch.device):
    """Yields a dict that holds {"seconds", "peak_bytes"} of the block when it ends (peak_bytes None where
    the platform cannot say: no /proc on CPU)."""
    result = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        try:
            # "5" resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0).
            Path("/proc/self/clear_refs").write_text("5")
            before = _status_bytes("VmRSS")
        except OSError:
            before = None
    start = time.perf_counter()
    yield result
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result["seconds"] = time.perf_counter() - start
    if device.type == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _status_bytes("VmHWM")
        result["peak_bytes"] = None if before is None or peak is None else max(peak - before, 0)


def cost_line(index: int, method: str, key: str, sample: str, measurement: dict, steps: int) -> dict:
    return {"kind": "cost", "index": index, "method": method, "key": key, "sample": sample, "steps": steps,
            "seconds": measurement["seconds"], "peak_bytes": measurement["peak_bytes"],
            "after_generation": method in MODEL_METHODS}


def measure_in_generation(method: Method | None, model, tokenizer, sample, prompt_ids: torch.Tensor,
                          max_new_tokens: int, backend: str | None, steps: int) -> tuple[dict, int]:
    """({"seconds", "peak_bytes"}, generated tokens) of one greedy generation with `method` attached (None:
    plain generation; random: drawing its scores for the `steps` tokens of the sample's generation)."""
    from macs_kernels.api.explanation import explain
    from macs_kernels.api.generation import eos_ids, generation_kwargs

    device = next(model.parameters()).device
    if method is not None and method.kind == "random":
        with measured(device) as cost:
            np.random.default_rng(0).random((steps, prompt_ids.numel()))
        return cost, steps
    if method is not None and method.kind in MODEL_METHODS:
        raise ValueError(f"{method.name} runs after the generation: its cost is its own pass (runner)")
    with measured(device) as cost:
        if method is None:
            ids = prompt_ids.to(device)[None]
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     **generation_kwargs(model, tokenizer, max_new_tokens, {}))
            generated = out[0, ids.shape[1]:].tolist()
            eos = eos_ids(model, tokenizer)
            steps = next((k + 1 for k, t in enumerate(generated) if t in eos), len(generated))
        elif method.kind == "macs":
            config = method.macs
            explanation = explain(model, tokenizer, input_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                  alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
                                  attention=config.attention, backend=backend)
            steps = len(explanation.generated_ids)
        elif method.kind == "at2":
            from macs_kernels.apps.at2 import AT2Attributor

            explanation = AT2Attributor(model, tokenizer).explain(sample.question, sample.context, sources="token",
                                                                  max_new_tokens=max_new_tokens)
            steps = explanation.response_ids.numel()
        elif method.kind == "attention-mean":
            from macs_kernels.apps.evaluation.record import attention_mean_from_record, generate_record

            record, generated, _ = generate_record(model, tokenizer, prompt_ids, max_new_tokens=max_new_tokens,
                                                   backend=backend)
            attention_mean_from_record(record)
            steps = len(generated)
        else:
            raise ValueError(f"no cost measurement for method {method.name!r}")
    return cost, max(steps, 1)
