"""Rendering: colour and top tokens follow the Explanation's scores (which rank as log c does) within the
shown span; the page embeds its data."""
import json
import re

import pytest
import torch
from rich.console import Console

from macs_kernels.api.explanation import DEFAULT_AGGREGATION, Explanation
from macs_kernels.api.viz import _unit, print_explanation


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
    assert data["heat"][1] == [0.667, 1.0, 0.0, 0.667]  # step 1: B highest, C lowest (3 decimals: 256 colours)
    # whole answer (max z - mean z over the steps, each step's z standardised without its top token, "<s>":
    # [0.498, 1.186, -inf, 0.115] over A..D; plus the best run of 2 steps minus the mean, the runs (step 0 token i,
    # step 1 token i + 1) worth [0.229, 1.147, -1.606, -1.225] from <s>, C's -inf counted as step 0's lowest
    # finite z): [0.918, 2.372, -inf, -1.225]
    assert data["heat_mean"] == [0.596, 1.0, 0.0, 0.0]
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


def _long_explanation(n: int = 3000, steps: int = 64, seed: int = 0) -> Explanation:
    """A chat-like prompt of n tokens whose user text is [3, n - 2): random rows, made-up words."""
    generator = torch.Generator().manual_seed(seed)
    log_c = -torch.rand(steps, n, generator=generator) * 20
    words = [" " + "abcdefgh"[i % 8] * (1 + i % 5) for i in range(n)]
    words[n // 6] = " para\n"
    return Explanation(
        input_ids=torch.arange(n), generated_ids=torch.arange(steps), input_tokens=words,
        generated_tokens=[f" g{k}" for k in range(steps)], step_log_c=log_c, config={}, text="the answer",
        source_span=(3, n - 2),
    )


def test_a_long_prompt_is_summarised_by_its_top_tokens_in_context():
    explanation = _long_explanation()
    console = Console(record=True, width=60)
    print_explanation(explanation, console=console)
    lines = console.export_text().splitlines()
    assert len(lines) < 20
    best = explanation.top_k(5)
    text = "\n".join(lines)
    assert "2995 tokens would fill" in text and "--full" in text and "--html" in text
    ranked = [line for line in lines if re.match(r" *\d\. ", line)]
    assert lines[-5:] == ranked  # one line each, however long the neighbourhood
    for rank, ((index, token, score), line) in enumerate(zip(best, ranked), 1):
        assert line.startswith(f"{rank:>2}. {token!r} {score:+.2f}  ")
        # the neighbourhood: the token with the tokens around it, in prompt order
        start = max(3, index - 6)
        assert "".join(explanation.input_tokens[start:index + 1]).replace("\n", "⏎") in line
    full = Console(record=True, width=60)
    print_explanation(explanation, console=full, full=True)
    assert len(full.export_text().splitlines()) > 100


def test_terminal_lines_break_between_tokens_only():
    explanation = _long_explanation(n=300, steps=2)
    console = Console(record=True, width=37)
    print_explanation(explanation, console=console, full=True, top=0)
    lines = console.export_text().splitlines()
    heatmap = lines[next(i for i, line in enumerate(lines) if line.endswith("highest):")) + 1:]
    tokens = explanation.input_tokens[3:298]
    assert all(len(line) <= 37 for line in heatmap)
    # Walk the tokens through the lines: each line ends where a token (or a token's newline) ends.
    joined, boundaries, at = "", set(), 0
    for token in tokens:
        for k, piece in enumerate(token.split("\n")):
            if k:
                boundaries.add(at)
            at += len(piece)
            joined += piece
        boundaries.add(at)
    assert "".join(heatmap) == joined
    ends = [sum(len(line) for line in heatmap[:i + 1]) for i in range(len(heatmap))]
    assert set(ends) <= boundaries


def test_files_hold_each_number_once_at_its_precision(tmp_path):
    """The JSON and the page of a 3000-token prompt with 64 steps: step_log_c to float32's 7 significant digits,
    z-scores to 4 decimals, heat to 3, nothing derived twice; a few bytes per (step, token)."""
    import argparse

    from macs_kernels.apps.cli.common import write_outputs

    explanation = _long_explanation()
    args = argparse.Namespace(json=tmp_path / "e.json", html=tmp_path / "e.html")
    write_outputs(args, explanation)
    cells = explanation.step_log_c.numel()
    assert args.json.stat().st_size < 24 * cells  # was 73 bytes per cell (float64 digits, a line per number)
    assert args.html.stat().st_size < 16 * cells
    data = json.loads(args.json.read_text())
    torch.testing.assert_close(torch.tensor(data["step_log_c"]), explanation.step_log_c, rtol=6e-7, atol=0)
    torch.testing.assert_close(torch.tensor(data["step_scores"]), explanation.step_scores, rtol=0, atol=6e-5)
    assert "paper_step_scores" not in data and "paper_scores" not in data
    assert [t["index"] for t in data["top_tokens"]] == [i for i, _, _ in explanation.top_k(10)]


def test_the_page_lists_the_top_tokens_of_each_view():
    explanation = _explanation()
    page = explanation.to_html()
    data = json.loads(re.search(r"const data = (\{.*?\});\n", page).group(1))
    assert data["top"] == [i for i, _, _ in explanation.top_k(10)]
    assert data["step_top"] == [[i for i, _, _ in explanation.top_k(10, step=k)] for k in range(2)]
    assert '<table class="top" id="top">' in page and '"Top tokens: " + label' in page


def test_at2_speaks_as_macs_does():
    """AT2's terminal output and page use MACS's words and look: an answer, labelled scores, one style."""
    from macs_kernels.api.viz import PAGE_STYLE, print_sources
    from macs_kernels.apps.at2.attributor import AT2_SCORE, AT2Explanation
    from macs_kernels.apps.at2.sources import Source

    context = "Paris is in France. It is big."
    result = AT2Explanation(
        prompt_ids=torch.arange(12), response_ids=torch.tensor([5, 6]), response_tokens=[" Paris", "."],
        response="Paris.", context=context, target=(0, 2), source_type="sentence",
        sources=[Source("Paris is in France.", (0, 19), (4, 9)), Source("It is big.", (20, 30), (9, 12))],
        scores=torch.tensor([0.25, -0.5]),
    )
    console = Console(record=True, width=200)
    print_sources(result, console=console)
    assert console.export_text().splitlines() == [
        "Answer: Paris.", "AT2 attribution (sentence sources of the context):",
        f"Top sources (score = {AT2_SCORE}):", " 1. +0.2500  'Paris is in France.'", " 2. -0.5000  'It is big.'"]
    page = result.to_html()
    assert PAGE_STYLE in page and "<h2>Answer</h2>" in page and "<h2>Top sources</h2>" in page
    assert "function macsHeatColour" in page and 'data-heat="1.000"' in page and 'data-heat="0.000"' in page
    assert "response" not in page.lower()
    macs = _explanation().to_html()
    assert PAGE_STYLE in macs and "<h2>Answer</h2>" in macs
