"""The OpenAI request bodies the gateway accepts, and how they map onto specd's SamplingParams.

Unknown top-level fields are rejected (400), as SamplingParams rejects unknown settings: a typo must
not silently become a default. Standard OpenAI fields fall in three groups:
- mapped: model, prompt / messages, max_tokens (max_completion_tokens), temperature, top_p, seed, stop,
  stream, stream_options.include_usage;
- accepted and ignored because they do not change the output: user, metadata, store, service_tier,
  parallel_tool_calls;
- accepted only at their neutral value, else 400 "unsupported": n (1), best_of (1), echo (false),
  logprobs (null/false), top_logprobs (null), suffix (null), presence_penalty and frequency_penalty
  (0), logit_bias (empty), tools (empty), tool_choice ("none"), response_format ({"type": "text"}).
Extensions (as vLLM spells them): top_k, ignore_eos, stop_token_ids, session (kvd session hint), and
speculation ({"method", "schedule", "num_speculative_tokens"}, specd's own; see docs/design/speculation.md).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specd.sampling_params import SamplingParams, SpeculationParams


class UnsupportedValue(ValueError):
    """A standard field set to a value specd does not implement (400, ``param`` names it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    session: str | None = None
    # {"method", "schedule", "num_speculative_tokens"}: overrides the deployment's speculation
    speculation: SpeculationParams | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        """(field, is it at a value we cannot honour) for every accepted-only-at-neutral field."""
        return [("n", self.n != 1), ("presence_penalty", self.presence_penalty != 0),
                ("frequency_penalty", self.frequency_penalty != 0), ("logit_bias", bool(self.logit_bias))]

    def check_supported(self) -> None:
        for name, bad in self.unsupported():
            if bad:
                raise UnsupportedValue(name, f"'{name}'={getattr(self, name)!r} is not supported by specd")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self) -> SamplingParams:
        """The engine's settings; raises pydantic ValidationError (400) for out-of-range values."""
        values: dict[str, Any] = {"max_tokens": self._max_tokens(), "temperature": self.temperature,
                                  "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
                                  "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                                  "stop": [self.stop] if isinstance(self.stop, str) else self.stop}
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Common):
    """POST /v1/completions. ``prompt``: text, token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        return super().unsupported() + [
            ("best_of", self.best_of not in (None, 1)), ("echo", self.echo),
            ("logprobs", self.logprobs is not None), ("suffix", self.suffix is not None),
            ("prompt", isinstance(self.prompt, list) and len(self.prompt) > 1
             and not isinstance(self.prompt[0], int))]

    def single_prompt(self) -> str | list[int]:
        """The one prompt; batches (several prompts) are refused by ``check_supported``."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return self.prompt[0]
        return self.prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_max(self) -> "ChatCompletionRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("set max_tokens or max_completion_tokens, not both")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> list[tuple[str, bool]]:
        return super().unsupported() + [
            ("logprobs", self.logprobs), ("top_logprobs", self.top_logprobs is not None),
            ("tools", bool(self.tools)), ("tool_choice", self.tool_choice not in (None, "none")),
            ("response_format", self.response_format not in (None, {"type": "text"}))]

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
