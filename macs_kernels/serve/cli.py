"""`macs-kernels serve`: the OpenAI-compatible server with MACS attribution and the live page at /."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible server (continuous batching) with per-request MACS attribution",
        description="Serves /v1/chat/completions and /v1/completions (streaming or not), /v1/models, /health, "
                    "and the live attribution page at /. Add \"attribution\": true (or an object of options) to a "
                    "request body to get MACS rows.",
    )
    _add_arguments(parser)
    parser.set_defaults(run=run_serve)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="transformers model id or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--served-name", default=None,
                        help="the model name clients send and /v1/models lists (default: --model, or the "
                             "default model's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cache-tokens", type=int, default=8192,
                        help="KV-cache capacity in tokens, all requests together (a multiple of --page-size)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per KV-cache page")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="query tokens per batched forward pass")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens of a request that does not give one")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--at2-coefficients", default=None, metavar="PATH",
                        help="AT2 coefficients for attribution.method='at2' (default: the packaged ones, when they "
                             "were trained for the served model; else that method is refused)")


def run_serve(args) -> int:
    import torch
    import uvicorn

    from ..models import DEFAULT_MODEL, load_model
    from .app import create_app
    from .engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    engine = Engine(model, tokenizer, name=args.served_name or args.model or DEFAULT_MODEL,
                    cache_tokens=args.cache_tokens, page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                    default_max_tokens=args.default_max_tokens, at2_coefficients=args.at2_coefficients)
    # Uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight responses finish, then runs the
    # lifespan's shutdown, which drains and stops the engine.
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="info")
    return 0


def main(argv=None) -> int:
    """`python -m macs_kernels.serve [options]`: the same command without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="python -m macs_kernels.serve", description=__doc__)
    _add_arguments(parser)
    return run_serve(parser.parse_args(argv))
