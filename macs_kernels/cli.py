"""The `macs-kernels` command: explain | eval | bench | at2."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="transformers model id or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model weights' dtype")
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")


def load_from_args(args):
    import torch

    from .models import load_model

    return load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)


def _explain_parser(subparsers) -> None:
    parser = subparsers.add_parser("explain", help="generate an answer and show what the model looked at")
    parser.add_argument("--question", help="question of the paper's QA prompt (with --context)")
    parser.add_argument("--context", help="context of the paper's QA prompt (with --question)")
    parser.add_argument("--prompt", help="a free prompt instead of --question/--context")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--step", type=int, default=None, help="show this step's heatmap (default: mean over steps)")
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--pooling", default="max", choices=["max", "mean", "min"])
    parser.add_argument("--no-redistribute", action="store_true", help="switch redistribution off")
    parser.add_argument("--attention", default="softmax", choices=["softmax", "efficient"])
    parser.add_argument("--backend", default=None, choices=["torch", "triton", "cuda"])
    parser.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="compute decode-step attention with the backend's fused kernel (default: on for "
                             "triton and cuda, off for torch)")
    parser.add_argument("--json", type=Path, help="write the explanation as JSON here")
    parser.add_argument("--html", type=Path, help="write a self-contained HTML page here")
    add_model_arguments(parser)
    from .at2.cli import add_explain_arguments

    add_explain_arguments(parser)
    parser.set_defaults(run=run_explain)


def run_explain(args) -> int:
    if args.method == "at2":
        from .at2.cli import run_explain_at2

        return run_explain_at2(args)
    from .explanation import explain
    from .prompts import qa_messages
    from .viz import print_explanation

    if args.prompt is not None and (args.question or args.context):
        raise SystemExit("give either --prompt or --question with --context, not both")
    if args.prompt is None and not (args.question and args.context):
        raise SystemExit("give --question and --context (or --prompt)")
    model, tokenizer = load_from_args(args)
    prompt = args.prompt if args.prompt is not None else qa_messages(args.question, args.context)
    explanation = explain(
        model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, alpha=args.alpha, pooling=args.pooling,
        redistribute=not args.no_redistribute, attention=args.attention, backend=args.backend,
        fused_decode=args.fused_decode,
    )
    if args.context:
        from .evaluation.alignment import align_qa

        explanation.source_span = align_qa(tokenizer, args.question, args.context).context_tokens
    print_explanation(explanation, step=args.step)
    write_outputs(args, explanation)
    return 0


def write_outputs(args, explanation) -> None:
    """--json and --html of an explanation (anything with to_json and to_html)."""
    if args.json:
        args.json.write_text(explanation.to_json(indent=1))
        print(f"wrote {args.json}")
    if args.html:
        args.html.write_text(explanation.to_html())
        print(f"wrote {args.html}")


# Each subcommand module exposes add_parser(subparsers) and keeps heavy imports inside its run function.
SUBCOMMAND_MODULES: tuple[str, ...] = ("macs_kernels.at2.cli", "macs_kernels.evaluation.cli", "macs_kernels.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="macs-kernels", description=__doc__)
    subparsers = parser.add_subparsers(required=True, dest="command")
    _explain_parser(subparsers)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
