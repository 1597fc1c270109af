"""Every field of vLLM's CompletionRequest / ChatCompletionRequest is honoured, refused, or logged.

A field the server drops in silence is a bug the client never sees: it asked for `bad_words` and
got them. So each field vLLM defines is one of three things here:
- implemented: declared, and carried into SamplingParams, the chat template or the scheduler
  (`bad_words`, `allowed_token_ids`, `truncate_prompt_tokens`, `spaces_between_special_tokens`,
  `priority`, `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`,
  `documents`, `reasoning_effort`; the sampling extras shared/protocol.py declares);
- refused: declared, and a value other than vLLM's default is a 400 naming the field (`REFUSED`:
  beam search, watermarking, multimodal inputs, token-id outputs, ...);
- unknown to both vLLM and this server: ignored, with one warning in the log naming them, as
  vLLM's OpenAIBaseModel logs them.
Fields that change no output (`user`, `session_id`, `return_token_offsets`, `return_mm_kwargs`, the
last two only read by vLLM's render endpoints) are accepted. The lesson's table lists them all.

Defaults: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take the
server's defaults (generation_config.py, `--generation-config`); its max_tokens is capped by the
model's max_new_tokens.

In vLLM: vllm/entrypoints/openai/completion/protocol.py (CompletionRequest),
vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest) and
vllm/entrypoints/serve/engine/protocol.py (OpenAIBaseModel's ignored-fields warning)."""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from shared.errors import InvalidRequestError

from .chat_template import RESERVED

log = logging.getLogger("vllm_course.server")

# Field -> (vLLM's default, why this server refuses another value)
REFUSED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not implemented"),
    "watermarking": (None, "watermarking is not implemented"),
    "logprob_token_ids": (None, "logprobs of chosen token ids are not implemented (use logprobs)"),
    "truncation_side": (None, "only truncation_side \"left\" (keep the last tokens) is implemented"),
    "return_tokens_as_token_ids": (None, "token-id strings in logprobs are not implemented"),
    "return_token_ids": (None, "token ids in responses are not implemented (use /tokenize)"),
    "repetition_detection": (None, "repetition detection is not implemented"),
    "thinking_token_budget": (None, "thinking token budgets are not implemented"),
    "stream_interval": (None, "stream_interval is not implemented (every token is streamed)"),
    "vllm_xargs": (None, "no extension reads vllm_xargs here"),
    "ec_transfer_params": (None, "encoder-cache transfer is not implemented (text-only models)"),
    "routed_experts_prompt_start": (0, "routed-expert outputs are not implemented"),
    "prompt_embeds": (None, "prompt embeddings are not supported (send text or token ids)"),
    "media_io_kwargs": (None, "multimodal inputs are not supported"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "chat_template": (None, "a request's own chat template is not accepted (use the server's --chat-template)"),
    "return_prompt_text": (None, "prompt text in responses is not implemented (use /tokenize)"),
}
# OpenAI's defaults each request starts from; --generation-config replaces the unset ones.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RequestFields(BaseModel):
    """vLLM's fields both endpoints take (mixed in first: its to_sampling_params wraps the rest)."""
    bad_words: list[str] = Field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    spaces_between_special_tokens: bool = True
    session_id: str | None = None  # vLLM: a routing hint; changes no output
    return_token_offsets: bool | None = False  # vLLM reads it on its render endpoints only
    return_mm_kwargs: bool = True  # ...likewise
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    logprob_token_ids: list[int] | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    vllm_xargs: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            ignored = set(data) - known
            if ignored:
                log.warning("The following fields were present in the request but ignored: %s", ignored)
        return data

    def _refuse_unsupported(self) -> None:
        for name, (default, why) in REFUSED.items():
            value = getattr(self, name, default)
            if value is not None and value != default and not (name == "truncation_side" and value == "left"):
                raise InvalidRequestError(f"{name}: {why}", name)
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            # The detokenizer decodes windows of ids with the tokenizer, which joins added tokens its way.
            raise InvalidRequestError("spaces_between_special_tokens: false is not implemented with "
                                      "skip_special_tokens: false", "spaces_between_special_tokens")

    def to_sampling_params(self, defaults: dict | None = None):
        """SamplingParams with vLLM's extra fields; `defaults`: the server's (--generation-config)."""
        self._refuse_unsupported()
        params = super().to_sampling_params()
        given = {k for k in self.model_fields_set if getattr(self, k, None) is not None}
        updates = {k: v for k, v in (defaults or {}).items() if k in SAMPLING_DEFAULTS and k not in given}
        cap = (defaults or {}).get("max_tokens")
        if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
            updates["max_tokens"] = cap  # vLLM takes the smaller of the request's and the model's
        return type(params)(**{**params.__dict__, **updates, "bad_words": list(self.bad_words) or None,
                               "allowed_token_ids": self.allowed_token_ids,
                               "truncate_prompt_tokens": self.truncate_prompt_tokens,
                               "spaces_between_special_tokens": self.spaces_between_special_tokens})


class CompletionFields(RequestFields):
    add_special_tokens: bool = True

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if not self.add_special_tokens:
            raise InvalidRequestError("add_special_tokens: false is not implemented (send token ids)",
                                      "add_special_tokens")


class ChatFields(RequestFields):
    """The chat template's knobs (chat_template.py renders with them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_special_tokens: bool = False
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    echo: bool = False  # vLLM: the reply prefixed with the last message when it is the same role's

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.echo:
            raise InvalidRequestError("echo on chat completions is not implemented (continue_final_message "
                                      "continues an assistant message; /v1/completions echoes prompts)", "echo")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                      "continue_final_message")
        if self.add_special_tokens:
            raise InvalidRequestError("add_special_tokens: true is not implemented (the template writes them)",
                                      "add_special_tokens")

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with, besides the messages and tools. As vLLM: an unset
        add_generation_prompt is off when the final message is continued; reasoning_effort reaches
        the template, and turns enable_thinking on or off unless the request's kwargs set it."""
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(extra) & set(RESERVED))
        if reserved:  # the template's own arguments, set by the request's fields
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
            extra.setdefault("enable_thinking", self.reasoning_effort != "none")
        return {"add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
                "continue_final_message": self.continue_final_message, "documents": self.documents, **extra}
