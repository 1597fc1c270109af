"""Part 15's tool parsers (hermes, llama3_json, and the "required"/named ones) and reasoning
parsers (deepseek_r1, qwen3) on scripted model output: whole, and streamed in small pieces, where
the deltas must add up to exactly the whole-text result (content, reasoning, each call's name and
arguments). Malformed calls stay content (streamed too, unless the name had already gone out). The expectations are written from the formats, not
from the parsers' output."""
from __future__ import annotations

import json

import pytest

from part15_full.tool_parsers import NamedToolCallParser, RequiredToolCallParser, ToolParserManager

W = '{"city": "Paris", "days": [1, 2]}'
T = '{"tz": "CET"}'


def hermes_call(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# (parser, model output, expected content, expected [(name, arguments text)])
CASES = [
    ("hermes", hermes_call("weather", W), None, [("weather", W)]),
    ("hermes", hermes_call("weather", W) + "\n" + hermes_call("time", T), None, [("weather", W), ("time", T)]),
    ("hermes", "Let me check. " + hermes_call("weather", W), "Let me check. ", [("weather", W)]),
    ("hermes", "No tools needed, <b>bold</b>.", "No tools needed, <b>bold</b>.", []),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>',  # malformed: content
     '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("llama3_json", f'{{"name": "weather", "parameters": {W}}}', None, [("weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "weather", "parameters": {W}}}; {{"name": "time", "parameters": {T}}}',
     None, [("weather", W), ("time", T)]),
    ("llama3_json", f'Sure.<|python_tag|>{{"name": "time", "arguments": {T}}}', "Sure.", [("time", T)]),
    ("llama3_json", "Paris is in France {not json}.", "Paris is in France {not json}.", []),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Pa', '{"name": "weather", "parameters": {"city": "Pa', []),
]


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def stream(parser, text: str, size: int):
    content, calls, sofar = "", {}, ""
    chunks = pieces(text, size)
    for i, piece in enumerate(chunks):
        sofar += piece
        delta = parser.extract_tool_calls_streaming(sofar, None, finished=i == len(chunks) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls:
            if d.index not in calls:  # the first delta of a call carries its id, type and name
                assert d.id.startswith("chatcmpl-tool-") and d.type == "function" and d.function.name
                assert d.index == len(calls)
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_tool_parsers_whole_and_streamed(name, text, content, calls):
    cls = ToolParserManager.get_tool_parser(name)
    info = cls().extract_tool_calls(text)
    assert info.tools_called == bool(calls)
    assert info.content == (content if calls else text)
    got = [(c.function.name, c.function.arguments) for c in info.tool_calls]
    assert got == calls
    for c in info.tool_calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        json.loads(c.function.arguments)
    # A call that turns out malformed after its name was complete has been streamed already (as in
    # vLLM): the stream cannot take it back, so only the other outputs must add up to the whole.
    if calls or '"name"' not in text:
        for size in (1, 3, 7):
            assert stream(cls(), text, size) == (info.content, got), size


def test_required_and_named_parsers():
    text = f'[{{"name": "weather", "parameters": {W}}}, {{"name": "time", "parameters": {T}}}]'
    info = RequiredToolCallParser().extract_tool_calls(text)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [("weather", W), ("time", T)]
    assert info.content is None
    for size in (1, 4):
        assert stream(RequiredToolCallParser(), text, size) == (None, [("weather", W), ("time", T)])
    cut = text[:20]  # cut short by max_tokens: no calls, the text as content
    assert RequiredToolCallParser().extract_tool_calls(cut).tools_called is False
    named = NamedToolCallParser("weather").extract_tool_calls(W)
    assert [(c.function.name, c.function.arguments) for c in named.tool_calls] == [("weather", W)]
    assert stream(NamedToolCallParser("weather"), W, 2) == (None, [("weather", W)])


# ---- through the server, with the official openai client --------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# "auto" leaves the model free; random weights never write a call, so a regex makes it write one
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "c"\}\}</tool_call>'


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from test_part15_server import tiny_llm, tiny_model_folder

    from part15_full.async_llm import AsyncLLM
    from part15_full.cli_args import FrontendArgs
    from part15_full.server import build_app

    llm = tiny_llm(tiny_model_folder(tmp_path_factory.mktemp("tiny")))
    # Random weights favour JSON's optional whitespace and pad forever; vLLM's disable_any_whitespace
    # (the grammar's separators only) keeps the constrained calls short, as a trained model writes them.
    llm.engine.structured.backend.any_whitespace = False
    return build_app(AsyncLLM(llm.engine), "tiny",
                     frontend=FrontendArgs(enable_auto_tool_choice=True, tool_call_parser="hermes"))


@pytest.fixture(scope="module")
def client(app):
    import openai

    from conftest import running_server

    with running_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def create(client, stream: bool, **kw):
    """(message-like dict, finish_reason) of a chat completion, streamed or not; a stream is put
    together from its deltas as a client does (a call's first delta: index, id, type, name)."""
    kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 200, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls}, choice.finish_reason
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                content = (content or "") + d.content
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.id.startswith("chatcmpl-tool-") and t.type == "function" and t.function.name
                    calls[t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.id is None and not t.function.name
                calls[t.index][2] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return {"content": content, "tool_calls": [tuple(calls[i]) for i in sorted(calls)]}, finish


def valid_calls(calls):
    import jsonschema

    for _, name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    return [name for _, name, _ in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_none_and_free_auto_answer_with_text(client, stream):
    for choice in ("none", "auto"):
        msg, finish = create(client, stream, tool_choice=choice, max_tokens=8)
        assert msg["tool_calls"] == [] and msg["content"] and finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_hermes_returns_the_call_the_model_wrote(client, stream):
    msg, finish = create(client, stream, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert finish == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call[0].startswith("chatcmpl-tool-") and call[1] == "get_weather"
    assert json.loads(call[2])["city"] in ("Paris", "Rome") and json.loads(call[2])["unit"] == "c"


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate_against_their_tools(client, stream):
    msg, finish = create(client, stream, tool_choice="required", temperature=1.0, seed=2)
    assert finish == "tool_calls" and msg["content"] is None
    assert valid_calls(msg["tool_calls"]) == ["get_time", "get_weather"]  # this seed calls both
    assert len({call_id for call_id, _, _ in msg["tool_calls"]}) == 2
    msg, finish = create(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(valid_calls(msg["tool_calls"])) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(client, stream):
    for name in ("get_time", "get_weather"):
        msg, finish = create(client, stream, tool_choice={"type": "function", "function": {"name": name}})
        assert finish == "stop" and valid_calls(msg["tool_calls"]) == [name]  # OpenAI and vLLM keep "stop"


def test_a_follow_up_turn_with_the_calls_and_their_results_is_accepted(client):
    msg, _ = create(client, False, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call_id, name, args), = msg["tool_calls"]
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 0


def test_refusals(app, client):
    import openai

    from part15_full.serving_chat import OpenAIServingChat

    def refused(param, **kw):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, **kw)
        assert e.value.body["param"] == param, e.value.body

    refused("tools", tools=[])
    refused("functions", extra_body={"functions": [TOOLS[0]["function"]]})  # the deprecated form
    refused("function_call", extra_body={"function_call": "auto"})
    refused("tool_choice", tool_choice="required")  # no tools
    refused("tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tool_choice", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    serving = app.state.serving
    app.state.serving = OpenAIServingChat(serving.tokenizer, "tiny", serving.max_model_len)  # no auto tool choice
    try:
        refused("tool_choice", tools=TOOLS, tool_choice="auto")
        refused("tool_choice", tools=TOOLS)  # tools without tool_choice mean "auto"
        assert client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=100).choices[0].message.tool_calls
    finally:
        app.state.serving = serving
    assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices[0].message.content


# A template of our own that writes what it is given: the tools, the calls, the results.
TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %} | {% endif %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
            "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %} | {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_tools_and_the_history_reach_the_chat_template(app, client):
    from part15_full.protocol import ChatCompletionRequest

    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 C"}]
    want = ("TOOLS: get_weather get_time | user:What is the weather in Paris? | assistant: CALL get_weather(Oslo) | "
            "tool:21 C FOR call-1 | assistant:")
    serving = app.state.serving
    req = ChatCompletionRequest(model="tiny", messages=history, tools=TOOLS, tool_choice="none")
    assert serving.tokenizer.decode(serving.chat_prompt(req, TEMPLATE), skip_special_tokens=False) == want
    app.state.chat_template = TEMPLATE  # what --chat-template sets
    try:
        r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    finally:
        app.state.chat_template = None
    assert r.usage.prompt_tokens == len(serving.tokenizer.encode(want, add_special_tokens=False))


def test_the_flags():
    from part15_full.cli_args import FrontendArgs
    from part15_full.server import parse_args

    from part15_full.config import EngineConfig

    ns = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"])
    args = FrontendArgs.from_cli_args(ns)
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    assert EngineConfig.from_cli_args(ns).reasoning_parser == "qwen3"  # the engine's flag, as in vLLM
    for bad in (["--enable-auto-tool-choice"], ["--tool-call-parser", "nope"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        EngineConfig.from_cli_args(parse_args(["--reasoning-parser", "nope"])).validate()
