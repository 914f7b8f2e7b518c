"""What every engine can follow, as one table: a combination of engine, method and layout either yields rows
that equal the teacher-forced eager reference (the conformance suite checks each) or is refused before any
work by `check`, with one message naming the options; two layouts that each run may still be refused together
(`check_together`).
"""
from __future__ import annotations

import itertools

from macs_kernels.ops import variant

ENGINES = ("generate", "continuous", "server", "vllm")
METHODS = {  # method -> the option that selects it
    "exact": "softmax rows",
    "fused": "fused_decode=True",
    "efficient": "attention='efficient'",
    "norm": "attention='norm'",
    "at2": "AT2 features",
}
LAYOUTS = {  # layout -> the options that select it
    "greedy": "greedy decoding",
    "sampling": "sampling (do_sample=True)",
    "several": "several sequences per prompt (num_return_sequences > 1)",
    "beams": "beam search (num_beams > 1)",
    "assisted": "assisted decoding (assistant_model / prompt_lookup_num_tokens)",
    "static_cache": "a static cache (cache_implementation='static')",
    "left_padded": "a left-padded batch",
    "chunked_prefill": "chunked prefill",
    "shared_prefix": "shared prefixes",
    "cache_pressure": "cache pressure (requests offloaded and restarted)",
    "tensor_parallel": "tensor parallelism",
    **variant.LAYOUTS,
    "speculative": "speculative decoding (speculative_config)",
    "stop_strings": "stop strings (stop_strings= / the server's stop)",
    "compiled": "torch.compile (generate's compiled static cache, or a compiled forward)",
}

# (engine, method or "*", layout or "*") -> why it is refused. Everything else is supported.
UNSUPPORTED = {
    ("generate", "efficient", "assisted"): "the Gram state of efficient attention cannot drop rejected candidates",
    ("generate", "norm", "assisted"): "a verify pass writes several new cache slots; the value norms follow one "
                                      "new slot per pass",
    ("generate", "norm", "tensor_parallel"): "each rank would weigh its heads by its own shard of the output "
                                             "projection; not implemented",
    ("generate", "norm", "sliding_window"): "the value norms are kept per cache slot, which a window cache rolls",
    ("generate", "norm", "softcap"): "norm weighting of capped rows has no reference in the conformance suite yet",
    ("generate", "norm", "sinks"): "norm weighting of rows whose sink takes mass has no reference in the "
                                   "conformance suite yet",
    ("continuous", "norm", "*"): "the value norms are kept per sequence by generate's tracer only",
    ("server", "norm", "*"): "the server runs continuous batching, which does not keep value norms",
    ("vllm", "norm", "*"): "the vLLM backend scores softmax rows; value norms need the output projection, which its "
                           "attention layer does not see",
    ("generate", "*", "chunked_prefill"): "generate's prefill_chunk_size changes which passes see which keys",
    ("continuous", "*", "beams"): "transformers' continuous batching has no beam search",
    ("continuous", "*", "assisted"): "transformers' continuous batching has no assisted decoding",
    ("continuous", "*", "static_cache"): "continuous batching runs on its own paged cache",
    ("continuous", "*", "several"): "forked requests (num_return_sequences > 1) share prompt blocks the tracer "
                                    "does not follow yet",
    ("continuous", "*", "stop_strings"): "transformers' continuous batching has no stop strings (it would ignore "
                                         "them; the server cuts its requests' text itself)",
    ("continuous", "at2", "tensor_parallel"): "each rank holds its own heads' features; gathering them in the "
                                              "engine's loop is not implemented",
    ("generate", "at2", "beams"): "the captured queries do not follow beam search's reorders",
    ("generate", "at2", "assisted"): "the captured queries do not drop rejected candidates",
    ("server", "*", "beams"): "the server decodes without beam search",
    ("server", "*", "assisted"): "the server decodes without assisted decoding",
    ("server", "*", "static_cache"): "the server runs continuous batching on its own paged cache",
    ("server", "at2", "stop_strings"): "AT2's features are averaged over every generated token, the stop string's "
                                       "included",
    ("vllm", "efficient", "*"): "the vLLM backend scores softmax rows; efficient attention needs a Gram state per "
                                "request and layer that it does not keep",
    ("vllm", "at2", "*"): "the vLLM backend returns MACS rows; AT2 features come from explain()",
    ("generate", "efficient", "compiled"): "efficient rows update a Gram state per pass outside any graph; a compiled "
                                           "decode step keeps its state in static buffers only",
    ("generate", "norm", "compiled"): "the value norms are updated per pass outside any graph; a compiled decode step "
                                      "keeps its state in static buffers only",
    ("generate", "at2", "compiled"): "AT2's query capture is a per-layer hook, and a compiled decode step runs no "
                                     "Python per layer",
    ("continuous", "*", "compiled"): "the tracer keeps host-side state per pass of transformers' continuous "
                                     "batching; use the uncompiled forward",
    ("server", "*", "compiled"): "the server runs continuous batching with the uncompiled forward",
    ("vllm", "*", "speculative"): "speculative decoding verifies several draft tokens per pass and rejects some; the "
                               "backend scores one row per request and pass",
}

# (engine, method or "*", (layout, layout)) -> why two layouts that each run are refused together.
UNSUPPORTED_TOGETHER = {
    ("generate", "*", ("sliding_window", "compiled")): "a window layer's key slots roll with its cache, whose token "
                                                       "count the tracer reads on the host every pass, and a compiled "
                                                       "decode step runs no Python per layer (pass "
                                                       "disable_compile=True, or use the uncompiled forward)",
}


def _rule(engine: str, method: str, layout: str):
    if engine not in ENGINES or method not in METHODS or layout not in LAYOUTS:
        raise ValueError(f"unknown combination {engine!r}, {method!r}, {layout!r}; engines {ENGINES}, methods "
                         f"{tuple(METHODS)}, layouts {tuple(LAYOUTS)}")
    for key in ((engine, method, layout), (engine, "*", layout), (engine, method, "*")):
        if key in UNSUPPORTED:
            return key
    return None


def unsupported(engine: str, method: str, layout: str) -> str | None:
    """Why `method` with `layout` cannot run on `engine`, or None when it can."""
    key = _rule(engine, method, layout)
    return None if key is None else UNSUPPORTED[key]


def message(engine: str, method: str, layout: str) -> str | None:
    """The refusal of `method` with `layout` on `engine` (naming only the options its rule names), or None."""
    key = _rule(engine, method, layout)
    if key is None:
        return None
    _, rule_method, rule_layout = key
    what = " with ".join(part for part in (
        METHODS[method] if rule_method != "*" else None, LAYOUTS[layout] if rule_layout != "*" else None,
    ) if part)
    return f"{what} is not supported under macs_kernels' {engine} engine: {UNSUPPORTED[key]}"


def message_together(engine: str, method: str, layouts: tuple[str, str]) -> str | None:
    """The refusal of `method` with both `layouts` (in either order) on `engine` where each runs alone but not the two
    together (naming only the options its rule names), or None."""
    for layout in layouts:
        _rule(engine, method, layout)  # names checked
    for rule_method, pair in itertools.product((method, "*"), (tuple(layouts), tuple(layouts)[::-1])):
        why = UNSUPPORTED_TOGETHER.get((engine, rule_method, pair))
        if why is not None:
            both = " with ".join(LAYOUTS[layout] for layout in pair)
            what = both if rule_method == "*" else f"{METHODS[method]} with {both}"
            return f"{what} is not supported under macs_kernels' {engine} engine: {why}"
    return None


def check_together(engine: str, method: str, layouts: tuple[str, str]) -> None:
    """Raise NotImplementedError, naming the options, when `method` with both `layouts` cannot run on `engine`."""
    refusal = message_together(engine, method, layouts)
    if refusal is not None:
        raise NotImplementedError(refusal)


def check(engine: str, method: str, layout: str) -> None:
    """Raise NotImplementedError, naming the options, when `method` with `layout` cannot run on `engine`."""
    refusal = message(engine, method, layout)
    if refusal is not None:
        raise NotImplementedError(refusal)


def attention_method(attention: str) -> str:
    """The method of MacsConfig.attention: "efficient" and "norm" name theirs; softmax rows are "exact"."""
    return "exact" if attention == "softmax" else attention


def method_of(config) -> str:
    """The method a MacsConfig selects (AT2 features are asked for separately)."""
    if config.attention != "softmax":
        return attention_method(config.attention)
    return "fused" if config.fused_decode else "exact"


def check_method(engine: str, method: str) -> None:
    """Raise NotImplementedError, naming the option, when `engine` refuses `method` in every layout (a rule whose
    layout is "*"): asked before any work, whatever the request's layout."""
    check(engine, method, "greedy")


def markdown_table() -> str:
    """The support table as Markdown (docs/architecture.md embeds it; tests/test_docs.py keeps the two equal):
    one row per layout, one column per engine, each cell the methods that run there; then each refusal's
    reason."""
    header = ["layout", *ENGINES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for layout, description in LAYOUTS.items():
        cells = []
        for engine in ENGINES:
            running = [method for method in METHODS if not unsupported(engine, method, layout)]
            cells.append("all" if len(running) == len(METHODS) else ", ".join(running) or "none")
        lines.append(f"| {layout}: {description} | " + " | ".join(cells) + " |")
    lines += ["", "| engine | method | layout | why it is refused |", "|---|---|---|---|"]
    lines += [f"| {engine} | {method} | {layout} | {why} |" for (engine, method, layout), why in UNSUPPORTED.items()]
    lines += [f"| {engine} | {method} | {' + '.join(layouts)} | {why} |"
              for (engine, method, layouts), why in UNSUPPORTED_TOGETHER.items()]
    return "\n".join(lines) + "\n"
