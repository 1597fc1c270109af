"""The OpenAI requests as this part's server takes them: shared/protocol.py's, plus vLLM's fields
for what parts 13 and 15 add.

- `kv_transfer_params` (part 13): what the KV connector is to do with this request, e.g. a proxy's
  {"do_remote_decode": true} to a prefill server, or the prefill's answer to a decode server.
- Structured outputs (part 15), in the two shapes vLLM's server takes: OpenAI's `response_format`
  ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}} or {"type": "json_object"})
  and vLLM's `structured_outputs` ({"json": ...} | {"regex": ...} | {"choice": [...]} |
  {"grammar": ...} | {"json_object": true}). Either becomes SamplingParams.structured_outputs.
- Tool calling (part 15, chat): `tools`, `tool_choice`, `parallel_tool_calls` (chat_protocol.py).

In vLLM: vllm/entrypoints/openai/completion/protocol.py (CompletionRequest) and
vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest), with kv_transfer_params;
response_format and structured_outputs in vllm/entrypoints/generate/base/protocol.py;
vllm/sampling_params.py (StructuredOutputsParams)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared import protocol
from shared.errors import InvalidRequestError

from .protocol_logprobs import EchoFields, PromptLogprobsFields  # echo, prompt_logprobs (evaluation harnesses)
from .request_fields import ChatFields, CompletionFields  # every other vLLM field: honoured, refused or logged
from .chat_protocol import ToolsRequest  # tools, tool_choice, parallel_tool_calls, include_reasoning
from .sampling_params import SamplingParams, StructuredOutputsParams


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)  # a misspelt constraint is refused
    json_: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _StructuredRequest(BaseModel):
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def _structured(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is not None and self.structured_outputs is not None and fmt.get("type") != "text":
            raise InvalidRequestError("give response_format or structured_outputs, not both", "response_format")
        if self.structured_outputs is not None:
            return StructuredOutputsParams(**self.structured_outputs.model_dump(exclude_none=True, by_alias=True))
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise InvalidRequestError('response_format json_schema needs {"name": ..., "schema": {...}}',
                                          "response_format")
            # OpenAI's schema is optional: without one, any JSON (vLLM does the same)
            return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"})
        raise InvalidRequestError(f"response_format type {fmt.get('type')!r} is not one of text, json_object, "
                                  f"json_schema", "response_format")

    def to_sampling_params(self) -> SamplingParams:
        structured = self._structured()
        fmt, self.response_format = self.response_format, None  # shared/protocol.py refuses non-text formats
        try:
            params = super().to_sampling_params()
        finally:
            self.response_format = fmt
        return SamplingParams(**{**params.__dict__, "structured_outputs": structured})


class CompletionRequest(CompletionFields, EchoFields, _StructuredRequest, protocol.CompletionRequest):
    pass


class ChatCompletionRequest(ChatFields, PromptLogprobsFields, ToolsRequest, _StructuredRequest,
                            protocol.ChatCompletionRequest):
    pass
