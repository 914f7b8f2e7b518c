"""Rendering: a colour heatmap of the prompt in the terminal (rich) and a self-contained HTML page."""
from __future__ import annotations

import html
import json
from importlib import resources

import torch


def _unit(values: torch.Tensor) -> list[float]:
    """Values mapped to [0, 1] between their finite minimum and maximum (-inf, an underflowed log, is 0).

    Colour follows the log-domain score, not the z-score: z of exp(log c) is dominated by the attention
    sink (the first token), so inside a context every z is a tie just below 0.
    """
    values = values.double()
    finite = torch.isfinite(values)
    if not finite.any():
        return [0.0] * values.numel()
    low, high = values[finite].min(), values[finite].max()
    if high <= low:
        return [0.0] * values.numel()
    return torch.where(finite, (values - low) / (high - low), torch.zeros_like(values)).tolist()


def _step_log_c(explanation, step: int | None) -> torch.Tensor:
    """The log-domain row of `step`, or the mean over steps (-inf where any step underflowed)."""
    return explanation.step_log_c.mean(dim=0) if step is None else explanation.step_log_c[step]


def heatmap_text(tokens: list[str], scores: torch.Tensor, span: tuple[int, int] | None = None):
    """A rich Text of the tokens in `span`, from white (the span's lowest score) to red (its highest)."""
    from rich.text import Text

    start, end = span if span else (0, len(tokens))
    text = Text()
    for token, weight in zip(tokens[start:end], _unit(scores[start:end])):
        fade = int(255 * (1.0 - weight))
        text.append(token, style=f"black on rgb(255,{fade},{fade})")
    return text


def print_explanation(explanation, *, step: int | None = None, span=None, console=None) -> None:
    """Prints the answer and the heatmap of the prompt for `step` (default: the mean over steps)."""
    from rich.console import Console

    console = console or Console()
    if step is not None and not -len(explanation.generated_ids) <= step < len(explanation.generated_ids):
        raise ValueError(f"step {step} is out of range: {len(explanation.generated_ids)} tokens were generated")
    scores = _step_log_c(explanation, step)
    what = "mean over steps" if step is None else f"step {step} ({explanation.generated_tokens[step]!r})"
    console.print(f"[bold]Answer:[/bold] {explanation.text}")
    console.print(f"[bold]MACS attribution[/bold] ({what}; colour: log consistency, lowest to highest):")
    console.print(heatmap_text(explanation.input_tokens, scores, span or explanation.source_span))


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
page shows the mean over all steps. Colour: MACS log consistency within the shown tokens, white at the
lowest, red at the highest; the tooltip gives the z-score.</p>
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
    cells[i].style.background = macsHeatColour(w); cells[i].title = "z = " + z[data.span[0] + i].toFixed(3); }});
  caption.textContent = "Prompt: " + label;
}}
let pinned = null;
data.generated_tokens.forEach((tok, k) => {{
  const s = document.createElement("span"); s.textContent = tok; answer.appendChild(s);
  s.addEventListener("mouseenter", () => {{ if (pinned === null) paint(k, `step ${{k}} (${{JSON.stringify(tok)}})`); }});
  s.addEventListener("mouseleave", () => {{ if (pinned === null) paint(null, "mean over steps"); }});
  s.addEventListener("click", () => {{
    answer.querySelectorAll("span").forEach(x => x.classList.remove("active"));
    if (pinned === k) {{ pinned = null; paint(null, "mean over steps"); return; }}
    pinned = k; s.classList.add("active"); paint(k, `step ${{k}} (${{JSON.stringify(tok)}}), pinned`);
  }});
}});
paint(null, "mean over steps");
</script></body></html>
"""


def explanation_html(explanation, *, title: str = "MACS attribution") -> str:
    """The page for one Explanation; the JSON payload is embedded, so the file stands alone."""
    span = explanation.source_span or (0, len(explanation.input_tokens))
    data = {
        "input_tokens": explanation.input_tokens,
        "generated_tokens": explanation.generated_tokens,
        "step_scores": [[round(v, 4) for v in row] for row in explanation.step_scores.tolist()],
        "scores": [round(v, 4) for v in explanation.scores.tolist()],
        "span": list(span),
        "heat": [[round(w, 4) for w in _unit(row[span[0]:span[1]])] for row in explanation.step_log_c],
        "heat_mean": [round(w, 4) for w in _unit(_step_log_c(explanation, None)[span[0]:span[1]])],
    }
    # "</" inside a token would end the script element early.
    payload = json.dumps(data).replace("</", "<\\/")
    heatmap_js = (resources.files("macs_kernels") / "data" / "heatmap.js").read_text()
    return _PAGE.format(title=html.escape(title), data=payload, heatmap_js=heatmap_js)
