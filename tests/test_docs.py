"""Every code block of README.md and docs/*.md runs here, so that an example never fails when pasted.

A fence names its language, then tags that say how its block is checked; a block no rule covers fails
`test_every_block_has_a_rule`:

- ```python: run in a fresh interpreter; ```python continued: after the previous python block of its page, in
  the same interpreter (one model load for a page's examples).
- ```bash: `macs-kernels` commands, run in an empty folder.
- ```output: what the block before it prints, compared token by token with every number masked (the figures are
  the model's and the machine's; the words, tokens and their order are the example's).
- ```bash parse: `macs-kernels` commands of hours (an evaluation, a training run): the command's own parser must
  accept every flag and value.
- ```bash ci: lines that `.ci/run` runs as they are; every command of `.ci/run` is in some such block.
- ```bash server: `macs-kernels serve`, started (on a free port) for the page's ```python server blocks, which
  talk to it.
- ```python gpu: needs a CUDA device (`test_gpu_block`; skipped without one).
- ```python vllm, ```bash vllm: vLLM's; they run in vLLM's venv (`test_vllm_block`, which `.ci/run` runs there):
  the Python example runs, the commands' flags are checked against vLLM's `--help`.
- ```text: a figure (a diagram); nothing to run.
- `slow` after the tags: the block's test runs under `-m slow` only.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import skip_where_continuous_batching_is_refused

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
CI_SCRIPT = ROOT / ".ci" / "run"
TIMEOUT_S = 600
SERVER_ADDRESS = "127.0.0.1:8000"  # where the documented server listens; the tests move it to a free port
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's line, 1-based
    language: str
    tags: frozenset
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> tuple[str, frozenset]:
        return self.language, self.tags - {"slow"}


FENCE = re.compile(r"^(\s*)```(.*)$")


def read_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, start = [], None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if not fence:
            continue
        if start is None:
            start, indent, words = number, len(fence.group(1)), fence.group(2).split()
        else:
            body = "".join(text[indent:] + "\n" for text in lines[start:number - 1])
            blocks.append(Block(page, start, words[0] if words else "", frozenset(words[1:]), body))
            start = None
    if start is not None:
        raise ValueError(f"{page.name}:{start}: a code block is never closed")
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
PYTHON, CONTINUED = ("python", frozenset()), ("python", frozenset({"continued"}))
RUN, OUTPUT, PARSE, CI = (("bash", frozenset()), ("output", frozenset()), ("bash", frozenset({"parse"})),
                          ("bash", frozenset({"ci"})))
SERVER, SERVER_CLIENT = ("bash", frozenset({"server"})), ("python", frozenset({"server"}))
VLLM_PYTHON, VLLM_BASH = ("python", frozenset({"vllm"})), ("bash", frozenset({"vllm"}))
GPU = ("python", frozenset({"gpu"}))
FIGURE = ("text", frozenset())
RULES = {PYTHON, CONTINUED, RUN, OUTPUT, PARSE, CI, SERVER, SERVER_CLIENT, VLLM_PYTHON, VLLM_BASH, GPU, FIGURE}


def _param(name, values, slow=False):
    return pytest.param(values, id=name, marks=[pytest.mark.slow] if slow else [])


FOLLOWING = {(block.page, block.line): after for block, after in zip(BLOCKS, BLOCKS[1:]) if block.page == after.page}


def _expected_output(block: Block) -> Block | None:
    after = FOLLOWING.get((block.page, block.line))
    return after if after is not None and after.kind == OUTPUT else None


def commands(text: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped, each split as the shell would."""
    joined = re.sub(r"\\\n", " ", text)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def macs_kernels_arguments(command: list[str], where: str) -> list[str]:
    """The arguments after `macs-kernels` (or `python -m macs_kernels`, `torchrun ... -m macs_kernels`)."""
    if command[0] == "macs-kernels":
        return command[1:]
    for index in range(len(command) - 1):
        if command[index:index + 2] == ["-m", "macs_kernels"]:
            return command[index + 2:]
    raise AssertionError(f"{where}: {shlex.join(command)!r} is not a macs-kernels command; tag the block")


NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def assert_same_output(printed: str, expected: Block) -> None:
    got, want = NUMBER.sub("#", printed).split(), NUMBER.sub("#", expected.text).split()
    assert got == want, (f"{expected.name}: the output shown differs from what the example prints (numbers "
                         f"masked)\n--- shown ---\n{expected.text}--- printed ---\n{printed}")


def run_python(program: list[Block], cwd: Path, env: dict | None = None) -> None:
    """Run the blocks in one interpreter, one namespace; each block's printout is checked against the output
    block that follows it, if any."""
    marker = "\n<<<macs_kernels docs block>>>\n"
    source = ["import sys", "namespace = {'__name__': '__main__'}"]
    for block in program:
        source += [f"sys.stdout.write({marker!r}); sys.stdout.flush()",
                   f"exec(compile({block.text!r}, {block.name!r}, 'exec'), namespace)"]
    script = cwd / "docs_program.py"
    script.write_text("\n".join(source) + "\n")
    result = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                            timeout=TIMEOUT_S, env=env)
    if result.returncode != 0:
        skip_where_continuous_batching_is_refused(result.stderr)
    assert result.returncode == 0, f"{program[0].name} failed:\n{result.stderr[-6000:]}"
    printed = result.stdout.split(marker)[1:]
    for block, text in zip(program, printed):
        if (expected := _expected_output(block)) is not None:
            assert_same_output(text, expected)


def python_programs() -> list:
    """Each page's python blocks, a `continued` one joining the program before it."""
    programs: list[list[Block]] = []
    for block in BLOCKS:
        if block.kind == PYTHON:
            programs.append([block])
        elif block.kind == CONTINUED:
            assert programs and programs[-1][0].page == block.page, f"{block.name}: nothing to continue"
            programs[-1].append(block)
    return [_param(program[0].name, program, slow=any("slow" in b.tags for b in program)) for program in programs]


def _of_kind(kind) -> list:
    return [_param(block.name, block, slow="slow" in block.tags) for block in BLOCKS if block.kind == kind]


def test_every_block_has_a_rule():
    unknown = [f"{block.name}: ```{block.language} {' '.join(sorted(block.tags))}" for block in BLOCKS
               if block.kind not in RULES]
    assert not unknown, "code blocks no rule of tests/test_docs.py checks:\n" + "\n".join(unknown)
    runnable = {PYTHON, CONTINUED, RUN, SERVER_CLIENT, VLLM_PYTHON, GPU}
    checked = {(after.page, after.line) for block, after in zip(BLOCKS, BLOCKS[1:])
               if block.kind in runnable and _expected_output(block) is after}
    orphans = [block.name for block in BLOCKS if block.kind == OUTPUT and (block.page, block.line) not in checked]
    assert not orphans, f"output blocks that follow nothing runnable: {orphans}"


def test_read_blocks_keeps_fences_tags_and_indentation(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python continued slow\nx = 1\n```\n  ```bash\n  macs-kernels --help\n  ```\n")
    first, second = read_blocks(page)
    assert (first.line, first.language, first.tags, first.text) == (2, "python", {"continued", "slow"}, "x = 1\n")
    assert (second.language, second.tags, second.text) == ("bash", frozenset(), "macs-kernels --help\n")
    page.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        read_blocks(page)


def test_output_comparison_masks_numbers_only():
    shown = Block(ROOT, 1, "output", frozenset(), "Top tokens: ' William' +3.58, ' around' +1.48\n")
    assert_same_output("Top tokens: '\nWilliam' +3.61, ' around' +1.2\n", shown)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_output("Top tokens: ' Hamlet' +3.58, ' around' +1.48\n", shown)


@pytest.mark.parametrize("program", python_programs())
def test_python_block(program, tmp_path):
    run_python(program, tmp_path)


@pytest.mark.parametrize("block", _of_kind(RUN))
def test_command_block(block, tmp_path):
    printed = []
    for command in commands(block.text):
        arguments = macs_kernels_arguments(command, block.name)
        result = subprocess.run([sys.executable, "-m", "macs_kernels", *arguments], cwd=tmp_path,
                                capture_output=True, text=True, timeout=TIMEOUT_S)
        assert result.returncode == 0, f"{block.name}: {shlex.join(command)} failed:\n{result.stderr[-6000:]}"
        printed.append(result.stdout)
    if (expected := _expected_output(block)) is not None:
        assert_same_output("".join(printed), expected)


@pytest.mark.parametrize("block", _of_kind(PARSE))
def test_parsed_command_block(block, capsys):
    from macs_kernels.apps.cli import build_parser

    for command in commands(block.text):
        try:
            build_parser().parse_args(macs_kernels_arguments(command, block.name))
        except SystemExit:
            pytest.fail(f"{block.name}: {shlex.join(command)}\n{capsys.readouterr().err}")


def _ci_commands() -> list[list[str]]:
    plumbing = {"set", "cd"}  # the script's own shell set-up, not a documented command
    return [command for command in commands(CI_SCRIPT.read_text()) if command[0] not in plumbing]


def test_ci_runs_exactly_the_documented_commands():
    ci = _ci_commands()
    documented = [commands(block.text) for block in BLOCKS if block.kind == CI]
    assert documented and documented[0] == ci[:len(documented[0])], (
        "the README's set-up and test lines must be .ci/run's first commands, as they are")
    covered = []
    for block_commands in documented:
        starts = [i for i in range(len(ci)) if ci[i:i + len(block_commands)] == block_commands]
        assert starts, f".ci/run does not run these documented lines as they are: {block_commands}"
        covered += range(starts[0], starts[0] + len(block_commands))
    undocumented = [shlex.join(ci[i]) for i in range(len(ci)) if i not in covered]
    assert not undocumented, f".ci/run runs commands no ```bash ci block shows: {undocumented}"


def test_support_table_is_generated_from_support_py():
    from macs_kernels.core import support

    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("<!-- support table: begin -->\n")[1].split("<!-- support table: end -->")[0]
    assert table == support.markdown_table(), (
        "docs/architecture.md's support table differs from macs_kernels/core/support.py: replace it with the "
        "output of python -c \"from macs_kernels.core import support; print(support.markdown_table(), end='')\"")


@pytest.mark.parametrize("block", _of_kind(GPU))
def test_gpu_block(block, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_python([block], tmp_path, env=os.environ | {"TRITON_INTERPRET": "0"})


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)  # a `# comment` is no heading
    headings = [line.lstrip("#").strip() for line in prose.splitlines() if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_health(server: subprocess.Popen, port: int, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            skip_where_continuous_batching_is_refused(log.read_text())
            pytest.fail(f"the server exited with {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the server did not answer /health within {timeout_s} s:\n{log.read_text()[-6000:]}")


SERVER_PAGES = sorted({block.page for block in BLOCKS if block.kind == SERVER})


@pytest.mark.slow
@pytest.mark.parametrize("page", SERVER_PAGES, ids=[str(page.relative_to(ROOT)) for page in SERVER_PAGES])
def test_server_blocks(page, tmp_path):
    (command,) = [command for block in BLOCKS if block.page == page and block.kind == SERVER
                  for command in commands(block.text)]
    arguments = macs_kernels_arguments(command, str(page))
    assert arguments[0] == "serve" and arguments[arguments.index("--port") + 1] == SERVER_ADDRESS.split(":")[1]
    port = _free_port()
    arguments[arguments.index("--port") + 1] = str(port)
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen([sys.executable, "-m", "macs_kernels", *arguments], cwd=tmp_path, stdout=sink,
                                  stderr=subprocess.STDOUT)
    try:
        _wait_for_health(server, port, log)
        clients = [block for block in BLOCKS if block.page == page and block.kind == SERVER_CLIENT]
        assert clients, f"{page.name}: a server block with no client example"
        for client in clients:
            assert SERVER_ADDRESS in client.text, f"{client.name}: talks to another address than {SERVER_ADDRESS}"
            moved = Block(client.page, client.line, client.language, client.tags,
                          client.text.replace(SERVER_ADDRESS, f"127.0.0.1:{port}"))
            run_python([moved], tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=60)


def _environment_names(command: list[str]) -> tuple[dict, list[str]]:
    """(the NAME=value assignments before a command, the command)."""
    names = {}
    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
        name, value = command[0].split("=", 1)
        names[name] = value
        command = command[1:]
    return names, command


def test_vllm_commands_name_the_packages_plugins():
    plugins = {entry.name for group in ("vllm.general_plugins", "vllm.endpoint_plugins")
               for entry in importlib.metadata.entry_points(group=group)}
    vllm_commands = [command for block in BLOCKS if block.kind == VLLM_BASH for command in commands(block.text)]
    assert vllm_commands
    for command in vllm_commands:
        names, _ = _environment_names(command)
        assert set(names.get("VLLM_PLUGINS", "").split(",")) <= plugins, (command, plugins)


VLLM_BLOCKS = [block for block in BLOCKS if block.kind in (VLLM_PYTHON, VLLM_BASH)]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's blocks run in vLLM's venv (.ci/run's last step)")
@pytest.mark.parametrize("block", VLLM_BLOCKS, ids=[block.name for block in VLLM_BLOCKS])
def test_vllm_block(block, tmp_path):
    if block.kind == VLLM_PYTHON:
        # The engine core in this process and a 1 GiB KV cache, as tests/engines/vllm run it.
        run_python([block], tmp_path, env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                         "VLLM_CPU_KVCACHE_SPACE": "1"})
        return
    help_text = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"],
                               capture_output=True, text=True, timeout=TIMEOUT_S).stdout
    for command in commands(block.text):
        _, command = _environment_names(command)
        flags = [word.split("=")[0] for word in command if word.startswith("--")]
        missing = [flag for flag in flags if flag not in help_text]
        assert not missing, f"{block.name}: vLLM's server does not know {missing}"
        extension = command[command.index("--worker-extension-cls") + 1]
        module, _, name = extension.rpartition(".")
        assert hasattr(importlib.import_module(module), name), extension
