"""AT2Attributor (explain one generation, train, save, load coefficients) and AT2Explanation (its result)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from macs_kernels.apps.at2.coefficients import (
    DEFAULT_COEFFICIENTS,
    load_coefficients,
    model_record,
    model_shape,
    save_coefficients,
)
from macs_kernels.apps.at2.sources import Source, aggregate, make_sources, source_index

# What an AT2 score is, in the words every view uses.
AT2_SCORE = ("AT2 score: the learned (layer, head) coefficients times the answer's attention on the source, "
             "an estimate of how much the answer depends on it")


@dataclasses.dataclass
class AT2Explanation:
    """AT2 scores of the sources of one context for the response tokens [target[0], target[1])."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    response_tokens: list[str]
    response: str
    context: str
    target: tuple[int, int]
    source_type: str
    sources: list[Source]
    scores: torch.Tensor
    score_definition = AT2_SCORE

    def ranked(self) -> list[tuple[float, Source]]:
        return sorted(zip(self.scores.tolist(), self.sources), key=lambda pair: -pair[0])

    def as_dict(self) -> dict:
        return {
            "method": "at2",
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_tokens": self.response_tokens,
            "response": self.response,
            "target": list(self.target),
            "source_type": self.source_type,
            "sources": [s.as_dict() | {"score": float(v)} for s, v in zip(self.sources, self.scores.tolist())],
        }

    def to_json(self, **dumps_kwargs) -> str:
        return json.dumps(self.as_dict(), **dumps_kwargs)

    def to_html(self, title: str = "AT2 attribution") -> str:
        """A self-contained page in the MACS page's style: the answer, the sources by score, and the context with
        each source coloured by its score (heatmap.js's colour: white at the lowest, red at the highest)."""
        import html
        from importlib import resources

        from macs_kernels.api.viz import PAGE_STYLE, _unit

        parts, at = [], 0
        shaded = zip(self.sources, self.scores.tolist(), _unit(self.scores))
        for source, score, weight in sorted(shaded, key=lambda p: p[0].char_span):
            a, b = source.char_span
            if a < at:  # a token straddling two units: its characters are shown once
                a = at
            parts.append(html.escape(self.context[at:a]))
            parts.append(f'<span title="score = {score:.4f}" data-heat="{weight:.3f}">'
                         f"{html.escape(self.context[a:b])}</span>")
            at = max(at, b)
        parts.append(html.escape(self.context[at:]))
        rows = "".join(f'<tr><td>{rank}</td><td class="score">{v:+.4f}</td><td>{html.escape(s.text)}</td></tr>'
                       for rank, (v, s) in enumerate(self.ranked(), 1))
        heatmap_js = (resources.files("macs_kernels") / "data" / "heatmap.js").read_text()
        paint = ('document.querySelectorAll("#context span").forEach(s => {'
                 "s.style.background = macsHeatColour(Number(s.dataset.heat)); });")
        return (
            f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{PAGE_STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
            f'<p class="note">{html.escape(AT2_SCORE)}. Colour: the score within the {self.source_type} sources, '
            "white at the lowest, red at the highest; the tooltip gives the score.</p>\n"
            f'<h2>Answer</h2><div class="answer">{html.escape(self.response)}</div>\n'
            f'<h2>Top sources</h2><table class="top">{rows}</table>\n'
            f'<h2>Context ({self.source_type} sources)</h2><div class="prompt" id="context">{"".join(parts)}</div>\n'
            f"<script>\n{heatmap_js}\n{paint}\n</script></body></html>\n"
        )


class AT2Attributor:
    """AT2 on a model: `explain` one generation, `train` coefficients, `save`/`load` them.

    coefficients: a (L, H) tensor, a safetensors path, or None for the packaged default (trained for the
    default model, SmolLM2-135M-Instruct).
    """

    def __init__(self, model, tokenizer, coefficients=None):
        self.model, self.tokenizer = model, tokenizer
        if coefficients is None or isinstance(coefficients, (str, Path)):
            coefficients, self.metadata = load_coefficients(coefficients or DEFAULT_COEFFICIENTS, model)
        else:
            self.metadata = {}
            if tuple(coefficients.shape) != model_shape(model):
                raise ValueError(f"coefficients {tuple(coefficients.shape)} do not match the model's "
                                 f"(layers, heads) = {model_shape(model)}")
        self.theta = coefficients.float().cpu()

    @classmethod
    def load(cls, path, model, tokenizer) -> AT2Attributor:
        return cls(model, tokenizer, Path(path))

    def save(self, path) -> None:
        """Writes theta with its metadata, recording this attributor's model."""
        save_coefficients(path, self.theta, self.metadata | model_record(self.model))

    @classmethod
    def train(cls, model, tokenizer, samples, *, work, **kwargs) -> AT2Attributor:
        from macs_kernels.apps.at2.train import train_coefficients

        theta, metadata = train_coefficients(model, tokenizer, samples, work=work, **kwargs)
        attributor = cls(model, tokenizer, theta)
        attributor.metadata = metadata
        return attributor

    def source_scores(self, token_features: torch.Tensor, index: torch.Tensor, n_sources: int) -> torch.Tensor:
        """Scores (n_sources,) from token features (L*H, n_context) and each token's source."""
        return self.theta.flatten() @ aggregate(token_features.float().cpu(), index, n_sources)

    @torch.no_grad()
    def explain(self, question=None, context=None, *, messages=None, response_ids=None, target=None,
                sources: str = "sentence", max_new_tokens: int = 64, attention: str = "softmax") -> AT2Explanation:
        """Scores of the context's sources for a response.

        The prompt is the QA prompt of (question, context), or `messages` whose last user message ends with
        `context`. Without `response_ids` the model generates greedily (features captured during generation);
        with them, one forward scores that response. target: [start, end) response tokens (default all,
        the end-of-sequence token excluded). attention="efficient" takes the features from efficient rows
        (the coefficients were trained on softmax features).
        """
        from macs_kernels.api.prompts import qa_messages
        from macs_kernels.apps.at2.features import forward_capture
        from macs_kernels.apps.evaluation.alignment import align_context
        from macs_kernels.core.config import AT2_ATTENTIONS

        if attention not in AT2_ATTENTIONS:
            raise ValueError(f"AT2 features take attention in {AT2_ATTENTIONS}, got {attention!r}")
        if messages is None:
            if question is None or context is None:
                raise ValueError("give question and context, or messages and context")
            messages = qa_messages(question, context)
        elif context is None:
            raise ValueError("messages need the context string they contain")
        alignment = align_context(self.tokenizer, messages, context)
        prompt_ids = torch.tensor(alignment.input_ids)
        if response_ids is None:
            capture, response_ids = self._generate(prompt_ids, max_new_tokens)
        else:
            response_ids = torch.as_tensor(response_ids).long().flatten().cpu()
            capture = forward_capture(self.model, prompt_ids, response_ids)
        start, end = target if target is not None else (0, response_ids.numel())
        if not 0 <= start < end <= response_ids.numel():
            raise ValueError(
                f"target [{start}, {end}) must be a non-empty range of the {response_ids.numel()} response tokens"
            )
        features = capture.features(source_start=alignment.context_tokens[0], source_end=alignment.context_tokens[1],
                                    target_start=start, target_end=end, attention=attention)
        chosen = make_sources(alignment, context, sources)
        index = source_index(chosen, alignment.context_tokens)
        scores = self.source_scores(features[0].flatten(0, 1), index, len(chosen))
        from macs_kernels.api.generation import decode_text, decode_tokens

        ids = response_ids.tolist()
        return AT2Explanation(
            prompt_ids=prompt_ids, response_ids=response_ids, response_tokens=decode_tokens(self.tokenizer, ids),
            response=decode_text(self.tokenizer, ids), context=context, target=(start, end),
            source_type=sources, sources=chosen, scores=scores,
        )

    def _generate(self, prompt_ids, max_new_tokens):
        """Greedy generation with the queries captured on the way: (capture, response ids without EOS)."""
        from macs_kernels.api.generation import eos_ids, generation_kwargs
        from macs_kernels.apps.at2.features import QueryCapture
        from macs_kernels.engines.generate import attach

        device = next(self.model.parameters()).device
        ids = prompt_ids.to(device)[None]
        capture = QueryCapture()
        with attach(self.model, hooks=[capture]):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      **generation_kwargs(self.model, self.tokenizer, max_new_tokens, {}))
        response = out[0, ids.shape[1]:].cpu()
        eos = eos_ids(self.model, self.tokenizer)
        length = next((i for i, t in enumerate(response.tolist()) if t in eos), response.numel())
        if length == 0:
            raise ValueError("the model's response is empty (it ended at once): nothing to attribute")
        return capture, response[:length]
