"""`macs-kernels explain --image PATH --prompt TEXT --model VLM`: the image path of the explain command."""
from __future__ import annotations

import argparse


def load_vision_model(name, *, dtype, device=None):
    """(model, processor) of a vision-language model folder or hub id, in eval mode."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from macs_kernels.api.models import check_reachable

    check_reachable(name)
    model = AutoModelForImageTextToText.from_pretrained(name, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), AutoProcessor.from_pretrained(name)


def check_image_arguments(args: argparse.Namespace) -> None:
    """What --image needs, checked before the model loads."""
    from macs_kernels.apps.cli.common import check_output_files

    if args.method != "macs":
        raise SystemExit(f"--image explains with MACS; --method {args.method} takes text prompts only")
    if args.prompt is None or args.question or args.context:
        raise SystemExit("--image takes --prompt (the question about the image), not --question/--context")
    if args.model is None:
        raise SystemExit("--image needs --model naming a vision-language model (a folder or a hub id): the default "
                         "model reads text only")
    for path in args.image:
        if not path.is_file():
            raise SystemExit(f"--image {path}: no such file")
    check_output_files(json=args.json, html=args.html, heatmap=args.heatmap)


def explain_images(args: argparse.Namespace, config) -> int:
    """Explain --prompt about the --image files (the arguments checked by check_image_arguments); print the answer,
    the prompt's heatmap and each image's most attended cell; write --heatmap (PNG over the first image), --json and
    --html."""
    import torch
    from PIL import Image

    from macs_kernels.api.explanation import explain
    from macs_kernels.api.vision import image_scores, load_image
    from macs_kernels.api.vision.render import save_heatmap
    from macs_kernels.api.viz import print_explanation
    from macs_kernels.apps.cli.common import write_outputs

    images = []
    for path in args.image:
        try:
            images.append(load_image(path))
        except (OSError, Image.DecompressionBombError) as error:  # a bomb's error is no OSError
            raise SystemExit(f"--image {path}: cannot read it as an image ({error})") from None
    try:
        model, processor = load_vision_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {args.model}: cannot load it as a vision-language model: "
                         f"{str(error).splitlines()[0]}") from None
    explanation = explain(model, processor, args.prompt, images=images, max_new_tokens=args.max_new_tokens,
                          **config.as_dict())
    steps = len(explanation.generated_ids)
    if args.step is not None and not -steps <= args.step < steps:
        print_explanation(explanation, how=args.aggregation)
        write_outputs(args, explanation)
        raise SystemExit(f"--step {args.step} is out of range: the generation stopped after {steps} tokens; the "
                         "whole answer is shown above")
    # The text after the last image: hundreds of image tokens would bury it (the images' cells are printed below).
    after_images = max(tokens.positions[-1] for tokens in explanation.images) + 1
    span = (after_images, len(explanation.input_tokens)) if after_images < len(explanation.input_tokens) else None
    print_explanation(explanation, step=args.step, how=args.aggregation, span=span)
    for index in range(len(explanation.images)):
        grid = image_scores(explanation, step=args.step, how=args.aggregation, image=index)
        row, col = divmod(int(grid.argmax()), grid.shape[1])
        print(f"image {index} ({args.image[index]}): {grid.shape[0]} x {grid.shape[1]} token grid; highest cell "
              f"row {row}, column {col} (score {float(grid[row, col]):+.2f})")
    if args.heatmap:
        save_heatmap(explanation, args.heatmap, step=args.step, how=args.aggregation)
        print(f"wrote {args.heatmap}")
    write_outputs(args, explanation)
    return 0


def evaluate_image_set(args: argparse.Namespace) -> int:
    """`macs-kernels eval --images FOLDER --model VLM`: AUC-PR of every image's token scores against its mask (the
    best step's and the whole answer's, 95% intervals), one JSON line per image in --out (resumed when its lines
    come from the same settings), the summary in OUT.summary.json."""
    import json

    import torch

    from macs_kernels.apps.cli.common import check_model_argument
    from macs_kernels.apps.evaluation.images import DEFAULT_THRESHOLD, evaluate_images, load_image_set, summarise
    from macs_kernels.core.config import MacsConfig

    if args.model is None:
        raise SystemExit("--images needs --model naming a vision-language model (a folder or a hub id)")
    threshold = DEFAULT_THRESHOLD if args.mask_threshold is None else args.mask_threshold
    if not 0 < threshold <= 1:
        raise SystemExit(f"--mask-threshold must be in (0, 1], got {threshold}")
    try:
        samples = load_image_set(args.images)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--images {args.images}: {error}") from None
    samples = samples[: args.n] if args.n else samples
    config = MacsConfig(backend=args.backend).as_dict()
    settings = {"kind": "image", "model": str(args.model), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                "threshold": threshold, "config": config}
    done = {}
    if args.out.is_file():
        for line in args.out.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("settings") != settings:
                raise SystemExit(f"--out {args.out}: holds results of other settings or another evaluation; give "
                                 "another --out")
            done[entry["name"]] = entry
    check_model_argument(args.model)
    model, processor = load_vision_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)

    def append(result):
        with args.out.open("a") as out:
            out.write(json.dumps(result | {"settings": settings}) + "\n")

    results = evaluate_images(model, processor, samples, done=done, on_result=append,
                              max_new_tokens=args.max_new_tokens, threshold=threshold, **config)
    summary = summarise(results) | {"settings": settings}
    path = args.out.with_suffix(".summary.json")
    path.write_text(json.dumps(summary, indent=1))
    print(f"{summary['scored']} of {summary['samples']} images scored ({summary['skipped']} skipped: no token cell "
          f"reaches the mask threshold {threshold})")
    for key, label in (("best", "best step"), ("whole_answer", "whole answer")):
        if key in summary:
            low, high = summary[key]["ci95"]
            interval = "" if low is None else f" [{low:.3f}, {high:.3f}]"
            print(f"AUC-PR, {label}: {summary[key]['mean']:.3f}{interval}")
    if "random_baseline" in summary:
        print(f"random ranking (share of object cells): {summary['random_baseline']:.3f}")
    print(f"wrote {args.out}, {path}")
    return 0
