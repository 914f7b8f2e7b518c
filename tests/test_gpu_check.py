"""The GPU check (.ci/gpu) picks its tests by path, -k and -m, and a lent GPU has 15 minutes: a stage whose
selection names no test spends them on nothing and reports success (the kernels preset's tensor-core sanitizer stage
selected `-k "cuda-mma and bfloat16"` while the test ids said `dtype5`). Every pytest run of the script collects
tests here, as the script passes its arguments."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu"
# Options that change how tests run, not which: dropped with their value where they take one.
RUN_OPTIONS = {"-q": 0, "-rfE": 0, "--durations=10": 0, "-p": 1}

_COLLECT = """
import json, sys
import pytest

class Count:
    def pytest_collection_finish(self, session):
        self.items = len(session.items)

counts = []
for args in json.loads(sys.argv[1]):
    count = Count()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[count])
    counts.append(getattr(count, "items", 0) if code in (0, 5) else -int(code))
print(json.dumps(counts))
"""


def _defaults(script: str) -> dict[str, str]:
    """The script's `: "${NAME:=value}"` defaults."""
    return dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', script))


def pytest_invocations() -> list[list[str]]:
    """The arguments of each `python -m pytest` in .ci/gpu that select tests (paths, -k, -m, --ignore), with the
    script's variables at their defaults."""
    script = SCRIPT.read_text()
    defaults = _defaults(script)
    invocations = []
    for line in script.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#") or "-m pytest" not in line:
            continue
        tail = re.split(r"\s\|\|?\s", line.split("-m pytest", 1)[1])[0]
        tail = re.sub(r'"\$(\w+)"', lambda match: shlex.quote(defaults[match.group(1)]), tail)
        words, selection = shlex.split(tail.replace('"${options[@]}"', "")), []
        while words:
            word = words.pop(0)
            if word in RUN_OPTIONS:
                del words[:RUN_OPTIONS[word]]
            else:
                selection.append(word)
        invocations.append(selection)
    return invocations


def test_the_script_runs_pytest_in_every_test_stage():
    invocations = pytest_invocations()
    assert len(invocations) >= 8, invocations
    assert ["tests/ops/test_out_of_range_values.py", "tests/ops/test_split_passes_exact.py", "-k",
            "(test_out_of_range_values and cuda) or (cuda-bfloat16 and (d64 or d128))"] in invocations


def _or_clauses(expression: str) -> list[str]:
    """The top-level `or` clauses of a -k expression."""
    clauses, depth, start = [], 0, 0
    for at, char in enumerate(expression):
        depth += (char == "(") - (char == ")")
        if depth == 0 and expression.startswith(" or ", at):
            clauses.append(expression[start:at].strip())
            start = at + len(" or ")
    return [*clauses, expression[start:].strip()]


def _parts(invocation: list[str]) -> list[list[str]]:
    """Selections that must each collect tests for an invocation that merges several: each path with every other
    option, and all the paths with each top-level `or` clause of its -k expression (a part that matches nothing is a
    stage part that runs nothing while the others keep the count above zero)."""
    paths = [word for index, word in enumerate(invocation)
             if word.startswith("tests/") and (index == 0 or invocation[index - 1] not in ("--ignore", "-k", "-m"))]
    options = [word for word in invocation if word not in paths]
    parts = [[path, *options] for path in paths] if len(paths) > 1 else []
    if "-k" in invocation:
        at = options.index("-k")
        clauses = _or_clauses(options[at + 1])
        if len(clauses) > 1:
            parts += [[*paths, *options[:at], "-k", clause, *options[at + 2:]] for clause in clauses]
    return parts


def test_or_clauses_split_at_the_top_level_only():
    assert _or_clauses("(a and b) or (c or d) or e") == ["(a and b)", "(c or d)", "e"]
    assert _or_clauses("not x") == ["not x"]


def test_every_pytest_run_of_the_gpu_check_selects_tests():
    invocations = pytest_invocations()
    selections = invocations + [part for invocation in invocations for part in _parts(invocation)]
    collected = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps(selections)], cwd=ROOT,
                               capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0, collected.stderr[-3000:]
    counts = json.loads(collected.stdout.strip().splitlines()[-1])
    assert len(selections) > len(invocations)  # the merged runs are checked part by part
    empty = [" ".join(args) for args, count in zip(selections, counts) if count <= 0]
    assert not empty, f"selections of .ci/gpu that collect no test (or fail to collect): {empty}"


def test_a_failure_is_printed_when_it_happens(tmp_path):
    """MACS_KERNELS_EARLY_FAILURES=1 (the script exports it) prints each failure's traceback before the run's own
    summary, with and without xdist's workers, so that a stage killed before its summary still names its failures."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_logreport  # noqa: F401\n")
    (tmp_path / "test_planted.py").write_text(
        "def test_planted():\n    assert 1 + 1 == 3, 'planted failure'\n\ndef test_passes():\n    pass\n")
    env = dict(__import__("os").environ, MACS_KERNELS_EARLY_FAILURES="1", PYTHONPATH=str(ROOT))
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own worker, where one runs it
    runs = [[]]
    if subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode == 0:
        runs.append(["-n", "2"])
    for extra in runs:
        done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *extra, str(tmp_path)],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        output = done.stdout
        assert done.returncode == 1, output
        early = output.index("--- failed: test_planted.py::test_planted (call)")
        assert "planted failure" in output[early:output.index("---\n", early + 4)]
        assert early < output.index("= FAILURES =") and output.count("--- failed:") == 1, output
        if not extra:  # in order: before the next test's result line (xdist's workers finish in any order)
            assert early < output.index("test_planted.py::test_passes PASSED"), output
