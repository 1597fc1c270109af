"""The chat endpoint's prompt and responses with tool calling and reasoning output.

`OpenAIServingChat` extends shared/serving.py's OpenAIServing:

- the prompt (chat_template.py renders it): the template gets `tools=` and the history's tool
  calls and tool results (an assistant turn's `tool_calls`, their arguments parsed back into
  objects as templates expect; a tool message's `tool_call_id` and `name`);
- the checks vLLM makes before anything runs: "auto" needs --enable-auto-tool-choice and a
  --tool-call-parser; with a reasoning parser, constrained output (response_format,
  structured_outputs, or tool_choice "required"/named) is constrained only after </think> (the
  engine's gate, structured_output/reasoning.py), so it is refused where the tags are not tokens
  of the vocabulary and the engine cannot see the reasoning end;
- the response: reasoning split from the content first (reasoning_parsers.py), then the tool calls
  found in the content (tool_parsers.py); finish_reason "tool_calls" when "auto" found calls or
  "required" finished them (a named function keeps "stop", as in vLLM and OpenAI);
- the stream: a `ChatStream` per request keeps one reasoning and one tool parser per choice.

In vLLM: vllm/entrypoints/openai/chat_completion/serving.py (OpenAIServingChat:
chat_completion_full_generator, chat_completion_stream_generator) and stream_processor.py;
vllm/renderers/chat_utils/ (the history's messages for the template)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidRequestError
from shared.outputs import CompletionOutput, RequestOutput
from shared.serving import OpenAIServing
from shared.tokenizer import Tokenizer

from . import chat_template
from .chat_protocol import (ChatChoice, ChatCompletionResponse, ChatCompletionStreamResponse, ChatResponseMessage,
                            ChatStreamChoice, DeltaMessage, ToolsRequest)
from .reasoning_parsers import ReasoningParser, ReasoningParserManager
from .structured_output.reasoning import ReasoningTags
from .tool_parsers import NamedToolCallParser, RequiredToolCallParser, ToolParser, ToolParserManager


def _for_template(m: Any) -> Any:
    """A history message as the template reads it: a tool call's arguments as an object, not the
    JSON text the API carries (templates write `arguments | tojson`)."""
    if not getattr(m, "tool_calls", None):
        return m
    calls = json.loads(json.dumps(m.tool_calls))  # a copy
    for call in calls:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # left as the text the client sent
    return m.model_copy(update={"tool_calls": calls})


class OpenAIServingChat(OpenAIServing):
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int, *,
                 enable_auto_tools: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None):
        super().__init__(tokenizer, model_name, max_model_len)
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning_parser = ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    # ---- before the request runs ----------------------------------------------------------
    def check_request(self, req: Any) -> None:
        if not isinstance(req, ToolsRequest):
            return
        req.check_tools()
        if req.tools and req.tool_choice == "auto" and not (self.enable_auto_tools and self.tool_parser):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      'to be set (tools without tool_choice mean "auto")', "tool_choice")
        fmt = getattr(req, "response_format", None) or {}
        constrained = req.tool_choice_schema() is not None or getattr(req, "structured_outputs", None) is not None \
            or fmt.get("type", "text") != "text"
        if self.reasoning_parser is not None and constrained and ReasoningTags.of(self.tokenizer) is None:
            raise InvalidRequestError("structured outputs (response_format, structured_outputs, tool_choice "
                                      "\"required\" or a named function) need <think> and </think> to be tokens of "
                                      "the model's vocabulary with --reasoning-parser: the grammar starts at </think>",
                                      "tool_choice" if req.tool_choice_schema() is not None else "response_format")
        parser = self.new_tool_parser(req)
        if parser is not None:
            parser.adjust_request(req)

    def chat_prompt(self, req: Any, template: str | None = None) -> list[int]:
        """The checks above, then chat_template.py's prompt (with the request's tools)."""
        self.check_request(req)
        if isinstance(req, ToolsRequest):
            req = req.model_copy(update={"messages": [_for_template(m) for m in req.messages]})
        return chat_template.chat_prompt(self.tokenizer, req, template)

    # ---- parsers per choice -----------------------------------------------------------------
    def new_tool_parser(self, req: Any) -> ToolParser | None:
        if not isinstance(req, ToolsRequest) or not req.tools or req.tool_choice == "none":
            return None
        if req.named_tool is not None:
            return NamedToolCallParser(req.named_tool, self.tokenizer)
        if req.tool_choice == "required":
            return RequiredToolCallParser(self.tokenizer)
        return self.tool_parser(self.tokenizer) if self.enable_auto_tools and self.tool_parser else None

    def new_reasoning_parser(self) -> ReasoningParser | None:
        return self.reasoning_parser(self.tokenizer) if self.reasoning_parser else None

    @staticmethod
    def _finish_reason(req: Any, finish: str | None, tools_called: bool) -> str | None:
        if tools_called and req.named_tool is None and (req.tool_choice == "auto" or finish == "stop"):
            return "tool_calls"
        return finish

    # ---- whole responses --------------------------------------------------------------------
    def chat_response(self, req: Any, output: RequestOutput) -> ChatCompletionResponse:
        return ChatCompletionResponse(model=self.model_name, choices=[self._choice(req, c) for c in output.outputs],
                                      usage=self.usage([output]))

    def _choice(self, req: Any, c: CompletionOutput) -> ChatChoice:
        reasoning, content = None, c.text
        parser = self.new_reasoning_parser()
        if parser is not None:
            reasoning, content = parser.extract_reasoning(c.text, req)
            if not getattr(req, "include_reasoning", True):
                reasoning = None
        tool_calls, finish = [], c.finish_reason
        tools = self.new_tool_parser(req)
        if tools is not None:
            info = tools.extract_tool_calls(content or "", req)
            if info.tools_called:
                tool_calls = info.tool_calls if req.parallel_tool_calls is not False else info.tool_calls[:1]
                content = info.content
            finish = self._finish_reason(req, finish, info.tools_called)
        message = ChatResponseMessage(content=content, tool_calls=tool_calls, reasoning=reasoning,
                                      reasoning_content=reasoning)
        return ChatChoice(index=c.index, message=message, logprobs=self._chat_logprobs(c, req.top_logprobs or 0),
                          finish_reason=finish, stop_reason=c.stop_reason)

    # ---- streams ----------------------------------------------------------------------------
    def chat_stream(self, req: Any, request_id: str) -> "ChatStream":
        return ChatStream(self, req, request_id)


@dataclass
class _ChoiceStream:
    reasoning: ReasoningParser | None
    tools: ToolParser | None
    text: str = ""  # the choice's whole text so far
    content: str = ""  # its content so far (the text less the reasoning), what the tool parser reads


@dataclass
class ChatStream:
    """One streamed chat request: its chunks, delta by delta."""
    serving: OpenAIServingChat
    req: Any
    request_id: str
    choices: dict[int, _ChoiceStream] = field(default_factory=dict)

    def _chunk(self, index: int, delta: DeltaMessage, **kw) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, model=self.serving.model_name,
                                            choices=[ChatStreamChoice(index=index, delta=delta, **kw)])

    def chunks(self, delta: RequestOutput, first: bool) -> list[ChatCompletionStreamResponse]:
        out = []
        if first:  # OpenAI opens every choice with the assistant role
            out += [self._chunk(c.index, DeltaMessage(role="assistant", content="")) for c in delta.outputs]
        for c in delta.outputs:
            st = self.choices.setdefault(c.index, _ChoiceStream(self.serving.new_reasoning_parser(),
                                                                self.serving.new_tool_parser(self.req)))
            st.text += c.text
            finished = c.finish_reason is not None
            reasoning, content, tool_calls = None, c.text, []
            if st.reasoning is not None:
                dm = st.reasoning.extract_reasoning_streaming(st.text, finished)
                reasoning, content = (dm.reasoning, dm.content) if dm else (None, None)
                if not getattr(self.req, "include_reasoning", True):
                    reasoning = None
            finish = c.finish_reason
            if st.tools is not None:
                st.content += content or ""
                dm = st.tools.extract_tool_calls_streaming(st.content, self.req, finished)
                content, tool_calls = (dm.content, dm.tool_calls) if dm else (None, [])
                if self.req.parallel_tool_calls is False:
                    tool_calls = [t for t in tool_calls if t.index == 0]
                if finished:
                    finish = self.serving._finish_reason(self.req, finish, st.tools.tools_called)
            parsed = st.reasoning is not None or st.tools is not None
            if content or reasoning or tool_calls or finished or (c.logprobs if parsed else c.token_ids):
                out.append(self._chunk(
                    c.index, DeltaMessage(content=content, reasoning=reasoning, reasoning_content=reasoning,
                                          tool_calls=tool_calls),
                    logprobs=self.serving._chat_logprobs(c, self.req.top_logprobs or 0),
                    finish_reason=finish, stop_reason=c.stop_reason))
        return out
