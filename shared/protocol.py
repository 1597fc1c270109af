"""OpenAI request/response schemas (completions, chat, streaming chunks, errors, models).

Requests accept OpenAI's fields plus vLLM's sampling extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens). OpenAI
fields we cannot honour (structured output, tool calling) are refused with a 400."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import InvalidRequestError
from .sampling_params import SamplingParams


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


MAX_N = 128  # OpenAI's limit on choices per request (the engine's KV pool may allow fewer)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    # Unknown fields are ignored (as vLLM does); OpenAI fields that would change the output but
    # that we cannot honour are declared, so that they can be refused.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    response_format: dict[str, Any] | None = None  # only {"type": "text"}: no structured output yet
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Isolates this request's prefix-cache blocks from requests with another salt (from part 07;
    # without a prefix cache nothing is shared, so earlier parts have nothing to isolate).
    cache_salt: str | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n > MAX_N:
            raise InvalidRequestError(f"n must be at most {MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", "stream_options")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequestError(f"response_format of type {self.response_format.get('type')!r} is not "
                                      f"supported yet (only \"text\")", "response_format")
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias())

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers)", "logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        return self._sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        # Only an assistant turn may lack content (OpenAI: it then carries tool calls).
        if self.content is None and self.role in ("system", "user", "developer"):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool and function calling: not supported, so refused rather than silently ignored.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} (tool calling) is not supported yet", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise InvalidRequestError(f"{name} (tool calling) is not supported yet", name)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm-course"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
