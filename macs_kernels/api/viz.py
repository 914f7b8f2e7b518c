"""Rendering: a colour heatmap of the prompt in the terminal (rich) and a self-contained HTML page.

Both colour and list the Explanation's own scores (step_scores / scores: z-scores of log c, which rank as
log c does), so what the terminal, the page, the JSON and top_k show is one definition.
"""
from __future__ import annotations

import html
import json
from importlib import resources

import torch

from macs_kernels.core.scores import SCORE_DIGITS, TOP_TOKENS, json_values


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


# A heatmap longer than this many terminal lines is summarised: the top tokens in their neighbourhoods.
MAX_HEATMAP_LINES = 24
NEIGHBOURHOOD = 6  # tokens shown on each side of a top token in a summary


def _heat_style(weight: float, extra: str = "") -> str:
    """The terminal style of a heat weight in [0, 1]: heatmap.js's colour, white to red."""
    fade = int(255 * (1.0 - weight))
    return f"black on rgb(255,{fade},{fade}){extra}"


def heatmap_lines(tokens: list[str], weights: list[float], width: int) -> list:
    """The tokens as rich Text lines of at most `width` cells, each token on one line: lines break between
    tokens (or at a token's own newline), never inside one (a token wider than a line gets a line of its own).
    weights: each token's heat in [0, 1] (_unit), white to red."""
    from rich.cells import cell_len
    from rich.text import Text

    lines, line, used = [], Text(), 0
    for token, weight in zip(tokens, weights):
        style = _heat_style(weight)
        pieces = token.split("\n")
        for k, piece in enumerate(pieces):
            if k:  # the token's newline ends the line
                lines.append(line)
                line, used = Text(), 0
            size = cell_len(piece)
            if used and used + size > width:
                lines.append(line)
                line, used = Text(), 0
            line.append(piece, style=style)
            used += size
    lines.append(line)
    return lines


def _neighbourhood(tokens: list[str], weights: list[float], at: int):
    """A rich Text of token `at` (bold, underlined) with NEIGHBOURHOOD tokens each side, coloured by their
    weights; newlines shown as ⏎."""
    from rich.text import Text

    first, last = max(0, at - NEIGHBOURHOOD), min(len(tokens), at + NEIGHBOURHOOD + 1)
    text = Text("…" if first > 0 else "")
    for i in range(first, last):
        text.append(tokens[i].replace("\n", "⏎"), style=_heat_style(weights[i], " bold underline" * (i == at)))
    text.append("…" if last < len(tokens) else "")
    return text


def print_explanation(explanation, *, step: int | None = None, span=None, top: int = 5, console=None,
                      how: str | None = None, full: bool = False) -> None:
    """Prints the answer, the heatmap of the prompt for `step` (default: the whole answer, Explanation.scores,
    or the aggregation named `how`) and its `top` highest-scoring tokens. span: as Explanation.top_k's
    (default: the source_span when there is one). A heatmap longer than MAX_HEATMAP_LINES is summarised as
    the top tokens, each in its neighbourhood, unless `full`."""
    from rich.console import Console
    from rich.markup import escape
    from rich.text import Text

    from macs_kernels.core.scores import DEFAULT_AGGREGATION

    console = console or Console()
    scores = explanation.score_row(step, how)
    start, end = explanation.span_range(span)
    tokens, weights = explanation.input_tokens[start:end], _unit(scores[start:end])
    what = (f"whole answer, {how or DEFAULT_AGGREGATION}" if step is None
            else f"step {step} ({explanation.generated_tokens[step]!r})")
    score_name = "z-score of log consistency" if step is not None else f"whole answer, {how or DEFAULT_AGGREGATION}"
    best = explanation.top_k(top, step=step, span=(start, end), how=how) if top else []
    console.print(f"[bold]Answer:[/bold] {escape(explanation.text)}", highlight=False)
    console.print(f"[bold]MACS attribution[/bold] ({escape(what)}; colour: score, lowest to highest):", highlight=False)
    lines = heatmap_lines(tokens, weights, console.width)
    if full or len(lines) <= MAX_HEATMAP_LINES or not best:
        for line in lines:
            console.print(line, overflow="fold", no_wrap=True, highlight=False)
        if best:
            console.print(f"[bold]Top tokens[/bold] (score = {score_name}): "
                          + escape(", ".join(f"{token!r} {value:+.2f}" for _, token, value in best)), highlight=False)
        return
    console.print(f"{end - start} tokens would fill {len(lines)} lines: the top {len(best)}, each in its "
                  "neighbourhood, follow (the whole heatmap: --full, print_explanation(full=True), or the page of "
                  "--html FILE / Explanation.to_html())", highlight=False)
    console.print(f"[bold]Top tokens[/bold] (score = {score_name}):", highlight=False)
    for rank, (index, token, value) in enumerate(best, 1):
        line = Text(f"{rank:>2}. {token!r} {value:+.2f}  ")
        line.append_text(_neighbourhood(tokens, weights, index - start))
        console.print(line, highlight=False, no_wrap=True, overflow="ellipsis")  # one line each, never a split token


def print_sources(explanation, *, top: int = 10, console=None) -> None:
    """Prints an AT2Explanation as print_explanation prints MACS's: the answer, then its `top` sources by
    score, each labelled with its score."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    console.print(f"[bold]Answer:[/bold] {escape(explanation.response)}", highlight=False)
    console.print(f"[bold]AT2 attribution[/bold] ({escape(explanation.source_type)} sources of the context):",
                  highlight=False)
    console.print(f"[bold]Top sources[/bold] (score = {escape(explanation.score_definition)}):", highlight=False)
    for rank, (score, source) in enumerate(explanation.ranked()[:top], 1):
        text = source.text if len(source.text) <= 100 else source.text[:99] + "…"
        console.print(f"{rank:>2}. {score:+.4f}  {escape(repr(text))}", highlight=False)


# The pages' look, shared by Explanation.to_html() and AT2Explanation.to_html().
PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }
.prompt span, .answer span { white-space: pre-wrap; border-radius: 2px; }
.answer span { cursor: pointer; padding: 0 1px; border-bottom: 2px solid #ccc; }
.answer span.active { border-bottom-color: #c00; background: #fee; }
.prompt { line-height: 1.7; border: 1px solid #ddd; padding: 1em; }
.note { color: #666; font-size: 0.9em; }
.top { border-collapse: collapse; } .top td { padding: 1px 8px; vertical-align: top; }
.top td.score { text-align: right; font-variant-numeric: tabular-nums; }
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head><body>
<h1>{title}</h1>
<p class="note">Hover or click a generated token to see what it attended to; away from the answer, the
page shows the whole-answer score (Explanation.scores). Colour: the MACS score within the shown tokens,
white at the lowest, red at the highest; the tooltip gives the score (the z-score of log consistency, which ranks as log
consistency does).</p>
<h2>Answer</h2><div class="answer" id="answer"></div>
<h2 id="top-caption">Top tokens</h2><table class="top" id="top"></table>
<h2 id="caption">Prompt</h2><div class="prompt" id="prompt"></div>
<script>
{heatmap_js}
const data = {data};
const prompt = document.getElementById("prompt"), answer = document.getElementById("answer");
const caption = document.getElementById("caption"), top = document.getElementById("top");
const topCaption = document.getElementById("top-caption");
const cells = data.input_tokens.slice(data.span[0], data.span[1]).map(tok => {{
  const s = document.createElement("span"); s.textContent = tok; prompt.appendChild(s); return s; }});
const shown = score => score === null ? "-inf (underflow)" : score.toFixed(3);
function paint(k, label) {{
  const heat = k === null ? data.heat_mean : data.heat[k], z = k === null ? data.scores : data.step_scores[k];
  heat.forEach((w, i) => {{
    const score = z[data.span[0] + i];
    cells[i].style.background = macsHeatColour(w);
    cells[i].title = "score = " + shown(score); }});
  caption.textContent = "Prompt: " + label;
  topCaption.textContent = "Top tokens: " + label;
  top.textContent = "";
  (k === null ? data.top : data.step_top[k]).forEach((i, rank) => {{
    const row = top.insertRow();
    row.insertCell().textContent = rank + 1;
    row.insertCell().textContent = JSON.stringify(data.input_tokens[i]);
    const cell = row.insertCell(); cell.className = "score"; cell.textContent = shown(z[i]);
    row.insertCell().textContent = "token " + i; }});
}}
macsAnswerTokens(data.generated_tokens, answer, paint);
</script></body></html>
"""
HEAT_DIGITS = 3  # a heat weight picks one of 256 colours


def page_script(data: dict) -> str:
    """`data` as a JavaScript literal safe inside a script element ("</" in a token would end it early)."""
    return json.dumps(data).replace("</", "<\\/")


def explanation_html(explanation, *, title: str = "MACS attribution") -> str:
    """The page for one Explanation; the JSON payload is embedded, so the file stands alone. It holds each
    number once at the precision it shows: the scores to SCORE_DIGITS decimals, the heat to HEAT_DIGITS."""
    start, end = explanation.span_range()
    step_scores, scores = explanation.step_scores, explanation.scores
    data = {
        "input_tokens": explanation.input_tokens,
        "generated_tokens": explanation.generated_tokens,
        "step_scores": json_values(step_scores, SCORE_DIGITS),
        "scores": json_values(scores, SCORE_DIGITS),
        "span": [start, end],
        "heat": [[round(w, HEAT_DIGITS) for w in _unit(row[start:end])] for row in step_scores],
        "heat_mean": [round(w, HEAT_DIGITS) for w in _unit(scores[start:end])],
        "top": [i for i, _, _ in explanation.top_k(TOP_TOKENS)],
        "step_top": [[i for i, _, _ in explanation.top_k(TOP_TOKENS, step=k)] for k in range(len(step_scores))],
    }
    heatmap_js = (resources.files("macs_kernels") / "data" / "heatmap.js").read_text()
    return _PAGE.format(title=html.escape(title), style=PAGE_STYLE, data=page_script(data), heatmap_js=heatmap_js)
