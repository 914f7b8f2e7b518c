"""Request bodies of the OpenAI-compatible endpoints, validated before any generation.

Every option is honoured or refused by name: the OpenAI fields this server cannot honour (logprobs, tools,
penalties, ...) are accepted only at the values that ask for nothing.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from macs_kernels.apps.serve.sampling import Sampling
from macs_kernels.core.config import ATTENTIONS, DEFAULT_ALPHA, MacsConfig
from macs_kernels.ops import POOLINGS


def _unicode(value):
    """`value` if every string in it is Unicode text; JSON's \\uD800-\\uDFFF escapes can make a string that
    is not (a lone UTF-16 surrogate), which no tokenizer reads. Checked before the field's own validation, so
    the error names the field, not a member of its type."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the text holds a lone surrogate U+{ord(value[error.start]):04X} at character "
                             f"{error.start}, which is not Unicode text; send it as a pair or drop it") from None
    elif isinstance(value, (list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            _unicode(item)
    return value


class AttributionOptions(BaseModel):
    """`"attribution": true` or an object of these (any object means: attribute this request).

    source: text that ends the last user message (for example the context of a QA prompt); its tokens
        become the attribution's source_span, which the heatmap colours.
    """

    model_config = ConfigDict(extra="forbid")

    alpha: float = Field(DEFAULT_ALPHA, strict=False)
    pooling: Literal[POOLINGS] = "max"  # type: ignore[valid-type]
    redistribute: StrictBool = True
    attention: Literal[ATTENTIONS] = "softmax"  # type: ignore[valid-type]
    fused_decode: StrictBool = False
    method: Literal["macs", "at2"] = "macs"
    source: StrictStr | None = None

    _check_unicode = field_validator("source", mode="before")(_unicode)

    @field_validator("alpha", mode="before")
    @classmethod
    def _number(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("alpha must be a number in (0, 1]")
        return value

    def macs_config(self) -> MacsConfig:
        return MacsConfig(alpha=float(self.alpha), pooling=self.pooling, redistribute=self.redistribute,
                          attention=self.attention, fused_decode=self.fused_decode)

    @model_validator(mode="after")
    def _valid(self):
        self.macs_config()  # one set of rules for every entry point; its ValueError names the field
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    include_obfuscation: Literal[False] | None = None  # no padding fields are added to the chunks


# OpenAI request fields this server cannot honour, with the values that ask for nothing (accepted as such);
# any other value is refused by name, so that nothing is accepted and then ignored.
_NEUTRAL = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "verbosity": (None,), "moderation": (None,), "user": (None,),
    "metadata": (None,), "store": (None, False), "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,), "prompt_cache_options": (None,), "prompt_cache_retention": (None,),
    "safety_identifier": (None,), "suffix": (None, ""), "echo": (None, False),
}
_CHAT_ONLY = ("top_logprobs", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
              "response_format", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
              "verbosity", "moderation", "metadata", "store", "service_tier", "prompt_cache_key",
              "prompt_cache_options", "prompt_cache_retention", "safety_identifier")
_COMPLETIONS_ONLY = ("suffix", "echo")
MAX_STOP = 4  # OpenAI's limit on stop sequences
# Far above any stop sequence in use; the matcher costs O(new text) per token whatever the length, but each stop
# string is held and its prefix table built per request.
MAX_STOP_CHARS = 1000
MAX_CHOICES = 128  # OpenAI's limit on n
# The smallest temperature that samples: logits divided by less overflow float32 (1e-300 made the probabilities
# inf and NaN); 0 is greedy.
MIN_TEMPERATURE = 1e-3
_RANGES = {  # field -> (its test, the values it takes)
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "max_completion_tokens": (lambda v: v >= 1, "at least 1"),
    "n": (lambda v: 1 <= v <= MAX_CHOICES, f"in [1, {MAX_CHOICES}]"),
    "temperature": (lambda v: v == 0 or MIN_TEMPERATURE <= v <= 2, f"0 (greedy) or in [{MIN_TEMPERATURE}, 2]"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 1, "at least 1"),
    "seed": (lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
}


def _unhonoured(value, info: ValidationInfo):
    if value is not None and not any(value == neutral and isinstance(value, bool) == isinstance(neutral, bool)
                                     for neutral in _NEUTRAL[info.field_name] if neutral is not None):
        raise ValueError(f"{info.field_name}={value!r} is not supported by this server; omit it")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    attribution: AttributionOptions | None = None
    n: StrictInt = 1
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    user: Any = None

    _check_unhonoured = field_validator(*(name for name in _NEUTRAL if name not in _CHAT_ONLY + _COMPLETIONS_ONLY),
                                        mode="before")(_unhonoured)
    _check_unicode = field_validator("model", "stop", "prompt", mode="before", check_fields=False)(_unicode)

    @field_validator("attribution", mode="before")
    @classmethod
    def _switch(cls, value):
        if value is True:
            return {}
        if value is False or value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("attribution must be true, false or an object of options "
                             "(alpha, pooling, redistribute, attention, fused_decode, method, source)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @field_validator(*_RANGES, check_fields=False)
    @classmethod
    def _in_range(cls, value, info: ValidationInfo):
        valid, allowed = _RANGES[info.field_name]
        if value is not None and not valid(value):
            raise ValueError(f"{info.field_name} must be {allowed}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > MAX_STOP or not all(stops)):
            raise ValueError(f"stop takes up to {MAX_STOP} non-empty strings")
        longest = max(map(len, stops or ()), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {longest} characters; this server takes up to {MAX_STOP_CHARS}")
        return value

    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self) -> list[Sampling]:
        """Each choice's sampling. Without temperature, top_p or top_k the server decodes greedily (OpenAI would
        sample at temperature 1; greedy answers are explain()'s); with top_p or top_k alone, temperature is 1.
        Choice 0 draws with `seed` itself, so it is the answer of the same request with n = 1; choice i > 0 with
        the i-th number of a stream seeded by it."""
        sampled = self.temperature not in (None, 0) or (
            self.temperature is None and (self.top_p is not None or self.top_k is not None))
        if not sampled:
            return [Sampling()] * self.n
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        seeds: list[int | None] = [self.seed] * self.n
        if self.seed is not None and self.n > 1:
            stream = torch.Generator().manual_seed(self.seed)
            seeds[1:] = torch.randint(0, 2**62, (self.n - 1,), generator=stream).tolist()
        top_p = None if self.top_p is None else float(self.top_p)
        return [Sampling(temperature, self.top_k, top_p, seed) for seed in seeds]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[dict]

    _check_unicode = field_validator("content", mode="before")(_unicode)

    @field_validator("content")
    @classmethod
    def _parts(cls, value, info: ValidationInfo):
        """Content parts: text parts joined (as OpenAI reads them) unless the message holds images, whose parts
        are then kept in order; image parts are base64 data URLs in user messages; any other kind is refused by
        its type."""
        if isinstance(value, str):
            return value
        images = False
        for part in value:
            kind = part.get("type")
            if kind == "text":
                if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                    raise ValueError(f"a text part is {{\"type\": \"text\", \"text\": <string>}}, got keys "
                                     f"{sorted(part)}")
            elif kind == "image_url":
                _check_image_part(part, info.data.get("role"))
                images = True
            else:
                raise ValueError(f"content parts of type {kind!r} are not supported by this server: it reads text "
                                 "and image_url parts only")
        return value if images else "".join(part["text"] for part in value)

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, data URL) of the message's image parts, in order."""
        return [] if isinstance(self.content, str) else [
            (p, part["image_url"]["url"]) for p, part in enumerate(self.content) if part["type"] == "image_url"]

    def as_template(self) -> dict:
        """The message for the tokenizer's chat template (a message without images)."""
        # OpenAI's developer messages are the system messages of newer models; chat templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}

    def as_image_template(self) -> dict:
        """The message for a vision-language processor's chat template: its parts in order, an image as
        {"type": "image"} (the processor takes the pictures separately, in the same order)."""
        parts = [{"type": "text", "text": self.content}] if isinstance(self.content, str) else [
            {"type": "image"} if part["type"] == "image_url" else part for part in self.content]
        return self.as_template() | {"content": parts}


def _check_image_part(part: dict, role: str | None) -> None:
    """An image part is {"type": "image_url", "image_url": {"url": <base64 data URL>, "detail": "auto"}}, in a
    user message (OpenAI's rule); the pictures are decoded later, in a worker thread."""
    from macs_kernels.apps.serve.images import check_image_url

    image = part.get("image_url")
    if set(part) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str):
        raise ValueError("an image part is {\"type\": \"image_url\", \"image_url\": {\"url\": <data URL>}}, got "
                         f"keys {sorted(part)}")
    if not set(image) <= {"url", "detail"}:
        raise ValueError(f"image_url takes url and detail, got {sorted(image)}")
    if image.get("detail", "auto") != "auto":
        raise ValueError(f"image_url.detail={image['detail']!r} is not supported by this server (the model's "
                         "processor sizes the image); omit it or send \"auto\"")
    if role != "user":
        raise ValueError(f"image_url parts are allowed in user messages only, not in a {role} message")
    check_image_url(image["url"])


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None

    _check_chat_unhonoured = field_validator(*_CHAT_ONLY, mode="before")(_unhonoured)

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value, info: ValidationInfo):
        if value is not None:
            given = info.data.get("max_tokens")
            if given is not None and given != value:
                raise ValueError(f"max_tokens={given} and max_completion_tokens={value} disagree; send one of them")
        return value

    @model_validator(mode="after")
    def _limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt]
    echo: Any = None
    suffix: Any = None
    best_of: StrictInt | None = None

    _check_completion_unhonoured = field_validator(*_COMPLETIONS_ONLY, mode="before")(_unhonoured)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError(f"best_of={value} is not supported by this server (it returns every choice it "
                             "generates); omit it or send best_of = n")
        return value
