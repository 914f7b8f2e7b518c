"""`macs-kernels bench`: generation throughput and peak memory (the benchmark itself: macs_kernels.bench)."""
from __future__ import annotations

from ..bench import generate


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="throughput and peak memory: plain generate vs MACS vs output_attentions",
        description=generate.__doc__.split("\n\n")[0],
    )
    generate.add_arguments(parser)
    parser.set_defaults(run=generate.run_command)
