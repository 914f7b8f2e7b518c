"""`macs-kernels at2 train` and the work behind `macs-kernels explain --method at2`."""
from __future__ import annotations

import argparse
from pathlib import Path

from macs_kernels.apps.cli.common import (
    add_model_arguments,
    check_model_argument,
    check_output_files,
    load_from_args,
    write_outputs,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("at2", help="AT2: train head coefficients against ablations")
    commands = parser.add_subparsers(required=True, dest="at2_command")
    train = commands.add_parser("train", help="collect ablations and fit AT2 coefficients (resumable)")
    train.add_argument("--data", type=Path, required=True, help="QA JSON (flat list or SQuAD form)")
    train.add_argument("--out", type=Path, required=True, help="coefficient file to write (safetensors)")
    train.add_argument("--range", default="0:250", help="START:STOP of the questions to train on (default 0:250)")
    train.add_argument("--work", type=Path, default=None,
                       help="work folder for collected ablations and checkpoints (default ~/.cache/macs_kernels/at2)")
    train.add_argument("--masks", type=int, default=32, help="ablation masks per question")
    train.add_argument("--epochs", type=int, default=100)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--max-new-tokens", type=int, default=32)
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_model_arguments(train)
    train.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from macs_kernels.apps.evaluation.data import load_qa, parse_range

    check_output_files(out=args.out)
    check_model_argument(args.model)
    if not args.data.is_file():
        raise SystemExit(f"--data {args.data}: no such file")
    try:
        samples = load_qa(args.data, range=parse_range(args.range))
    except ValueError as error:
        raise SystemExit(f"at2 train: {error}") from None

    import torch

    from macs_kernels.api.models import DEFAULT_MODEL, cache_dir
    from macs_kernels.apps.at2 import train_coefficients

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_from_args(args)
    work = args.work or cache_dir() / "at2"
    theta, metadata = train_coefficients(model, tokenizer, samples, work=work, out=args.out, n_masks=args.masks,
                                         epochs=args.epochs, lr=args.lr, max_new_tokens=args.max_new_tokens,
                                         model_name=args.model or DEFAULT_MODEL, data_name=args.data.name)
    print(f"wrote {args.out}: {theta.shape[0]} layers x {theta.shape[1]} heads from {metadata['examples']} questions")
    return 0


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="macs", choices=["macs", "at2"], help="attribution method")
    parser.add_argument("--sources", default="sentence", choices=["token", "word", "sentence"],
                        help="AT2 sources (default sentence)")
    parser.add_argument("--coefficients", type=Path, default=None, help="AT2 coefficient file (default: packaged)")


def run_explain(args: argparse.Namespace) -> int:
    """explain --method at2: needs --question and --context; prints the ranked sources, writes JSON/HTML."""
    if args.prompt is not None or not (args.question and args.context):
        raise SystemExit("--method at2 needs --question and --context (its sources are parts of the context)")
    if args.coefficients is not None and not args.coefficients.is_file():
        raise SystemExit(f"--coefficients {args.coefficients}: no such file")
    from macs_kernels.api.viz import print_sources
    from macs_kernels.apps.at2 import AT2Attributor

    model, tokenizer = load_from_args(args)
    try:
        attributor = AT2Attributor(model, tokenizer, args.coefficients)
    except (FileNotFoundError, ValueError) as error:  # missing file, wrong shape, not safetensors
        raise SystemExit(f"macs-kernels explain --method at2: {error}") from None
    explanation = attributor.explain(args.question, args.context, sources=args.sources,
                                     max_new_tokens=args.max_new_tokens, attention=args.attention)
    print_sources(explanation)
    write_outputs(args, explanation)
    return 0
