"""Rendering: colour follows the log-domain score within the shown span; the page embeds its data."""
import json
import re

import torch
from rich.console import Console

from macs_kernels.explanation import Explanation
from macs_kernels.viz import _unit, print_explanation


def _explanation():
    log_c = torch.tensor([[0.0, -1.0, -3.0, float("-inf"), -2.0], [0.0, -2.0, -1.0, -4.0, -2.0]])
    return Explanation(
        input_ids=torch.arange(5), generated_ids=torch.tensor([7, 8]), input_tokens=["<s>", "A", "B", "C", "D"],
        generated_tokens=["x", "y"], step_scores=torch.randn(2, 5), step_log_c=log_c, config={}, text="xy",
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
    assert data["heat_mean"] == [1.0, 0.0, 0.0, 0.0]     # mean over steps: [-1.5, -2, -inf, -2]


def test_terminal_heatmap_shows_the_span_and_the_step():
    console = Console(record=True, width=80, color_system="truecolor")
    print_explanation(_explanation(), step=1, console=console)
    page = console.export_html(inline_styles=True, clear=False)
    text = console.export_text()
    assert "Answer: xy" in text and "step 1 ('y')" in text and "ABCD" in text and "<s>" not in text
    assert "#ff0000" in page  # B, the step's highest log consistency, is pure red
