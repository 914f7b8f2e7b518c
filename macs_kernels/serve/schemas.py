"""Request bodies of the OpenAI-compatible endpoints, validated before any generation.

Only greedy decoding is served (one generation config for the whole continuous batch), so sampling
options are accepted only at their greedy values and refused otherwise, naming the option.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from ..config import ATTENTIONS, POOLINGS, MacsConfig


class AttributionOptions(BaseModel):
    """`"attribution": true` or an object of these (any object means: attribute this request).

    source: text that ends the last user message (for example the context of a QA prompt); its tokens
        become the attribution's source_span, which the heatmap colours.
    """

    model_config = ConfigDict(extra="forbid")

    alpha: float = Field(0.8, strict=False)
    pooling: Literal[POOLINGS] = "max"  # type: ignore[valid-type]
    redistribute: StrictBool = True
    attention: Literal[ATTENTIONS] = "softmax"  # type: ignore[valid-type]
    fused_decode: StrictBool = False
    method: Literal["macs", "at2"] = "macs"
    source: StrictStr | None = None

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


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    attribution: AttributionOptions | None = None
    n: Literal[1] = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None

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

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value):
        if value is not None and value < 1:
            raise ValueError("max_tokens must be at least 1")
        return value

    @field_validator("temperature")
    @classmethod
    def _greedy_temperature(cls, value):
        if value not in (None, 0):
            raise ValueError(f"temperature={value}: this server decodes greedily; send 0 or omit it")
        return value

    @field_validator("top_p")
    @classmethod
    def _greedy_top_p(cls, value):
        if value not in (None, 1):
            raise ValueError(f"top_p={value}: this server decodes greedily; send 1 or omit it")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
            if self.max_completion_tokens < 1:
                raise ValueError("max_completion_tokens must be at least 1")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt]
    echo: Literal[False] = False
