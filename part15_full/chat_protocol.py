"""The chat API's tool calling and reasoning output on the wire, in vLLM's (and OpenAI's) shapes.

Request side (`ToolsRequest`, mixed into part 15's ChatCompletionRequest):
- `tools`: [{"type": "function", "function": {"name", "description", "parameters"}}], given to the
  chat template as `tools=`; `tool_choice`: "none" | "auto" | "required" |
  {"type": "function", "function": {"name": ...}} (default "auto" when tools are given, else
  "none"); `parallel_tool_calls` (false: at most one call comes back).
- History: assistant turns may carry `tool_calls`, and `role: "tool"` messages a `tool_call_id`.
- "required" and a named function need no parser: decoding is constrained by a JSON schema built
  from the tools (`tool_choice_schema`), so the call is valid JSON of the right shape whatever the
  model's weights. "auto" leaves the model free and a tool parser finds the calls in its text.

Response side: `message.tool_calls` [{id "chatcmpl-tool-...", type "function", function {name,
arguments: a JSON string}}], `message.reasoning` (and `reasoning_content`, the name DeepSeek's API
and older vLLM releases use); in a stream, `delta.tool_calls` (the first delta of a call carries
index, id, type and the name; then argument pieces with the index only) and `delta.reasoning`.

In vLLM: vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest.tools,
tool_choice, parallel_tool_calls, check_tool_usage, ChatMessage, ChatCompletionToolsParam),
vllm/entrypoints/generate/base/protocol.py (ToolCall, FunctionCall, DeltaToolCall, DeltaMessage,
ExtractedToolCallInformation), vllm/renderers/chat_utils/tool_call.py (make_tool_call_id)."""
from __future__ import annotations

import copy
import dataclasses
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from shared import protocol
from shared.errors import InvalidRequestError


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---- request ---------------------------------------------------------------------------------

class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str = Field(min_length=1)


class ChatCompletionNamedToolChoiceParam(BaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ChatMessage(protocol.ChatMessage):
    """A message of the history, with what tool calling adds to it."""
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, as the API returned them
    tool_call_id: str | None = None  # a tool message: which call it answers
    name: str | None = None


class ToolsRequest(BaseModel):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # false: the reasoning is parsed out and dropped

    @model_validator(mode="after")
    def _default_tool_choice(self) -> "ToolsRequest":
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"  # OpenAI's defaults
        return self

    def check_tools(self) -> None:
        """The 400s vLLM gives (raised here, outside pydantic's validation, so that they name the field)."""
        for legacy in ("functions", "function_call"):  # OpenAI's deprecated form of tools
            if getattr(self, legacy, None) not in (None, "none"):
                raise InvalidRequestError(f"{legacy} is OpenAI's deprecated form of tool calling: send tools and "
                                          f"tool_choice", legacy)
        if self.tools == []:
            raise InvalidRequestError("tools must not be an empty array: give at least one tool or omit it", "tools")
        if self.tool_choice != "none" and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam) \
                and self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequestError(f"the tool named in tool_choice ({self.tool_choice.function.name!r}) is not "
                                      f"one of tools", "tool_choice")

    @property
    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, ChatCompletionNamedToolChoiceParam) else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (also with tool_choice "none", as vLLM)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_schema(self) -> dict[str, Any] | None:
        """The JSON schema that constrains decoding: a named function's parameters; for "required",
        a non-empty array of {"name", "parameters"} objects, one anyOf branch per tool (the
        parameters' `$defs` hoisted to the top, where `$ref`s find them). None otherwise."""
        if self.named_tool is not None:
            tool = next(t for t in self.tools if t.function.name == self.named_tool)
            return tool.function.parameters or {"type": "object", "properties": {}}
        if self.tool_choice != "required":
            return None
        branches, defs = [], {}
        for tool in self.tools:
            params = copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}
            for name, schema in params.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    raise InvalidRequestError(f"tools define $defs {name!r} twice, differently", "tools")
            branches.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                            "parameters": params},
                             "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def to_sampling_params(self):
        self.check_tools()
        schema = self.tool_choice_schema()
        # shared/protocol.py refuses tools; here they are handled, so it is shown none.
        tools, choice, self.tools, self.tool_choice = self.tools, self.tool_choice, None, None
        try:
            params = super().to_sampling_params()
        finally:
            self.tools, self.tool_choice = tools, choice
        if schema is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError("tool_choice \"required\" or a named function constrains the output already: "
                                      "it cannot be combined with response_format or structured_outputs", "tool_choice")
        from .sampling_params import StructuredOutputsParams

        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))


# ---- response --------------------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None  # the text beside the calls (OpenAI allows both)


def _without_empty(data: dict) -> dict:
    """vLLM leaves out an empty tool_calls list, and (here) reasoning that is not there."""
    if not data.get("tool_calls"):
        data.pop("tool_calls", None)
    for key in ("reasoning", "reasoning_content"):
        if data.get(key) is None:
            data.pop(key, None)
    return data


class ChatResponseMessage(protocol.ChatResponseMessage):
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _without_empty(handler(self))


class DeltaMessage(protocol.DeltaMessage):
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _without_empty(handler(self))


class ChatChoice(protocol.ChatChoice):
    message: ChatResponseMessage


class ChatCompletionResponse(protocol.ChatCompletionResponse):
    choices: list[ChatChoice]


class ChatStreamChoice(protocol.ChatStreamChoice):
    delta: DeltaMessage


class ChatCompletionStreamResponse(protocol.ChatCompletionStreamResponse):
    choices: list[ChatStreamChoice]
