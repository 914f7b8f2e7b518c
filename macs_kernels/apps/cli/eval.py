"""`macs-kernels eval`: AUC-PR, faithfulness and ablations of the attribution methods on a QA set."""
from __future__ import annotations

import argparse
from pathlib import Path

from macs_kernels.apps.cli.common import (
    add_model_arguments,
    check_model_argument,
    load_from_args,
    registry_name,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="evaluate attributions on QA data (AUC-PR, faithfulness, ablations)",
        description="One greedy generation per sample; every method and ablation is scored from its recorded "
                    "rows. Results go to a resumable JSONL (--out); its summary to .json, .md and .png beside it "
                    "(X.jsonl -> X.json, X.md, X.png; any other name X.EXT -> X.summary.json, ...). Cached "
                    "results are reused only when computed from the same content (model settings, prompt, gold "
                    "answers, method); an existing file that this tool did not write is never overwritten.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", type=Path, help="QA JSON: a list of {question, context, answers} or SQuAD's nesting")
    source.add_argument("--hf-dataset", help="a datasets hub name, saved folder or .json/.jsonl file instead")
    source.add_argument("--images", type=Path, help="an image data set folder (samples.jsonl: image with mask or box; "
                        "macs_kernels.apps.evaluation.images) for a vision-language --model: AUC-PR of image patches")
    parser.add_argument("--mask-threshold", type=float, default=None,
                        help="with --images: a token cell is the object's when this share of it is in the mask "
                             "(default 0.5)")
    parser.add_argument("--split", default="validation", help="split of --hf-dataset (default: validation)")
    parser.add_argument("--range", help="START:STOP positions of the samples to use, e.g. 250:350")
    parser.add_argument("--n", type=int, help="take the first N samples (of --range when given)")
    parser.add_argument("--methods", help="comma-separated: macs, macs:pool=mean|min, macs:alpha=A, "
                        "macs:redistribute=off, macs:attention=efficient, at2, attention-mean, rollout, random, "
                        "attnlrp, atman; or 'all' (the paper's Table 2: the default ones plus attnlrp and atman) "
                        "(default: all available except attnlrp and atman)")
    parser.add_argument("--method-range", action="append", metavar="METHOD=START:STOP", default=[],
                        help="score METHOD only on the samples with index in [START, STOP) (repeatable), e.g. "
                             "attnlrp=250:270 for the expensive methods; paired differences against macs on "
                             "exactly those samples are reported")
    parser.add_argument("--cost-n", type=int, default=3, metavar="K",
                        help="measure each in-generation method's seconds and peak memory per generated token "
                             "(and plain generation's) on the first K samples it scores (default: 3; 0: none); "
                             "after-generation methods (rollout, attnlrp, atman) also wherever their rows are "
                             "computed")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--faithfulness-n", type=int, default=100,
                        help="masking curves on the first K samples (0: none)")
    parser.add_argument("--faithfulness-from", type=int, default=0, metavar="INDEX",
                        help="masking curves start at this sample index (250 on stqa_350: past the questions "
                             "AT2's coefficients were trained on, 0-249)")
    parser.add_argument("--out", type=Path, default=Path("eval_results.jsonl"),
                        help="results JSONL (resumed if present)")
    parser.add_argument("--records", type=Path, default=None,
                        help="cache folder of the per-sample attention records (default: the macs_kernels cache)")
    parser.add_argument("--backend", default=None, metavar="NAME",
                        type=registry_name("macs_kernels.ops.backends", "ENGINE_BACKENDS"),
                        help="the kernels' backend, one of macs_kernels.ops.backends.ENGINE_BACKENDS (default: the "
                             "fastest correct one here)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--report-only", action="store_true", help="only summarise --out (a partial run too)")
    parser.add_argument("--distributed", action="store_true",
                        help="data parallel: run under torchrun (torchrun --nproc-per-node K -m macs_kernels eval "
                             "...); rank r takes every K-th sample, all ranks append to one --out, rank 0 writes "
                             "the summary. Under torchrun this is implied.")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.images:
        from macs_kernels.apps.cli.images import evaluate_image_set

        return evaluate_image_set(args)
    from macs_kernels.apps.evaluation.report import markdown, write_report
    from macs_kernels.apps.evaluation.store import check_outputs, summary_paths

    data_file = args.data or (Path(args.hf_dataset) if args.hf_dataset and Path(args.hf_dataset).is_file() else None)
    try:
        check_outputs(args.out, protected=[data_file], write_stream=not args.report_only)
    except ValueError as error:
        raise SystemExit(f"eval: --out: {error}") from None
    from macs_kernels.apps.data_parallel import data_parallel

    with data_parallel(required=args.distributed) as shard:
        if not args.report_only:
            _run(args, shard)
        elif not args.out.is_file():
            raise SystemExit(f"no results file at {args.out}")
        shard.barrier()
    if not shard.leader:
        return 0
    summary = write_report(args.out)
    print(markdown(summary), end="")
    print("wrote " + ", ".join(str(p) for p in summary_paths(args.out).values()))
    return 0


def _run(args: argparse.Namespace, shard) -> None:
    from macs_kernels.apps.data_parallel import print_line
    from macs_kernels.apps.evaluation.data import load_qa, parse_range
    from macs_kernels.apps.evaluation.methods import method_skips, parse_method_ranges, parse_methods
    from macs_kernels.apps.evaluation.report import skips_text

    if args.data is None and args.hf_dataset is None:
        raise SystemExit("give --data FILE or --hf-dataset NAME")
    if args.data is not None and not args.data.is_file():
        raise SystemExit(f"--data {args.data}: no such file")
    if args.max_new_tokens < 1 or args.faithfulness_n < 0 or args.faithfulness_from < 0 or args.cost_n < 0:
        raise SystemExit("--max-new-tokens must be >= 1, --faithfulness-n, --faithfulness-from and --cost-n >= 0")
    check_model_argument(args.model)
    try:
        methods = parse_methods(args.methods, parse_method_ranges(args.method_range))
        samples = load_qa(args.data, hf_dataset=args.hf_dataset, split=args.split,
                          range=parse_range(args.range) if args.range else None, n=args.n)
    except ValueError as error:
        raise SystemExit(f"eval: {error}") from None
    relocated = [s for s in samples if s.relocated]
    if relocated:
        print_line(f"eval: {sum(len(s.relocated) for s in relocated)} gold answers were not at their answer_start and "
                   f"moved to the nearest occurrence of their text "
                   f"(samples {', '.join(str(s.index) for s in relocated)})")
    for sample in samples:
        if sample.problem:
            print_line(f"eval: sample {sample.index} refused: {sample.problem}")

    import torch

    from macs_kernels.api.models import DEFAULT_MODEL
    from macs_kernels.apps.evaluation.runner import EvalSettings, run_eval

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_from_args(args)
    settings = EvalSettings(
        model_name=args.model or DEFAULT_MODEL, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
        data=str(args.data or args.hf_dataset), faithfulness_n=args.faithfulness_n,
        faithfulness_from=args.faithfulness_from, cost_n=args.cost_n,
        records_root=None if args.records is None else str(args.records), backend=args.backend,
    )
    rank = f"rank {shard.rank} of {shard.size}: " if shard.size > 1 else ""
    named = (m.name + (f" (samples {m.indices[0]}:{m.indices[1]})" if m.indices else "") for m in methods)
    print_line(f"eval: {rank}{len(shard.take(samples))} of {len(samples)} samples, methods {', '.join(named)}")
    skips = method_skips(methods, samples)
    if skips:
        print_line(f"eval: methods not scored on some samples: {skips_text(skips)}")
    runner = run_eval(model, tokenizer, samples, methods, settings, args.out, progress=not args.no_progress,
                      shard=shard)
    print_line(f"eval: {rank}{runner.counts.describe()}")
