"""explain(), stream() and Explanation: one line from a model and a prompt to per-token attributions."""
from __future__ import annotations

import copy
import dataclasses
import json
import queue
import threading

import numpy as np
import torch

from macs_kernels.api.alignment import user_span
from macs_kernels.api.generation import (
    check_context,
    check_tokenizer,
    decode_text,
    decode_tokens,
    encode_prompts,
    eos_ids,
    generation_kwargs,
    pad_id,
)
from macs_kernels.api.prompts import is_messages
from macs_kernels.core import support
from macs_kernels.core.config import DEFAULT_ALPHA, MacsConfig, config_of, option_names
from macs_kernels.core.scores import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    LOG_C_DIGITS,
    SCORE_DEFINITION,
    SCORE_DIGITS,
    TOP_TOKENS,
    json_values,
    log_zscores,
    paper_zscores,
    whole_answer_scores,
)
from macs_kernels.engines.generate import attach, check_generate
from macs_kernels.engines.hf_models import check_model

__all__ = ["AGGREGATIONS", "DEFAULT_AGGREGATION", "SCORE_DEFINITION", "Explanation", "build_explanation", "explain",
           "explain_continuous", "json_values", "log_zscores", "stream", "whole_answer_scores"]


@dataclasses.dataclass
class Explanation:
    """MACS attributions of one generation.

    The score family, each derived from step_log_c by one named score of the registry macs_kernels.core.SCORES
    (its definition there, next to its code):
    step_log_c: (steps, N) float32; row k is the log consistency of the N prompt tokens in the forward pass
        that produced generated_ids[k] (row 0 comes from the prefill's last query). The data.
    step_scores: (steps, N) float32, "log_z": the z-scores of each row's log c: which prompt tokens step k looked
        at. They rank the prompt tokens exactly as step_log_c does; the engines' row readers (Tracer.rows,
        request_rows) return the same.
    scores: (N,) float32, the whole-answer score (DEFAULT_AGGREGATION, "max_plus_run_minus_mean_sinkless_z":
        the largest of a token's step z-scores minus their mean over steps, each step standardised without its
        top token, the attention sink; plus the token's best copied run minus that mean, a run being 3
        consecutive steps attending to 3 consecutive prompt tokens), what the CLI and the pages show by default.
    whole_answer(how): the whole-answer score by another name of AGGREGATIONS: "max_minus_mean_sinkless_z" (the
        same without the runs), "max_minus_mean_z" (that over step_scores), "max_z", "mean_z", "mean_log_c"
        (z-scores of the mean log c), "paper_mean_z".
    paper_step_scores, paper_scores: the paper's z-scores of c = exp(log c) per step and their mean over
        steps (= whole_answer("paper_mean_z")), for comparison with the paper; they tie for every token but
        the attention sink.
    source_span: optional [start, end) token range of the prompt that the caller treats as the source
        (for example the context inside a QA prompt); top_k ranks inside it and the views show it by default
        (span="all" for the whole prompt). explain() sets it to the last user message's text of a chat prompt
        (None for input_ids).
    images: a prompt with images (explain(..., images=)): each image's tokens among the prompt tokens and its
        token grid (macs_kernels.api.vision.ImageTokens, in prompt order); macs_kernels.api.vision maps scores onto
        them.
    """

    input_ids: torch.Tensor
    generated_ids: torch.Tensor
    input_tokens: list[str]
    generated_tokens: list[str]
    step_log_c: torch.Tensor
    config: dict
    text: str = ""
    source_span: tuple[int, int] | None = None
    images: list | None = None

    @property
    def step_scores(self) -> torch.Tensor:
        return log_zscores(self.step_log_c)

    @property
    def scores(self) -> torch.Tensor:
        return whole_answer_scores(self.step_log_c)

    def whole_answer(self, how: str = DEFAULT_AGGREGATION) -> torch.Tensor:
        """(N,) whole-answer score by the name `how` (AGGREGATIONS); the default is `scores`."""
        return whole_answer_scores(self.step_log_c, how)

    @property
    def paper_step_scores(self) -> torch.Tensor:
        return paper_zscores(self.step_log_c)

    @property
    def paper_scores(self) -> torch.Tensor:
        return self.whole_answer("paper_mean_z")

    def score_row(self, step: int | None = None, how: str | None = None) -> torch.Tensor:
        """(N,) step_scores[step], or the whole-answer score when step is None (`scores`, or the aggregation
        named `how`); negative steps count from the end."""
        if how is not None and step is not None:
            raise ValueError("give a step or an aggregation (how), not both")
        if step is None:
            return self.scores if how is None else self.whole_answer(how)
        steps = len(self.step_log_c)
        if isinstance(step, bool) or not isinstance(step, int) or not -steps <= step < steps:
            raise ValueError(f"step {step!r} is out of range: {steps} tokens were generated")
        return self.step_scores[step]

    def span_range(self, span=None) -> tuple[int, int]:
        """[start, end) of `span`: None is the default, the source_span when there is one (a chat prompt's user
        text, a QA prompt's context) and else the whole prompt; True the source_span; "all" the whole prompt
        (the chat template's tokens included); or a (start, end) pair. Every view ranks and colours this."""
        n = len(self.input_tokens)
        if span is None:
            span = default_span(self.source_span, n)
        if isinstance(span, str) and span == "all":
            return 0, n
        if span is True:
            if self.source_span is None:
                raise ValueError("span=True needs a source_span; this explanation has none")
            span = self.source_span
        if (isinstance(span, bool) or not isinstance(span, (tuple, list)) or len(span) != 2
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in span)):
            raise ValueError(f"span must be None, True, \"all\" or a (start, end) pair of token indices, got {span!r}")
        start, end = span
        if not 0 <= start < end <= n:
            raise ValueError(f"span [{start}, {end}) is not a non-empty range of the {n} prompt tokens")
        return start, end

    def top_k(self, k: int, step: int | None = None, span=None, how: str | None = None) -> list[tuple[int, str, float]]:
        """The k highest-scoring prompt tokens as (token index, token text, score), best first.

        step: a generated token's row (default: `scores`, the whole answer; how: another aggregation of
        AGGREGATIONS for the whole answer). span: as span_range's; by default the source_span when there is
        one (a free chat prompt's user text: not the template's tokens), else every prompt token; "all" ranks
        every prompt token. Indices stay prompt indices. Fewer than k tokens in the span return them all;
        equal scores keep prompt order.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        start, end = self.span_range(span)
        row = self.score_row(step, how)[start:end]
        order = torch.sort(row, descending=True, stable=True).indices[:k].tolist()
        return [(start + i, self.input_tokens[start + i], float(row[i])) for i in order]

    def as_dict(self) -> dict:
        """The data and the views' scores, each once, at the precision it has: step_log_c to LOG_C_DIGITS
        significant digits, the z-scores to SCORE_DIGITS decimals; the paper's scores, which step_log_c gives
        (paper_zscores), are left out. top_tokens: the TOP_TOKENS best of `scores` in the default span
        (top_k's)."""
        best = self.top_k(TOP_TOKENS)
        return {
            "input_ids": self.input_ids.tolist(),
            "generated_ids": self.generated_ids.tolist(),
            "input_tokens": self.input_tokens,
            "generated_tokens": self.generated_tokens,
            "text": self.text,
            "score_definition": SCORE_DEFINITION,
            "step_scores": json_values(self.step_scores, SCORE_DIGITS),
            "scores": json_values(self.scores, SCORE_DIGITS),
            "aggregation": DEFAULT_AGGREGATION,
            "top_tokens": [{"index": i, "token": token, "score": score} for (i, token, _), score in zip(
                best, json_values(torch.tensor([score for _, _, score in best]), SCORE_DIGITS))],
            "step_log_c": _significant(self.step_log_c, LOG_C_DIGITS),
            "config": self.config,
            "source_span": list(self.source_span) if self.source_span else None,
            **({"images": [tokens.as_dict() for tokens in self.images]} if self.images else {}),
        }

    def to_json(self, **dumps_kwargs) -> str:
        """The fields as JSON (as_dict); -inf values (attention underflow at alpha = 1) become null."""
        return json.dumps(self.as_dict(), **dumps_kwargs)

    def to_html(self, title: str = "MACS attribution") -> str:
        """A self-contained page: hovering or clicking a generated token shows that step's heatmap (with images:
        on each image and on the text)."""
        if self.images:
            from macs_kernels.api.vision.render import image_html

            return image_html(self, title=title)
        from macs_kernels.api.viz import explanation_html

        return explanation_html(self, title=title)


def default_span(source_span, n: int) -> tuple[int, int]:
    """[start, end) of the prompt tokens every view ranks and colours unless told otherwise (top_k, the
    terminal, the pages, the server's heat): the source span when there is one, else all n prompt tokens."""
    return (source_span[0], source_span[1]) if source_span else (0, n)


def _significant(values: torch.Tensor, digits: int) -> list:
    """Nested lists of `values` rounded to `digits` significant digits (each the float closest to its short
    decimal, so JSON writes it short), -inf as None."""
    x = values.double().numpy()
    rounded = np.isfinite(x) & (x != 0)
    exponent = np.floor(np.log10(np.abs(np.where(rounded, x, 1.0)))) - (digits - 1)
    # Scaled by exact powers of ten: the division (or product) gives the double nearest the short decimal.
    up, down = 10.0 ** np.maximum(-exponent, 0), 10.0 ** np.maximum(exponent, 0)
    short = np.where(exponent < 0, np.round(x * up) / up, np.round(x / down) * down)
    return json_values(torch.from_numpy(np.where(rounded, short, x)))


def build_explanation(tokenizer, input_ids, generated_ids, step_log_c: torch.Tensor, config: dict, *, text=None,
                      input_tokens=None, source_span=None, images=None, label: str = "the generation") -> Explanation:
    """The Explanation of one generation, however it ran (generate, continuous batching, vLLM, the server).

    input_ids, generated_ids: the prompt's and the answer's token ids (sequences or tensors); step_log_c: one row
    per generated token over the prompt tokens, else a RuntimeError names the mismatch and `label` (whose). Token
    texts come from the tokenizer (or "#id" without one) unless given: input_tokens (the caller decoded the prompt
    already), text (the engine's own detokenised answer)."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).cpu()
    generated_ids = torch.as_tensor(generated_ids, dtype=torch.long).cpu()
    if tuple(step_log_c.shape) != (len(generated_ids), len(input_ids)):
        raise RuntimeError(f"{label}: {tuple(step_log_c.shape)} MACS rows for {len(generated_ids)} generated tokens "
                           f"of a {len(input_ids)}-token prompt")
    generated = generated_ids.tolist()
    return Explanation(
        input_ids=input_ids, generated_ids=generated_ids,
        input_tokens=decode_tokens(tokenizer, input_ids.tolist()) if input_tokens is None else input_tokens,
        generated_tokens=decode_tokens(tokenizer, generated), step_log_c=step_log_c, config=config,
        text=decode_text(tokenizer, generated) if text is None else text, source_span=source_span, images=images,
    )


def _explanations(tracer, tokenizer, ids, mask, generated, config, spans, layouts=None) -> list[Explanation]:
    """One Explanation per returned sequence, in generate's order (prompt-major: sequence i continues
    prompt i // k with k sequences per prompt). A sequence's tokens are its tracer rows': they end where
    generate stopped it (its end-of-sequence token or a stop string's last token, included), never on the
    pads generate appends while other sequences go on. spans: each prompt's source span (or None); layouts:
    each prompt's ImageTokens (prompts with images)."""
    per_prompt = generated.shape[0] // ids.shape[0]
    result = []
    for i in range(generated.shape[0]):
        b = i // per_prompt
        log_c, _ = tracer.rows(i)
        result.append(build_explanation(
            tokenizer, ids[b][mask[b].bool()], generated[i, :len(log_c)], log_c,
            config.as_dict() | {"backend": tracer.backend}, source_span=spans[b],
            images=None if layouts is None else layouts[b],
        ))
    return result


def _user_spans(tokenizer, prompt, input_ids, batched) -> list:
    """Each prompt's default source span: the user's own text of a chat prompt (None for token ids)."""
    if input_ids is not None:
        return [None]
    return [user_span(tokenizer, p) for p in (prompt if batched else [prompt])]


def _text_tokenizer(tokenizer, images):
    """(tokenizer, processor): a vision-language model's processor (explain's second argument, needed with images=)
    reads the text with its own tokenizer."""
    if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer, tokenizer
    return tokenizer, None if images is None else tokenizer


def _options(arguments: dict) -> MacsConfig:
    """The MacsConfig of an entry point's arguments (`locals()` on entry): those named as MacsConfig's options, the
    one list of them. Built once per call and passed on as the object."""
    return MacsConfig(**{name: arguments[name] for name in option_names()})


def _prepare(model, tokenizer, prompt, input_ids, max_new_tokens, config, generate_kwargs, processor=None,
             images=None):
    """Every check explain() and stream() make before any generation; with images, the processor's image inputs
    join the generate arguments and the prompts' image layouts come back (else None)."""
    check_model(model)
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"{type(model).__name__} cannot generate: explain a model with its language-model head (a "
                        "...ForCausalLM or ...ForConditionalGeneration), not its base model")
    layouts = None
    if images is None:
        if prompt is not None and tokenizer is not None:
            check_tokenizer(model, tokenizer)
        ids, mask, batched = encode_prompts(tokenizer, prompt, input_ids,
                                            vocab_size=model.get_input_embeddings().num_embeddings)
    else:
        from macs_kernels.api.vision.inputs import encode_image_prompts

        if input_ids is not None:
            raise ValueError("images= takes a text prompt= (the processor places the image tokens), not input_ids")
        ids, mask, batched, image_inputs, layouts = encode_image_prompts(processor, model, prompt, images)
        generate_kwargs = {**generate_kwargs, **image_inputs}
    if generate_kwargs.get("return_dict_in_generate"):
        raise ValueError("return_dict_in_generate=True is not supported: explain() and stream() return the "
                         "generated ids with their attributions (Explanation.generated_ids); drop the option")
    kwargs = generation_kwargs(model, tokenizer, max_new_tokens, generate_kwargs)
    check_context(model, ids.shape[1], max_new_tokens)
    # A model whose generation config asks for a dict would make generate return one.
    kwargs["return_dict_in_generate"] = False
    plan = check_generate(model, kwargs, attention=config.attention, prompt_length=ids.shape[1])
    if plan.stop_strings:
        kwargs["tokenizer"] = tokenizer
    device = next(model.parameters()).device
    kwargs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    return config, ids.to(device), mask.to(device), batched, kwargs, plan, layouts


@torch.inference_mode()
def explain(model, tokenizer, /, prompt=None, *, input_ids=None, images=None, max_new_tokens=64, alpha=DEFAULT_ALPHA,
            pooling="max", redistribute=True, attention="softmax", backend=None, fused_decode=None, **generate_kwargs):
    """Generate from `prompt` and explain every generated token with MACS.

    prompt: a string (wrapped in the chat template when the tokenizer has one), a list of chat messages,
        or a list of either (one left-padded batch).
    input_ids: (N,) or (1, N) token ids used as the prompt as they are (instead of `prompt`). With them the
        tokenizer may be None: the model's generation config then gives the pad and end-of-sequence ids, the
        tokens are named by their ids ("#id") and `text` is empty.
    generate_kwargs: passed to `model.generate` (greedy decoding unless they say otherwise); stop_strings=
        hands generate this `tokenizer` (a tokenizer= among them must be the same object). Supported modes:
        greedy, sampling, beam search (num_beams, length_penalty, early_stopping), several returned sequences
        (num_return_sequences), static caches (cache_implementation="static" or a StaticCache),
        assisted decoding (assistant_model=, prompt_lookup_num_tokens=), and a continued conversation:
        cache=<the cache of the earlier turns> (or past_key_values=, its name before transformers 5.24; either
        reaches generate by the keyword the model takes) with input_ids = every token of all turns, whose
        inputs are then every token before the new generation. Other modes raise before generating.
    Returns one Explanation, or a list when there are several prompts or num_return_sequences > 1 (P
    prompts with k sequences each: P * k, prompt-major, in generate's order). Each sequence ends where
    generate stopped it: at its end-of-sequence token or the last token of a stop string (included), or
    after max_new_tokens; the pads generate appends while other sequences go on are not part of it.
    fused_decode: see MacsConfig (None: the backend's default; True on the torch backend reads the key
    cache once per decode step, computing the attention output itself).
    continuous_batching=True: run the prompts through transformers' continuous-batching engine
        (`model.generate_batch`, greedy; macs_kernels.api.explanation.explain_continuous), one Explanation per
        prompt; `continuous_batching_config=` passes the engine's ContinuousBatchingConfig.
    images: a vision-language model's prompt with images (PIL images or paths): one image or a list of them for
        one prompt, one entry per prompt for a list of prompts; `tokenizer` is then the model's processor. The
        inputs are every prompt token, image tokens included; Explanation.images says where each image's tokens
        lie (macs_kernels.api.vision maps their scores onto the image).
    """
    config = _options(locals())
    tokenizer, processor = _text_tokenizer(tokenizer, images)
    if generate_kwargs.pop("continuous_batching", False):
        if images is not None:
            raise NotImplementedError("continuous batching cannot take images: transformers' continuous-batching "
                                      "engine (generate_batch) feeds the model token ids only, no pixel_values")
        # The engine runs its loop in a thread of its own, where tensors made in inference mode are read-only.
        with torch.inference_mode(False):
            return _explain_continuous(model, tokenizer, prompt, input_ids, max_new_tokens, generate_kwargs, config)
    config, ids, mask, batched, kwargs, plan, layouts = _prepare(
        model, tokenizer, prompt, input_ids, max_new_tokens, config, generate_kwargs, processor, images,
    )
    with attach(model, config=config) as tracer:
        output = model.generate(ids, attention_mask=mask, **kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    generated = sequences[:, ids.shape[1]:]
    # A prompt with images has no user span: the image tokens sit inside the user's message.
    spans = _user_spans(tokenizer, prompt, input_ids, batched) if images is None else [None] * ids.shape[0]
    explanations = _explanations(tracer, tokenizer, ids, mask, generated, config, spans, layouts)
    return explanations if batched or plan.num_return_sequences > 1 else explanations[0]


def _explain_continuous(model, tokenizer, prompt, input_ids, max_new_tokens, generate_kwargs, config: MacsConfig):
    from macs_kernels.engines.continuous import generate_options

    engine = generate_options(generate_kwargs, support.method_of(config))
    if input_ids is not None or prompt is None:
        raise ValueError("continuous_batching=True takes prompt= (a string, chat messages or a list of them), "
                         "not input_ids")
    batched = isinstance(prompt, list) and not is_messages(prompt)
    prompts = prompt if batched else [prompt]
    explanations = explain_continuous(model, tokenizer, prompts, max_new_tokens=max_new_tokens, config=config,
                                      **engine)
    return explanations if batched else explanations[0]


class _StepStreamer:
    """A generate() streamer that forwards each new token with its step's scores (log_zscores) to a queue."""

    def __init__(self, tracer, sink: queue.Queue):
        self.tracer, self.sink, self.prompt_seen, self.step = tracer, sink, False, 0

    def put(self, value):
        if not self.prompt_seen:  # generate() first pushes the prompt
            self.prompt_seen = True
            return
        # Assisted decoding pushes every token a verify pass accepted at once.
        for token in value.reshape(-1).tolist():
            log_c = self.tracer.row_log_c(0, self.step)
            self.sink.put((int(token), log_zscores(log_c)))
            self.step += 1

    def end(self):
        self.sink.put(None)


def stream(model, tokenizer, /, prompt=None, *, input_ids=None, images=None, max_new_tokens=64, alpha=DEFAULT_ALPHA,
           pooling="max", redistribute=True, attention="softmax", backend=None, fused_decode=None, **generate_kwargs):
    """Like explain() for one prompt and one sequence, but yields (token_id, scores (N,)) as each token is
    made: the row Explanation.step_scores would hold for that step. Beam search and num_return_sequences > 1
    pick their sequences at the end: use explain(). images: as explain()'s (`tokenizer` is then the processor;
    macs_kernels.api.vision.encode_image_prompts gives the image layouts)."""
    config = _options(locals())
    tokenizer, processor = _text_tokenizer(tokenizer, images)
    config, ids, mask, batched, kwargs, plan, _ = _prepare(
        model, tokenizer, prompt, input_ids, max_new_tokens, config, generate_kwargs, processor, images,
    )
    if batched:
        raise ValueError("stream() takes one prompt; use explain() for a batch")
    if plan.num_return_sequences > 1:
        raise ValueError(
            f"stream() yields one sequence; num_return_sequences={plan.num_return_sequences} needs explain()"
        )
    if plan.num_beams > 1:
        raise ValueError(f"stream() cannot follow beam search (num_beams={plan.num_beams}); use explain()")
    sink: queue.Queue = queue.Queue()
    stop = threading.Event()
    failure: list[BaseException] = []

    def run():
        from transformers import StoppingCriteria, StoppingCriteriaList

        class StopWhenAsked(StoppingCriteria):
            def __call__(self, input_ids, scores, **_):
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

        # The caller's own criteria stop the sequence too, alongside the consumer leaving.
        criteria = StoppingCriteriaList([*(kwargs.pop("stopping_criteria", None) or []), StopWhenAsked()])
        try:
            with torch.inference_mode(), attach(model, config=config) as tracer:
                streamer = _StepStreamer(tracer, sink)
                model.generate(ids, attention_mask=mask, streamer=streamer, stopping_criteria=criteria, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
            failure.append(error)
            sink.put(None)

    worker = threading.Thread(target=run, name="macs-kernels-stream", daemon=True)
    worker.start()
    try:
        while (item := sink.get()) is not None:
            yield item
    finally:
        stop.set()
        worker.join()
    if failure:
        raise failure[0]


def explain_continuous(model, tokenizer, prompts, *, max_new_tokens=64, continuous_batching_config=None,
                       do_sample=False, temperature=None, top_k=None, top_p=None, config: MacsConfig | None = None,
                       **options):
    """Run `prompts` through `model.generate_batch` (greedy unless do_sample=True with temperature, top_k,
    top_p) and explain each with MACS (`explain(..., continuous_batching=True)` is the documented way in).

    prompts: a list of prompts (strings, wrapped in the chat template when the tokenizer has one, or lists of
        chat messages). Returns one Explanation per prompt, in prompt order, whose rows equal explain() of
        that prompt alone. continuous_batching_config: a transformers ContinuousBatchingConfig (page size,
        token budget, ...); flash attention, CUDA graphs and async batching stay off unless asked for (then
        they are refused: they bypass the traced attention). Without `num_blocks` in it, the paged cache
        holds exactly these prompts and their new tokens (sized from free memory, its allocation would dominate).
    config: the MacsConfig, or options: its fields.
    """
    from macs_kernels.engines.continuous import attach_continuous, batching_config_class, engine_config

    batching_config_class()
    macs_config = config_of(config, options)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts")
    check_model(model)
    vocab_size = model.get_input_embeddings().num_embeddings
    check_tokenizer(model, tokenizer)
    inputs = [encode_prompts(tokenizer, prompt, vocab_size=vocab_size)[0][0].tolist() for prompt in prompts]
    for ids in inputs:
        check_context(model, len(ids), max_new_tokens)
    continuous_batching_config = engine_config(continuous_batching_config, [len(ids) for ids in inputs],
                                               max_new_tokens)
    # explain() generates with the model's own generation config, greedy: so does this.
    generation_config = copy.deepcopy(model.generation_config)
    sampling = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                if value is not None}
    generation_config.update(max_new_tokens=max_new_tokens, do_sample=do_sample,
                             pad_token_id=pad_id(model, tokenizer), **sampling)
    ends = eos_ids(model, tokenizer)  # where explain() stops, so their answers agree
    if ends:
        generation_config.eos_token_id = sorted(ends)
    with attach_continuous(model, config=macs_config) as tracer:
        outputs = model.generate_batch(
            inputs, generation_config=generation_config, continuous_batching_config=continuous_batching_config,
        )
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(inputs)} prompts")
        explanations = []
        for prompt, prompt_ids, (request_id, output) in zip(prompts, inputs, outputs.items()):
            if output.error is not None:
                raise RuntimeError(f"request {request_id} failed in generate_batch: {output.error}")
            log_c, _ = tracer.request_rows(request_id)
            tracer.release(request_id)
            if list(output.prompt_ids) != prompt_ids:
                raise RuntimeError(f"request {request_id}: generate_batch answered another prompt than it was given")
            explanations.append(build_explanation(
                tokenizer, prompt_ids, output.generated_tokens, log_c,
                macs_config.as_dict() | {"backend": tracer.backend}, source_span=user_span(tokenizer, prompt),
                label=f"request {request_id}",
            ))
    return explanations

