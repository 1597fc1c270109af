"""Tool parsers: find the tool calls in a model's text, whole or while it streams.

With tool_choice "auto" the model writes its calls in its own format, which the chat template
taught it; `--tool-call-parser` names the format:

- `hermes` (Hermes, Qwen2.5/Qwen3): one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  block per call; the text before the first block is the message's content.
- `llama3_json` (Llama 3.1-3.3): a JSON object {"name": ..., "parameters": {...}} at the start of
  the output or after `<|python_tag|>`, several separated by `;`; the text before the tag is content.

Output that does not parse (malformed JSON, a missing name) stays content: the client gets the
text rather than an error. "required" and a named function use two more parsers here, not chosen
by flag: their text is constrained to JSON (chat_protocol.py), an array of {"name", "parameters"}
objects or the function's arguments alone.

Streaming re-reads the whole text on every delta and sends what is new since the last one: the
content up to where a call might begin (a partial `<tool_call>` is held back), a call's header
(index, id, type, name) once its name is complete, then pieces of its arguments as they grow. A
call's `arguments` is the model's own text of the JSON value (checked to parse), streamed or not,
so the pieces of a stream add up to exactly the non-streamed string. On the last delta the
whole-text parse is the reference: what it has beyond what was sent goes out then.

In vLLM: vllm/tool_parsers/ (abstract_tool_parser.py: ToolParser, ToolParserManager;
hermes_tool_parser.py: Hermes2ProToolParser; llama_tool_parser.py: Llama3JsonToolParser);
"required" and named calls in vllm/entrypoints/openai/chat_completion/serving.py. vLLM's
streaming methods also get the previous text, the delta and the token ids; their arguments
are json.dumps of the parsed value when not streamed (equal as JSON, not always as text)."""
from __future__ import annotations

import json
from typing import Any

from .chat_protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
                            FunctionCall, ToolCall, make_tool_call_id)

_decoder = json.JSONDecoder()
PartialCall = tuple[str | None, str]  # (name once complete, the arguments' text so far)


# ---- a little JSON scanning: where values start and end in partial text -------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value at text[i] ends; None while unfinished (or malformed). A number or
    literal that reaches the end of the text may still grow, so it counts as unfinished."""
    try:
        _, end = _decoder.raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    return None if end == len(text) and text[i] not in '{["' else end


def _partial_value(text: str, i: int) -> str:
    """The text so far of the object or array at text[i]: up to its closing bracket, else to the
    end (a prefix of the finished value). A scalar is sent whole, once finished."""
    if i >= len(text) or text[i] not in "{[":
        end = _value_end(text, i) if i < len(text) else None
        return text[i:end] if end is not None else ""
    depth, in_str, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            escaped, in_str = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[i:j + 1]
    return text[i:]


def scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level members of the JSON object at text[i] ('{'): key -> (value start, value end,
    None while unfinished), stopping at the first unfinished one; and where the object ends (None
    while unfinished)."""
    members: dict[str, tuple[int, int | None]] = {}
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
            continue
        try:
            key, j = _decoder.raw_decode(text, j)
        except json.JSONDecodeError:
            return members, None
        j = _skip_ws(text, j)
        if j >= len(text) or text[j] != ":" or not isinstance(key, str):
            return members, None
        j = _skip_ws(text, j + 1)
        end = _value_end(text, j) if j < len(text) else None
        members[key] = (j, end)
        if end is None:
            return members, None
        j = _skip_ws(text, end)
    return members, None


def _partial_call(text: str, i: int, arg_keys: tuple[str, ...]) -> PartialCall:
    """(name, arguments so far) of the call object at text[i]."""
    members, _ = scan_object(text, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        value = json.loads(text[members["name"][0]:members["name"][1]])
        name = value if isinstance(value, str) else None
    args = ""
    for key in arg_keys:
        if key in members:
            start, end = members[key]
            args = text[start:end] if end is not None else _partial_value(text, start)
            break
    return name, args


def _whole_call(text: str, i: int, arg_keys: tuple[str, ...]) -> tuple[FunctionCall, int]:
    """The finished call object at text[i] and where it ends; ValueError if it is not one."""
    obj, end = _decoder.raw_decode(text, i)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not any(k in obj for k in arg_keys):
        raise ValueError("not a call: needs a name and " + " or ".join(arg_keys))
    name, args = _partial_call(text, i, arg_keys)
    return FunctionCall(name=name, arguments=args), end


def partial_tag_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- the parsers ---------------------------------------------------------------------------

class ToolParser:
    """One per response choice (it keeps the stream's state)."""

    def __init__(self, tokenizer: Any = None):
        self.model_tokenizer = tokenizer
        self._sent_content = ""
        self._sent: list[list[str]] = []  # per call: [id, name, arguments sent]

    def adjust_request(self, request):
        """vLLM's hook to change a request before it runs (e.g. keep special tokens)."""
        return request

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def _stream_view(self, text: str) -> tuple[str, list[PartialCall]]:
        """(content safe to send, the calls so far) of unfinished text."""
        raise NotImplementedError

    @property
    def tools_called(self) -> bool:
        """Whether the stream has sent a call."""
        return bool(self._sent)

    def extract_tool_calls_streaming(self, current_text: str, request=None,
                                     finished: bool = False) -> DeltaMessage | None:
        """What to send for the text so far (all of it on the last delta, `finished`)."""
        if finished:
            info = self.extract_tool_calls(current_text, request)
            content = info.content or ""
            calls: list[PartialCall] = [(c.function.name, c.function.arguments) for c in info.tool_calls]
        else:
            content, calls = self._stream_view(current_text)
        new_content = None
        if len(content) > len(self._sent_content) and content.startswith(self._sent_content):
            new_content, self._sent_content = content[len(self._sent_content):], content
        deltas = []
        for i, (name, args) in enumerate(calls):
            if i == len(self._sent):
                if name is None:
                    break  # call i + 1 waits for call i's header
                self._sent.append([make_tool_call_id(), name, ""])
                deltas.append(DeltaToolCall(index=i, id=self._sent[i][0], type="function",
                                            function=DeltaFunctionCall(name=name)))
            sent = self._sent[i][2]
            if len(args) > len(sent) and args.startswith(sent):
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[len(sent):])))
                self._sent[i][2] = args
        if new_content is None and not deltas:
            return None
        return DeltaMessage(content=new_content, tool_calls=deltas)


def _result(content: str | None, calls: list[FunctionCall]) -> ExtractedToolCallInformation:
    return ExtractedToolCallInformation(tools_called=True, tool_calls=[ToolCall(function=c) for c in calls],
                                        content=content or None)


class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    ARG_KEYS = ("arguments",)

    def adjust_request(self, request):
        # Some models mark <tool_call> special: it must survive detokenization to be found.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def _bodies(self, text: str) -> list[int]:
        """Where each block's JSON starts (after its start tag and any whitespace)."""
        starts, pos = [], text.find(self.tool_call_start_token)
        while pos != -1:
            starts.append(_skip_ws(text, pos + len(self.tool_call_start_token)))
            end = text.find(self.tool_call_end_token, pos)
            pos = -1 if end == -1 else text.find(self.tool_call_start_token, end)
        return starts

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        try:
            calls = []
            for start in self._bodies(model_output):
                call, end = _whole_call(model_output, start, self.ARG_KEYS)
                rest = model_output[_skip_ws(model_output, end):]
                if rest and not rest.startswith(self.tool_call_end_token):
                    raise ValueError("text after the call's JSON inside its block")
                calls.append(call)
        except ValueError:  # JSONDecodeError too
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        return _result(model_output[:model_output.find(self.tool_call_start_token)], calls)

    def _stream_view(self, text: str) -> tuple[str, list[PartialCall]]:
        first = text.find(self.tool_call_start_token)
        if first == -1:
            return text[:len(text) - partial_tag_overlap(text, self.tool_call_start_token)], []
        calls = [_partial_call(text, s, self.ARG_KEYS) for s in self._bodies(text) if text[s:s + 1] == "{"]
        return text[:first], calls


class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")  # Llama writes either

    def _calls_start(self, text: str) -> tuple[str, int] | None:
        """(content before the calls, where they start), None if this text holds none."""
        tag = text.find(self.bot_token)
        if tag != -1:
            return text[:tag], tag + len(self.bot_token)
        return ("", 0) if text.lstrip().startswith("{") else None

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        found = self._calls_start(model_output)
        if found is None:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        content, j = found
        calls = []
        try:
            j = _skip_ws(model_output, j)
            while j < len(model_output):
                call, end = _whole_call(model_output, j, self.ARG_KEYS)
                calls.append(call)
                j = _skip_ws(model_output, end)
                if j < len(model_output):
                    if model_output[j] != ";":
                        raise ValueError("calls are separated by ';'")
                    j = _skip_ws(model_output, j + 1)
        except ValueError:
            calls = []
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        return _result(content, calls)

    def _stream_view(self, text: str) -> tuple[str, list[PartialCall]]:
        if not text.strip():
            return "", []  # leading whitespace may come before a call (then it is not content)
        found = self._calls_start(text)
        if found is None:
            return text[:len(text) - partial_tag_overlap(text, self.bot_token)], []
        content, j = found
        calls = []
        j = _skip_ws(text, j)
        while j < len(text) and text[j] == "{":
            calls.append(_partial_call(text, j, self.ARG_KEYS))
            _, end = scan_object(text, j)
            if end is None:
                break
            j = _skip_ws(text, end)
            if j >= len(text) or text[j] != ";":
                break
            j = _skip_ws(text, j + 1)
        return content, calls


class RequiredToolCallParser(ToolParser):
    """tool_choice "required": the text is a JSON array of {"name", "parameters"} objects."""
    ARG_KEYS = ("parameters",)

    def _elements(self, text: str) -> list[int]:
        j = _skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return []
        starts, j = [], _skip_ws(text, j + 1)
        while j < len(text) and text[j] == "{":
            starts.append(j)
            _, end = scan_object(text, j)
            if end is None:
                break
            j = _skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = _skip_ws(text, j + 1)
        return starts

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        try:
            value = json.loads(model_output)
            if not isinstance(value, list) or not value:
                raise ValueError("not a non-empty array")
            calls = [_whole_call(model_output, s, self.ARG_KEYS)[0] for s in self._elements(model_output)]
            if len(calls) != len(value):
                raise ValueError("not an array of calls")
        except ValueError:  # cut short (finish_reason "length"): the text as content
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        return _result(None, calls)

    def _stream_view(self, text: str) -> tuple[str, list[PartialCall]]:
        return "", [_partial_call(text, s, self.ARG_KEYS) for s in self._elements(text)]


class NamedToolCallParser(ToolParser):
    """A named function: the whole text is its arguments."""

    def __init__(self, name: str, tokenizer: Any = None):
        super().__init__(tokenizer)
        self.name = name

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        return _result(None, [FunctionCall(name=self.name, arguments=model_output)])

    def _stream_view(self, text: str) -> tuple[str, list[PartialCall]]:
        return "", [(self.name, text)]


class ToolParserManager:
    tool_parsers: dict[str, type[ToolParser]] = {"hermes": Hermes2ProToolParser,
                                                 "llama3_json": Llama3JsonToolParser}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"tool call parser {name!r} is not one of {', '.join(cls.tool_parsers)}")
        return cls.tool_parsers[name]
