"""AT2 coefficient files: theta (L, H) float32 in safetensors, with metadata naming the model they fit.

Loading never unpickles. A file's theta must match the model's (layers, heads); a file that records its
model (metadata from `model_record`, as `at2 train` and `AT2Attributor.save` write) is also checked
against the model it is used with, and a different model of the same shape draws a warning: same-shape
models (a fine-tune, another checkpoint of the architecture) load without error but give meaningless scores.

The record is the model's name and its attention fingerprint: per layer, the L2 norm of the attention
module's parameters (float64). Norms are compared with a relative tolerance, so the same weights in
float32, float16 or bfloat16 agree, while a different model does not.

A file also names the questions its coefficients were trained on (`training_record`: a digest of each
question and its context), so an evaluation holds out exactly those questions, whatever file or position
they come from.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

DEFAULT_COEFFICIENTS = Path(__file__).resolve().parents[2] / "data" / "at2_smollm2_135m.safetensors"
# Rounding float32 weights to bfloat16 moves a layer's norm by ~1e-5 relative; other models differ by far more.
FINGERPRINT_TOLERANCE = 1e-3
# Metadata key of the training record: a JSON list of the question_digest of every training question.
TRAINING_QUESTIONS = "training_questions"


def model_shape(model) -> tuple[int, int]:
    """(layers, query heads) of a transformers model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers), int(config.num_attention_heads)


def model_name(model) -> str:
    """The last part of the model's hub id or folder (folders and hub ids of one model agree)."""
    return Path(str(getattr(model.config, "_name_or_path", "") or "")).name


@torch.no_grad()
def attention_fingerprint(model) -> list[float]:
    """Per layer, the L2 norm of its attention module's parameters (float64)."""
    from macs_kernels.engines.generate import check_model

    modules = check_model(model)
    return [
        float(torch.sqrt(sum(p.detach().double().square().sum() for p in modules[layer].parameters())).cpu())
        for layer in range(len(modules))
    ]


def model_record(model) -> dict:
    """The metadata that names `model` in a coefficient file."""
    return {"model": model_name(model), "attention_fingerprint": json.dumps(attention_fingerprint(model))}


def question_digest(question: str, context: str) -> str:
    """SHA-1 of one QA question by its content (question and context), independent of its file and position."""
    return hashlib.sha1(json.dumps([question, context], ensure_ascii=False).encode()).hexdigest()


def training_record(samples) -> dict:
    """The metadata that names the questions (QASample or anything with .question and .context) trained on."""
    return {TRAINING_QUESTIONS: json.dumps(sorted({question_digest(s.question, s.context) for s in samples}))}


def training_questions(metadata: dict) -> frozenset[str] | None:
    """The question digests a file's coefficients were trained on, or None when the file does not record them."""
    recorded = metadata.get(TRAINING_QUESTIONS)
    return None if recorded is None else frozenset(json.loads(recorded))


def save_coefficients(path, theta: torch.Tensor, metadata: dict | None = None) -> None:
    """Write theta (L, H) with string metadata (include model_record(model) to name the model)."""
    from safetensors.torch import save_file

    if theta.dim() != 2:
        raise ValueError(f"theta must be (layers, heads), got {tuple(theta.shape)}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"theta": theta.detach().float().contiguous().cpu()}, str(path),
              metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_coefficients(path, model=None) -> tuple[torch.Tensor, dict]:
    """(theta (L, H) float32, metadata) from a safetensors file.

    With `model`: theta must match its shape (ValueError), and a file recorded for another model warns.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no AT2 coefficient file at {path}; train one with `macs-kernels at2 train --data FILE --out FILE`"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:  # safetensors only: nothing is unpickled
            metadata = dict(handle.metadata() or {})
            if "theta" not in handle.keys():
                raise ValueError(f"{path} holds no 'theta' tensor")
            theta = handle.get_tensor("theta").float()
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for foreign files
        raise ValueError(f"{path} is not a safetensors coefficient file ({error})") from None
    if theta.dim() != 2:
        raise ValueError(f"{path}: theta must be (layers, heads), got {tuple(theta.shape)}")
    if model is not None:
        if tuple(theta.shape) != model_shape(model):
            raise ValueError(
                f"{path} holds coefficients for {theta.shape[0]} layers x {theta.shape[1]} heads, but the model "
                f"has {model_shape(model)[0]} layers x {model_shape(model)[1]} heads: train coefficients for this model"
            )
        mismatch = record_mismatch(metadata, model)
        if mismatch:
            warnings.warn(
                f"{path} holds AT2 coefficients trained for {metadata.get('model') or 'another model'!r}, not for "
                f"this model {model_name(model)!r} ({mismatch}): its scores will not mean what they should; train "
                "coefficients for this model with `macs-kernels at2 train`", UserWarning, stacklevel=2,
            )
    return theta, metadata


def record_mismatch(metadata: dict, model) -> str | None:
    """Why the file's record names another model than `model`, or None (same model, or nothing recorded).

    The fingerprint decides when the file has one (names differ between copies of one model); else the name.
    """
    if "attention_fingerprint" in metadata:
        recorded = torch.tensor(json.loads(metadata["attention_fingerprint"]), dtype=torch.float64)
        actual = torch.tensor(attention_fingerprint(model), dtype=torch.float64)
        if recorded.shape != actual.shape:
            return f"the file records {recorded.numel()} layers, the model has {actual.numel()}"
        difference = float(((recorded - actual).abs() / recorded.abs().clamp_min(1e-30)).max())
        if difference > FINGERPRINT_TOLERANCE:
            return f"its attention weights differ: per-layer norms up to {difference:.1%} apart"
        return None
    recorded_name = metadata.get("model")
    if recorded_name and model_name(model) and Path(recorded_name).name != model_name(model):
        return "the names differ"
    return None
