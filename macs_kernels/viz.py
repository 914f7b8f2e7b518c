"""Rendering: a colour heatmap of the prompt in the terminal (rich) and a self-contained HTML page.

Both colour and list the Explanation's own scores (step_scores / scores: z-scores of log c, which rank as
log c does), so what the terminal, the page, the JSON and top_k show is one definition.
"""
from __future__ import annotations

import html
import json
from importlib import resources

import torch

from .core import json_values


def _unit(values: torch.Tensor) -> list[float]:
    """Values mapped to [0, 1] between their finite minimum and maximum (-inf, an underflowed log, is 0).

    Scaled within the shown tokens: the attention sink, far above the rest, would otherwise leave every
    other token white.
    """
    values = values.double()
    finite = torch.isfinite(values)
    if not finite.any():
        return [0.0] * values.numel()
    low, high = values[finite].min(), values[finite].max()
    if high <= low:
        return [0.0] * values.numel()
    return torch.where(finite, (values - low) / (high - low), torch.zeros_like(values)).tolist()


def _shown_span(explanation, span=None) -> tuple[int, int]:
    """[start, end) of `span` (Explanation.top_k's forms); by default the source span, else the prompt."""
    if span is None and explanation.source_span:
        span = True
    return explanation.span_range(span)


def heatmap_text(tokens: list[str], scores: torch.Tensor, span: tuple[int, int] | None = None):
    """A rich Text of the tokens in `span`, from white (the span's lowest score) to red (its highest)."""
    from rich.text import Text

    start, end = span if span else (0, len(tokens))
    text = Text()
    for token, weight in zip(tokens[start:end], _unit(scores[start:end])):
        fade = int(255 * (1.0 - weight))
        text.append(token, style=f"black on rgb(255,{fade},{fade})")
    return text


def print_explanation(explanation, *, step: int | None = None, span=None, top: int = 5, console=None,
                      how: str | None = None) -> None:
    """Prints the answer, the heatmap of the prompt for `step` (default: the whole answer, Explanation.scores,
    or the aggregation named `how`) and its `top` highest-scoring tokens. span: as Explanation.top_k's
    (default: the source_span when there is one)."""
    from rich.console import Console

    from .config import DEFAULT_AGGREGATION

    console = console or Console()
    scores = explanation.score_row(step, how)
    shown = _shown_span(explanation, span)
    what = (f"whole answer, {how or DEFAULT_AGGREGATION}" if step is None
            else f"step {step} ({explanation.generated_tokens[step]!r})")
    console.print(f"[bold]Answer:[/bold] {explanation.text}")
    console.print(f"[bold]MACS attribution[/bold] ({what}; colour: score, lowest to highest):")
    console.print(heatmap_text(explanation.input_tokens, scores, shown))
    if top:
        best = explanation.top_k(top, step=step, span=shown, how=how)
        score = "z-score of log consistency" if step is not None else f"whole answer, {how or DEFAULT_AGGREGATION}"
        console.print(f"[bold]Top tokens[/bold] (score = {score}): "
                      + ", ".join(f"{token!r} {score:+.2f}" for _, token, score in best), highlight=False)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }}
.prompt span, .answer span {{ white-space: pre-wrap; border-radius: 2px; }}
.answer span {{ cursor: pointer; padding: 0 1px; border-bottom: 2px solid #ccc; }}
.answer span.active {{ border-bottom-color: #c00; background: #fee; }}
.prompt {{ line-height: 1.7; border: 1px solid #ddd; padding: 1em; }}
.note {{ color: #666; font-size: 0.9em; }}
</style></head><body>
<h1>{title}</h1>
<p class="note">Hover or click a generated token to see what it attended to; away from the answer, the
page shows the whole-answer score (Explanation.scores). Colour: the MACS score within the shown tokens,
white at the lowest, red at the highest; the tooltip gives the score (the z-score of log consistency, which ranks as log
consistency does).</p>
<h2>Answer</h2><div class="answer" id="answer"></div>
<h2 id="caption">Prompt</h2><div class="prompt" id="prompt"></div>
<script>
{heatmap_js}
const data = {data};
const prompt = document.getElementById("prompt"), answer = document.getElementById("answer");
const caption = document.getElementById("caption");
const cells = data.input_tokens.slice(data.span[0], data.span[1]).map(tok => {{
  const s = document.createElement("span"); s.textContent = tok; prompt.appendChild(s); return s; }});
function paint(k, label) {{
  const heat = k === null ? data.heat_mean : data.heat[k], z = k === null ? data.scores : data.step_scores[k];
  heat.forEach((w, i) => {{
    const score = z[data.span[0] + i];
    cells[i].style.background = macsHeatColour(w);
    cells[i].title = "score = " + (score === null ? "-inf (underflow)" : score.toFixed(3)); }});
  caption.textContent = "Prompt: " + label;
}}
let pinned = null;
data.generated_tokens.forEach((tok, k) => {{
  const s = document.createElement("span"); s.textContent = tok; answer.appendChild(s);
  s.addEventListener("mouseenter", () => {{
    if (pinned === null) paint(k, `step ${{k}} (${{JSON.stringify(tok)}})`);
  }});
  s.addEventListener("mouseleave", () => {{ if (pinned === null) paint(null, "whole answer"); }});
  s.addEventListener("click", () => {{
    answer.querySelectorAll("span").forEach(x => x.classList.remove("active"));
    if (pinned === k) {{ pinned = null; paint(null, "whole answer"); return; }}
    pinned = k; s.classList.add("active"); paint(k, `step ${{k}} (${{JSON.stringify(tok)}}), pinned`);
  }});
}});
paint(null, "whole answer");
</script></body></html>
"""


def explanation_html(explanation, *, title: str = "MACS attribution") -> str:
    """The page for one Explanation; the JSON payload is embedded, so the file stands alone."""
    start, end = _shown_span(explanation)
    step_scores, scores = explanation.step_scores, explanation.scores
    data = {
        "input_tokens": explanation.input_tokens,
        "generated_tokens": explanation.generated_tokens,
        "step_scores": json_values(step_scores, 4),
        "scores": json_values(scores, 4),
        "span": [start, end],
        "heat": [[round(w, 4) for w in _unit(row[start:end])] for row in step_scores],
        "heat_mean": [round(w, 4) for w in _unit(scores[start:end])],
    }
    # "</" inside a token would end the script element early.
    payload = json.dumps(data).replace("</", "<\\/")
    heatmap_js = (resources.files("macs_kernels") / "data" / "heatmap.js").read_text()
    return _PAGE.format(title=html.escape(title), data=payload, heatmap_js=heatmap_js)
