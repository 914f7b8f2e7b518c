"""The `macs-kernels` command itself: --help without torch, and arguments refused before any model loads."""
import argparse
import json
import subprocess
import sys

import pytest

from macs_kernels.apps.cli import SUBCOMMAND_MODULES, build_parser, main
from tests.helpers import QUESTIONS

HEAVY = ("torch", "transformers", "numpy", "triton")


@pytest.mark.parametrize("argv", [["-m", "macs_kernels", "--help"], ["-m", "macs_kernels.apps.cli", "eval", "--help"],
                                  ["-m", "macs_kernels.apps.cli", "at2", "train", "--help"],
                                  ["-m", "macs_kernels.apps.cli", "explain", "--help"],
                                  ["-m", "macs_kernels.apps.cli", "serve", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    probe = ("import runpy, sys\n"
             "sys.argv = ['macs-kernels', *sys.argv[1:]]\n"
             "try:\n"
             f"    runpy.run_module({argv[1]!r}, run_name='__main__')\n"
             "except SystemExit:\n"
             "    pass\n"
             f"print([name for name in {HEAVY!r} if name in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", probe, *argv[2:]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: macs-kernels" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def refuse_loading(monkeypatch, *modules):
    """Fail the test if a command in these CLI modules loads its model: its arguments are checked first."""
    def no_loading(args):
        raise AssertionError("the model was loaded before the arguments were checked")

    for module in modules:
        monkeypatch.setattr(f"{module}.load_from_args", no_loading)


def test_every_subcommand_module_registers_and_nothing_imports_back():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"explain", "eval", "bench", "at2"} <= set(commands) and len(SUBCOMMAND_MODULES) == len(commands)
    for module in ("macs_kernels.apps.at2", "macs_kernels.apps.evaluation", "macs_kernels.apps.bench"):
        # The library never imports its command line (the old at2/cli.py <-> cli.py cycle).
        done = subprocess.run(
            [sys.executable, "-c", f"import sys, {module}; print('macs_kernels.apps.cli' in sys.modules)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.stdout.strip() == "False", done.stderr


def _explain(*extra):
    question, context = QUESTIONS[0]
    return ["explain", "--question", question, "--context", context, "--max-new-tokens", "3", *extra]


@pytest.mark.parametrize("model", ["/nonexistent", "./no/such/folder", "~/no-such-model", "a/b/c"])
def test_a_missing_model_folder_is_named_before_loading(model, capsys):
    with pytest.raises(SystemExit, match=f"--model {model}: the folder does not exist"):
        main(_explain("--model", model))
    with pytest.raises(SystemExit, match="the folder does not exist"):
        main(["eval", "--data", __file__, "--model", model, "--out", "/tmp/never-written.jsonl"])


def test_a_file_given_as_model_folder_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match="is a file, not a model folder"):
        main(_explain("--model", str(tmp_path / "weights.bin")))


def test_step_and_output_files_are_checked_before_generation(tmp_path, monkeypatch):
    refuse_loading(monkeypatch, "macs_kernels.apps.cli.explain")
    refusals = [
        (("--step", "3"), "--step 3 is out of range: at most 3 tokens"),
        (("--step", "-4"), "--step -4 is out of range"),
        (("--json", str(tmp_path / "missing" / "x.json")), "--json .*: the folder .* does not exist"),
        (("--html", str(tmp_path)), "--html .*: is a folder"),
        (("--json", str(tmp_path / "x"), "--html", str(tmp_path / "x")), "--json and --html name the same file"),
        (("--alpha", "1.5"), "alpha must be in"),
        (("--max-new-tokens", "0"), "--max-new-tokens must be at least 1"),
    ]
    for extra, match in refusals:
        with pytest.raises(SystemExit, match=match):
            main(_explain(*extra))


def test_an_empty_prompt_question_or_context_is_refused_before_loading(monkeypatch):
    refuse_loading(monkeypatch, "macs_kernels.apps.cli.explain", "macs_kernels.apps.cli.at2")
    question, context = QUESTIONS[0]
    refusals = [
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt", ""], "--prompt is empty"),
        (["--question", " \t", "--context", context], "--question is empty"),
        (["--question", question, "--context", "\n"], "--context is empty"),
        (["--question", "  ", "--context", context, "--method", "at2"], "--question is empty"),
        (["--question", question, "--context", context, "--method", "at2", "--attention", "norm"],
         "--method at2 takes --attention softmax or efficient, not 'norm'"),
    ]
    for argv, match in refusals:
        with pytest.raises(SystemExit, match=match):
            main(["explain", *argv, "--max-new-tokens", "3"])


def test_an_empty_prompt_exits_with_one_line_and_no_traceback():
    done = subprocess.run([sys.executable, "-m", "macs_kernels", "explain", "--prompt", "   "], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["--prompt is empty (only whitespace)"]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_step_past_an_early_end_keeps_the_json(tmp_path):
    """--step inside --max-new-tokens but past the end of a generation that stopped early: the JSON and HTML
    are written, then the command says why it shows nothing."""
    out, page = tmp_path / "e.json", tmp_path / "e.html"
    question, context = QUESTIONS[0]
    with pytest.raises(SystemExit, match="--step 40 is out of range: the generation stopped after"):
        main(["explain", "--question", question, "--context", context, "--max-new-tokens", "64", "--step", "40",
              "--json", str(out), "--html", str(page)])
    data = json.loads(out.read_text())
    assert 0 < len(data["generated_ids"]) <= 40 and page.read_text().lstrip().lower().startswith("<!doctype html")


def test_a_subcommand_module_is_added_by_one_line(monkeypatch):
    """What the serve package does: a module with add_parser(subparsers), named once in SUBCOMMAND_MODULES."""
    import types

    import macs_kernels.apps.cli as cli

    module = types.ModuleType("fake_subcommand")

    def add_parser(subparsers):
        parser = subparsers.add_parser("fake", help="a subcommand added by one line")
        parser.add_argument("--port", type=int, default=8000)
        parser.set_defaults(run=lambda args: args.port)

    module.add_parser = add_parser
    monkeypatch.setitem(sys.modules, "fake_subcommand", module)
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", (*cli.SUBCOMMAND_MODULES, "fake_subcommand"))
    assert cli.main(["fake", "--port", "9"]) == 9


def test_help_names_every_subcommand_and_each_option_default():
    parser = build_parser()
    names = [module.rsplit(".", 2)[-2 if module.endswith(".cli") else -1] for module in SUBCOMMAND_MODULES]
    assert parser.description.endswith(" | ".join(names) + ".")
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    explain = " ".join(subcommands["explain"].format_help().split())
    assert "--alpha ALPHA default: 0.8" in explain and "--max-new-tokens MAX_NEW_TOKENS default: 64" in explain
    serve = " ".join(subcommands["serve"].format_help().split())
    assert "--port PORT default: 8000" in serve
    assert serve.count("default: float32") == 1  # a second --help does not repeat it
    assert " ".join(subcommands["serve"].format_help().split()) == serve


def test_serve_arguments_are_checked_before_the_model_loads(monkeypatch, tmp_path):
    import socket

    refuse_loading(monkeypatch, "macs_kernels.apps.cli.common")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        refusals = [
            (["--model", "/missing"], "--model /missing: the folder does not exist"),
            (["--port", "99999"], r"--port 99999: a port is a number in \[0, 65535\]"),
            (["--port", str(busy)], rf"--host 127.0.0.1 --port {busy}: cannot listen there \(the port is in use\)"),
            (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: cannot resolve it"),
            (["--cache-tokens", "100"], r"--cache-tokens \(100\) must be a positive multiple of --page-size \(64\)"),
            (["--page-size", "0"], "--page-size must be at least 1, got 0"),
            (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1, got 0"),
            (["--at2-coefficients", str(tmp_path / "none.safetensors")], "--at2-coefficients .*: no such file"),
            (["--device", "cdua"], "--device cdua: this torch cannot use it"),
        ]
        for argv, match in refusals:
            with pytest.raises(SystemExit, match=match):
                main(["serve", *argv])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA machine can use --device cuda")
def test_a_device_or_backend_this_machine_lacks_is_refused_before_loading(monkeypatch):
    refuse_loading(monkeypatch, "macs_kernels.apps.cli.explain")
    with pytest.raises(SystemExit, match=r"--device cuda: this torch cannot use it \(.+\)"):
        main(_explain("--device", "cuda"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests run Triton in its interpreter
    for backend, reason in (("triton", "the triton backend needs CUDA tensors"),
                            ("cuda", "the cuda backend needs CUDA tensors")):
        with pytest.raises(SystemExit, match=f"--backend {backend}: {reason}"):
            main(_explain("--backend", backend))


@pytest.mark.parametrize("argv, line", [
    (["serve", "--port", "99999"], "--port 99999: a port is a number in [0, 65535]"),
    (["serve", "--model", "/missing"], "--model /missing: the folder does not exist"),
])
def test_serve_refusals_are_one_line_without_a_traceback(argv, line):
    done = subprocess.run([sys.executable, "-m", "macs_kernels", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [line]


def test_an_unknown_aggregation_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(_explain("--aggregation", "median"))
    assert "invalid choice: 'median' (choose from max_plus_run_minus_mean_sinkless_z" in capsys.readouterr().err


def test_an_output_file_the_system_refuses_is_named_before_loading(monkeypatch):
    """/proc passes every permission test and refuses the file: only opening tells."""
    refuse_loading(monkeypatch, "macs_kernels.apps.cli.explain")
    with pytest.raises(SystemExit, match=r"--json /proc/x.json: cannot write it \(.+\)"):
        main(_explain("--json", "/proc/x.json"))


def _small_window_chat_model(folder, monkeypatch, window: int):
    from tests.helpers import tiny_chat_model

    model, tokenizer = tiny_chat_model(folder)
    monkeypatch.setattr(model.config, "max_position_embeddings", window)
    monkeypatch.setattr("macs_kernels.apps.cli.explain.load_from_args", lambda args: (model, tokenizer))
    return model, tokenizer


def test_a_prompt_past_the_context_window_exits_with_one_line(tmp_path, monkeypatch):
    model, _ = _small_window_chat_model(tmp_path, monkeypatch, window=32)

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran")

    monkeypatch.setattr(model, "generate", no_generation)
    with pytest.raises(SystemExit, match=r"explain: the prompt has \d+ tokens; the model's context window holds 32 "):
        main(["explain", "--prompt", "word " * 40])


def test_a_step_past_the_end_prints_the_answer_then_the_error(monkeypatch, capsys):
    import torch

    from macs_kernels.api.explanation import Explanation

    answer = Explanation(input_ids=torch.arange(3), generated_ids=torch.tensor([5, 6]), input_tokens=["a", "b", "c"],
                         generated_tokens=["x", "y"], step_log_c=torch.tensor([[0.0, -1.0, -2.0], [-2.0, -1.0, 0.0]]),
                         config={}, text="the answer xy")
    monkeypatch.setattr("macs_kernels.apps.cli.explain.load_from_args", lambda args: (None, None))
    monkeypatch.setattr("macs_kernels.api.explanation.explain", lambda *args, **kwargs: answer)
    with pytest.raises(SystemExit, match="--step 2 is out of range: the generation stopped after 2 tokens; the whole "
                                         "answer is shown above"):
        main(["explain", "--prompt", "Say xy.", "--max-new-tokens", "3", "--step", "2"])
    assert "the answer xy" in capsys.readouterr().out


def test_a_decompression_bomb_is_one_line(tmp_path, monkeypatch):
    from PIL import Image

    Image.new("RGB", (40, 40)).save(tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 1,600 pixels: past twice the limit, PIL's bomb error
    with pytest.raises(SystemExit, match=r"--image .*bomb.png: cannot read it as an image \(Image size \(1600 "
                                         r"pixels\) exceeds limit"):
        main(["explain", "--image", str(tmp_path / "bomb.png"), "--prompt", "What is it?", "--model", "some/vlm"])


def test_a_folder_that_holds_no_model_is_one_line():
    with pytest.raises(SystemExit, match="--model /etc: cannot load it: "):
        main(_explain("--model", "/etc"))


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_a_hub_id_out_of_reach_fails_at_once(monkeypatch, offline):
    import socket

    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    def no_loading(*args, **kwargs):
        raise AssertionError("from_pretrained ran (and would retry the hub for half a minute)")

    def unresolved(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr("macs_kernels.api.models.socket.getaddrinfo", unresolved)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    why = "HF_HUB_OFFLINE is set" if offline else r"the hub \(huggingface.co\) cannot be reached: Name or service"
    with pytest.raises(SystemExit, match=f"--model no-such-owner/no-such-model: cannot load it: no-such-owner/"
                                         f"no-such-model is not in the local Hugging Face cache and {why}"):
        main(_explain("--model", "no-such-owner/no-such-model"))
