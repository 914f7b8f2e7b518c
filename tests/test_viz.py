"""Rendering: colour and top tokens follow the Explanation's scores (which rank as log c does) within the
shown span; the page embeds its data."""
import json
import re

import pytest
import torch
from rich.console import Console

from macs_kernels.explanation import DEFAULT_AGGREGATION, Explanation
from macs_kernels.viz import _unit, print_explanation


def _explanation():
    log_c = torch.tensor([[0.0, -1.0, -3.0, float("-inf"), -2.0], [0.0, -2.0, -1.0, -4.0, -2.0]])
    return Explanation(
        input_ids=torch.arange(5), generated_ids=torch.tensor([7, 8]), input_tokens=["<s>", "A", "B", "C", "D"],
        generated_tokens=["x", "y"], step_log_c=log_c, config={}, text="xy",
        source_span=(1, 5),
    )


def test_unit_scaling_ignores_underflow_and_spans_zero_to_one():
    assert _unit(torch.tensor([-1.0, -3.0, float("-inf"), -2.0])) == [1.0, 0.0, 0.0, 0.5]
    assert _unit(torch.tensor([2.0, 2.0])) == [0.0, 0.0]


def test_html_heat_is_per_step_within_the_span():
    page = _explanation().to_html()
    data = json.loads(re.search(r"const data = (\{.*?\});\n", page).group(1))
    assert data["span"] == [1, 5]
    assert data["heat"][0] == [1.0, 0.0, 0.0, 0.5]       # step 0 over tokens A..D
    assert data["heat"][1] == [0.6667, 1.0, 0.0, 0.6667]  # step 1: B highest, C lowest
    # whole answer (max z - mean z over the steps, each step's z standardised without its top token, "<s>":
    # [0.498, 1.186, -inf, 0.115] over A..D; plus the best run of 2 steps minus the mean, the runs (step 0 token i,
    # step 1 token i + 1) worth [0.229, 1.147, -1.606, -1.225] from <s>, C's -inf counted as step 0's lowest
    # finite z): [0.918, 2.372, -inf, -1.225]
    assert data["heat_mean"] == [0.5957, 1.0, 0.0, 0.0]
    explanation = _explanation()
    assert data["scores"][3] is None and data["scores"][1] == round(float(explanation.scores[1]), 4)
    assert data["step_scores"][0][3] is None  # -inf: JSON has no infinities; the tooltip says underflow
    assert "-inf (underflow)" in page


def test_terminal_heatmap_shows_the_span_and_the_step():
    console = Console(record=True, width=80, color_system="truecolor")
    print_explanation(_explanation(), step=1, console=console)
    page = console.export_html(inline_styles=True, clear=False)
    text = console.export_text()
    assert "Answer: xy" in text and "step 1 ('y')" in text and "ABCD" in text and "<s>" not in text
    assert "#ff0000" in page  # B, the step's highest log consistency, is pure red
    # The top tokens of the span, by the same scores as top_k: B, then A and D (equal: prompt order), C.
    scores = _explanation().step_scores[1]
    assert f"Top tokens (score = z-score of log consistency): 'B' {scores[2]:+.2f}, 'A' {scores[1]:+.2f}, " \
           f"'D' {scores[4]:+.2f}, 'C' {scores[3]:+.2f}" in " ".join(text.split())


@pytest.mark.parametrize("how", [None, "mean_log_c"])
def test_terminal_whole_answer_view_names_its_aggregation(how):
    console = Console(record=True, width=200)
    print_explanation(_explanation(), console=console, how=how)
    text = " ".join(console.export_text().split())
    name = how or DEFAULT_AGGREGATION
    scores = _explanation().whole_answer(name)
    best = [i for i, _, _ in _explanation().top_k(4, span=True, how=how)]
    assert f"(whole answer, {name}; colour" in text
    tokens = _explanation().input_tokens
    assert f"Top tokens (score = whole answer, {name}): {tokens[best[0]]!r} {scores[best[0]]:+.2f}," in text


def test_terminal_output_refuses_a_step_out_of_range():
    with pytest.raises(ValueError, match="step 2 is out of range: 2 tokens were generated"):
        print_explanation(_explanation(), step=2, console=Console(record=True))
