"""The `macs-kernels` command: explain | eval | bench | at2 | serve.

Each subcommand lives in its own module exposing `add_parser(subparsers)`; building the parser imports
only those modules, which keep torch and transformers inside their run functions, so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# One line per subcommand module (anything with add_parser(subparsers) that imports no torch at import time).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "macs_kernels.apps.cli.explain",
    "macs_kernels.apps.cli.eval",
    "macs_kernels.apps.cli.bench",
    "macs_kernels.apps.cli.at2",
    "macs_kernels.apps.serve.cli",
)


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: its --help shows each option's default where it says something (not None, False,
    or already in the option's help)."""

    def format_help(self) -> str:
        for action in self._actions:
            text = action.help or ""
            if (action.option_strings and action.help is not argparse.SUPPRESS and "default" not in text.lower()
                    and not any(action.default is quiet for quiet in (None, False, argparse.SUPPRESS))):
                action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="macs-kernels", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(required=True, dest="command", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
