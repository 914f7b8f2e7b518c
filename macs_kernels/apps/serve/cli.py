"""`macs-kernels serve`: the OpenAI-compatible server with MACS attribution and the live page at /."""
from __future__ import annotations

import argparse
import errno
import socket
from pathlib import Path

from macs_kernels.apps.cli.common import add_model_arguments
from macs_kernels.apps.serve.images import DEFAULT_MAX_IMAGE_PIXELS
from macs_kernels.apps.serve.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IMAGE_BODY_BYTES

# Options of the continuous-batching engine (and AT2), which a vision-language model's server does not run.
_BATCHING = {"page_size": 64, "max_batch_tokens": 256, "at2_coefficients": None}


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
    add_model_arguments(parser)
    parser.add_argument("--served-name", default=None,
                        help="the model name clients send and /v1/models lists (default: --model, or the "
                             "default model's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cache-tokens", type=int, default=8192,
                        help="KV-cache capacity in tokens, all requests together (a multiple of --page-size)")
    parser.add_argument("--page-size", type=int, default=_BATCHING["page_size"], help="tokens per KV-cache page")
    parser.add_argument("--max-batch-tokens", type=int, default=_BATCHING["max_batch_tokens"],
                        help="query tokens per batched forward pass")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens of a request that does not give one")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help=f"largest request body accepted; a larger one gets 413 before it is read (default: "
                             f"{DEFAULT_MAX_BODY_BYTES}, or {DEFAULT_MAX_IMAGE_BODY_BYTES} for a vision-language "
                             "model, whose requests carry images)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="largest image (width x height) a request may send a vision-language model")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--at2-coefficients", type=Path, default=None, metavar="PATH",
                        help="AT2 coefficients for attribution.method='at2' (default: the packaged ones, when they "
                             "were trained for the served model; else that method is refused)")


def check_arguments(args) -> None:
    """Everything about the arguments that can be known before the model loads (which takes seconds)."""
    from macs_kernels.apps.cli.common import check_device_argument, check_model_argument
    from macs_kernels.apps.serve.engine import check_sizes

    for option, value in (("--threads", args.threads), ("--max-body-bytes", args.max_body_bytes),
                          ("--max-image-pixels", args.max_image_pixels)):
        if value is not None and value < 1:
            raise SystemExit(f"{option} must be at least 1, got {value}")
    try:
        check_sizes(cache_tokens=args.cache_tokens, page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                    default_max_tokens=args.default_max_tokens, name=lambda field: "--" + field.replace("_", "-"))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.at2_coefficients is not None and not args.at2_coefficients.is_file():
        raise SystemExit(f"--at2-coefficients {args.at2_coefficients}: no such file")
    check_model_argument(args.model)
    check_device_argument(args.device)
    check_address(args.host, args.port)


def check_address(host: str, port: int) -> None:
    """Refuse a port out of range, or an address this process cannot listen on (a host name that does not
    resolve, a port in use or reserved), before the model loads."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"--port {port}: a port is a number in [0, 65535]")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise SystemExit(f"--host {host}: cannot resolve it ({error.strerror})") from None
    with socket.socket(family, kind) as probe:
        # As uvicorn binds: an address in TIME_WAIT from an earlier server is free to take.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            why = "the port is in use" if error.errno == errno.EADDRINUSE else error.strerror
            raise SystemExit(f"--host {host} --port {port}: cannot listen there ({why})") from None


def vision_language_type(name: str | None) -> str | None:
    """The model type of --model when it is a vision-language model (transformers' image-text-to-text kind),
    else None; a model type whose image tokens macs_kernels cannot map back to the image exits naming those it
    can."""
    if name is None:  # the default model reads text
        return None
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from macs_kernels.api.models import check_reachable
    from macs_kernels.api.vision.layout import model_type

    try:
        check_reachable(name)
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError):  # the model loader says why, in the words it has for every model
        return None
    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    try:
        return model_type(config)
    except NotImplementedError as error:
        raise SystemExit(f"--model {name}: a vision-language model this server cannot serve: {error}") from None


def _vision_engine(args):
    """The engine of a vision-language --model (loaded as `macs-kernels explain --image` loads it)."""
    import torch

    from macs_kernels.apps.cli.images import load_vision_model
    from macs_kernels.apps.serve.engine import VisionEngine

    batching = ["--" + name.replace("_", "-") for name, default in _BATCHING.items() if getattr(args, name) != default]
    if batching:
        raise SystemExit(f"{', '.join(batching)}: a vision-language model is served one request at a time through "
                         "generate (continuous batching takes no images) and without AT2; drop them")
    try:
        model, processor = load_vision_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {args.model}: cannot load it as a vision-language model: "
                         f"{str(error).splitlines()[0]}") from None
    return VisionEngine(model, processor, name=args.served_name or args.model, cache_tokens=args.cache_tokens,
                        default_max_tokens=args.default_max_tokens)


def run_serve(args) -> int:
    check_arguments(args)
    import torch
    import uvicorn

    from macs_kernels.api.models import DEFAULT_MODEL
    from macs_kernels.apps.cli.common import load_from_args
    from macs_kernels.apps.serve.app import create_app
    from macs_kernels.apps.serve.engine import Engine
    from macs_kernels.engines.continuous import batching_config_class

    if args.threads:
        torch.set_num_threads(args.threads)
    vision = vision_language_type(args.model) is not None
    if not vision:  # text models run on continuous batching: refused before the model loads
        try:
            batching_config_class()
        except RuntimeError as error:
            raise SystemExit(f"macs-kernels serve: {error}") from None
    try:
        if vision:
            engine = _vision_engine(args)
        else:
            model, tokenizer = load_from_args(args)
            engine = Engine(model, tokenizer, name=args.served_name or args.model or DEFAULT_MODEL,
                            cache_tokens=args.cache_tokens, page_size=args.page_size,
                            max_batch_tokens=args.max_batch_tokens, default_max_tokens=args.default_max_tokens,
                            at2_coefficients=args.at2_coefficients)
    except (TypeError, ValueError, NotImplementedError) as error:  # a model MACS cannot trace, AT2 for another
        raise SystemExit(f"macs-kernels serve: {error}") from None
    max_body_bytes = args.max_body_bytes or (DEFAULT_MAX_IMAGE_BODY_BYTES if vision else DEFAULT_MAX_BODY_BYTES)
    # Uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight responses finish, then runs the
    # lifespan's shutdown, which drains and stops the engine.
    uvicorn.run(create_app(engine, max_body_bytes=max_body_bytes, max_image_pixels=args.max_image_pixels),
                host=args.host, port=args.port, log_level="info")
    return 0


def main(argv=None) -> int:
    """`python -m macs_kernels.apps.serve [options]`: the same command without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="python -m macs_kernels.apps.serve", description=__doc__)
    _add_arguments(parser)
    return run_serve(parser.parse_args(argv))
