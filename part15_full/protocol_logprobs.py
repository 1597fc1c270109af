"""The request fields of evaluation harnesses: `prompt_logprobs` (both endpoints) and `echo` with
`max_tokens: 0` (completions), as vLLM takes them.

- `prompt_logprobs: k`: the prompt tokens' logprobs, each with the top k (prompt_logprobs.py); with
  `stream: true` only k = 0 is accepted (vLLM: they are not streamed).
- `echo: true`: the prompt is returned before the completion, and with `logprobs` its tokens' logprobs
  come first (so `prompt_logprobs` defaults to `logprobs`). `max_tokens: 0` is allowed with echo only:
  the engine generates one token that the response leaves out (vLLM's "echo without generation");
  without echo it stays the 400 SamplingParams gives.

Mixed in before `_StructuredRequest` (protocol.py): each wraps the next class's to_sampling_params.

In vLLM: vllm/entrypoints/openai/completion/protocol.py (CompletionRequest.to_sampling_params,
check_logprobs) and chat_completion/protocol.py (ChatCompletionRequest.prompt_logprobs)."""
from __future__ import annotations

import dataclasses

from pydantic import BaseModel

from shared.errors import InvalidRequestError


def _check_stream(prompt_logprobs: int | None, stream: bool) -> None:
    if prompt_logprobs is not None and stream and prompt_logprobs != 0:
        raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


class PromptLogprobsFields(BaseModel):
    """Chat: `prompt_logprobs`, returned beside the choices."""
    prompt_logprobs: int | None = None

    def to_sampling_params(self):
        _check_stream(self.prompt_logprobs, self.stream)
        return dataclasses.replace(super().to_sampling_params(), prompt_logprobs=self.prompt_logprobs)


class EchoFields(BaseModel):
    """Completions: `prompt_logprobs`, `echo` and `max_tokens: 0`."""
    prompt_logprobs: int | None = None

    @property
    def echo_only(self) -> bool:
        """Echo without generation: the response holds the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self):
        _check_stream(self.prompt_logprobs, self.stream)
        k = self.prompt_logprobs if self.prompt_logprobs is not None else (self.logprobs if self.echo else None)
        echo, max_tokens = self.echo, self.max_tokens
        # shared/protocol.py refuses echo; the engine needs one token to run the prompt at all
        self.echo, self.max_tokens = False, 1 if self.echo_only else max_tokens
        try:
            params = super().to_sampling_params()
        finally:
            self.echo, self.max_tokens = echo, max_tokens
        return dataclasses.replace(params, prompt_logprobs=k)
