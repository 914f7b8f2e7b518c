"""`macs-kernels explain`: generate an answer and show which prompt tokens each generated token looked at."""
from __future__ import annotations

import argparse
from pathlib import Path

from macs_kernels.apps.cli import at2
from macs_kernels.apps.cli.common import (
    add_model_arguments,
    check_backend_argument,
    check_device_argument,
    check_model_argument,
    check_output_files,
    load_from_args,
    registry_name,
    write_outputs,
)
from macs_kernels.core.config import AT2_ATTENTIONS, ATTENTIONS, DEFAULT_ALPHA


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("explain", help="generate an answer and show what the model looked at")
    parser.add_argument("--question", help="question of the paper's QA prompt (with --context)")
    parser.add_argument("--context", help="context of the paper's QA prompt (with --question)")
    parser.add_argument("--prompt", help="a free prompt instead of --question/--context")
    parser.add_argument("--image", type=Path, action="append",
                        help="an image the --prompt asks about (repeat for several); --model must be a "
                             "vision-language model (Qwen2-VL/Qwen2.5-VL, Gemma 3, LLaVA)")
    parser.add_argument("--heatmap", type=Path, help="with --image: write a PNG of the scores over the first image")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--step", type=int, default=None,
                        help="show this step's heatmap, zero-based; negative counts from the end (default: the "
                             "whole answer, see --aggregation)")
    parser.add_argument("--aggregation", default=None, metavar="NAME",
                        type=registry_name("macs_kernels.core.scores", "AGGREGATIONS"),
                        help="the whole-answer score shown without --step, a name of macs_kernels.core.scores."
                             "AGGREGATIONS (default: Explanation.scores's; mean_log_c is the mean over steps of log "
                             "c shown before)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    parser.add_argument("--pooling", default="max", choices=["max", "mean", "min"])
    parser.add_argument("--no-redistribute", action="store_true", help="switch redistribution off")
    parser.add_argument("--attention", default="softmax", choices=ATTENTIONS)
    parser.add_argument("--backend", default=None, metavar="NAME",
                        type=registry_name("macs_kernels.ops.backends", "ENGINE_BACKENDS"),
                        help="the kernels' backend, one of macs_kernels.ops.backends.ENGINE_BACKENDS (default: the "
                             "fastest correct one here)")
    parser.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="compute decode-step attention with the backend's fused kernel (default: on for "
                             "triton and cuda, off for torch)")
    parser.add_argument("--full", action="store_true",
                        help="print the whole heatmap however long the prompt (a long one is summarised as its top "
                             "tokens in their neighbourhoods)")
    parser.add_argument("--json", type=Path, help="write the explanation as JSON here")
    parser.add_argument("--html", type=Path, help="write a self-contained HTML page here")
    add_model_arguments(parser)
    at2.add_explain_arguments(parser)
    parser.set_defaults(run=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be known before generating, checked before the model loads."""
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.step is not None and not -args.max_new_tokens <= args.step < args.max_new_tokens:
        raise SystemExit(f"--step {args.step} is out of range: at most {args.max_new_tokens} tokens are generated "
                         f"(--max-new-tokens), so steps are {-args.max_new_tokens}..{args.max_new_tokens - 1}")
    for option in ("prompt", "question", "context"):
        text = getattr(args, option)
        if text is not None and not text.strip():
            raise SystemExit(f"--{option} is empty (only whitespace)")
    if args.method == "at2" and args.attention not in AT2_ATTENTIONS:
        raise SystemExit(f"--method at2 takes --attention {' or '.join(AT2_ATTENTIONS)}, not {args.attention!r}")
    check_output_files(json=args.json, html=args.html)
    if args.image:
        from macs_kernels.apps.cli.images import check_image_arguments

        check_image_arguments(args)
    elif args.heatmap:
        raise SystemExit("--heatmap draws the scores over an --image; give one")
    check_model_argument(args.model)
    check_device_argument(args.device)
    check_backend_argument(args.backend, args.device)


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.method == "at2":
        return at2.run_explain(args)
    if args.prompt is not None and (args.question or args.context):
        raise SystemExit("give either --prompt or --question with --context, not both")
    if args.prompt is None and not (args.question and args.context):
        raise SystemExit("give --question and --context (or --prompt)")
    from macs_kernels.core.config import MacsConfig

    try:
        config = MacsConfig(alpha=args.alpha, pooling=args.pooling, redistribute=not args.no_redistribute,
                            attention=args.attention, backend=args.backend, fused_decode=args.fused_decode)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"explain: {error}") from None
    if args.image:
        from macs_kernels.apps.cli.images import explain_images

        return explain_images(args, config)

    from macs_kernels.api.explanation import explain
    from macs_kernels.api.prompts import qa_messages
    from macs_kernels.api.viz import print_explanation

    model, tokenizer = load_from_args(args)
    prompt = args.prompt if args.prompt is not None else qa_messages(args.question, args.context)
    try:
        explanation = explain(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, **config.as_dict())
    except ValueError as error:  # refused before generating: a prompt past the context window, another tokenizer
        raise SystemExit(f"explain: {error}") from None
    if args.context:
        from macs_kernels.apps.evaluation.alignment import align_qa

        explanation.source_span = align_qa(tokenizer, args.question, args.context).context_tokens
    steps = len(explanation.generated_ids)
    if args.step is not None and not -steps <= args.step < steps:
        # The generation ended before --step: show the whole answer and write what was asked, then say why.
        print_explanation(explanation, how=args.aggregation, full=args.full)
        write_outputs(args, explanation)
        raise SystemExit(f"--step {args.step} is out of range: the generation stopped after {steps} tokens; the "
                         "whole answer is shown above")
    print_explanation(explanation, step=args.step, how=args.aggregation, full=args.full)
    write_outputs(args, explanation)
    return 0
