"""`macs-kernels bench`: generation throughput and peak memory (the benchmark itself: macs_kernels.apps.bench), with
--serving the cost of attribution in a continuous-batching server (macs_kernels.apps.bench.serving), or with --vllm
in vLLM (macs_kernels.apps.bench.vllm_engine)."""
from __future__ import annotations

from macs_kernels.apps.bench import generate, serving, vllm_engine


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="throughput and peak memory: plain generate vs MACS vs output_attentions (--serving: "
                      "continuous batching with and without attribution)",
        description=generate.__doc__.split("\n\n")[0],
    )
    generate.add_arguments(parser)
    serving.add_arguments(parser)
    vllm_engine.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    if args.vllm or args.vllm_report:
        return vllm_engine.run(args)
    if args.serving:
        if args.repeats < 1:
            raise SystemExit("--repeats must be at least 1")
        return serving.run(args)
    return generate.run_command(args)
