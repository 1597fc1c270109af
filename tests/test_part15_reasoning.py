"""Part 15's reasoning output: the reasoning parsers (deepseek_r1, qwen3) on scripted model output,
whole and streamed in small pieces (the deltas add up to exactly the whole-text split, a tag cut
across pieces included); and through the server with the official openai client: the reasoning
and content a parser gives equal the split of the text a server without one returns for the same
greedy request; with structured outputs the grammar constrains only what follows </think> (a
tokenizer whose tags are tokens), and is a 400 where the tags are not tokens. Expectations are written from the
formats (and, for the server, from the parser-less server's text), not from our parsers' output."""
from __future__ import annotations

import pytest

from part15_full.reasoning_parsers import ReasoningParserManager


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


# (parser, model output, expected reasoning, expected content)
REASONING = [
    ("deepseek_r1", "<think>The user wants 2+2.</think>It is 4.", "The user wants 2+2.", "It is 4."),
    ("deepseek_r1", "No opening tag, still thinking.</think>\n\nFour.", "No opening tag, still thinking.", "\n\nFour."),
    ("deepseek_r1", "<think>Thinking without end", "Thinking without end", None),
    ("deepseek_r1", "Only thoughts, cut short </thi", "Only thoughts, cut short </thi", None),
    ("deepseek_r1", "<think>done</think>", "done", None),
    ("qwen3", "<think>Let me add.</think>\n\nIt is 4.", "Let me add.", "\n\nIt is 4."),
    ("qwen3", "It is 4, no thinking here.", None, "It is 4, no thinking here."),
    ("qwen3", "<think>still going", "still going", None),
    ("qwen3", "Hmm. <think>why</think> So: 4.", "why", "Hmm.  So: 4."),
    ("qwen3", "a < b and </think> is text", None, "a < b and </think> is text"),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_parsers_whole_and_streamed(name, text, reasoning, content):
    cls = ReasoningParserManager.get_reasoning_parser(name)
    assert cls().extract_reasoning(text) == (reasoning, content)
    for size in (1, 2, 5):
        parser, got, sofar = cls(), ["", ""], ""
        chunks = pieces(text, size)
        for i, piece in enumerate(chunks):
            sofar += piece
            delta = parser.extract_reasoning_streaming(sofar, finished=i == len(chunks) - 1)
            if delta is not None:
                assert delta.reasoning == delta.reasoning_content
                got[0] += delta.reasoning or ""
                got[1] += delta.content or ""
        assert got == [reasoning or "", content or ""], size


# ---- through the server, with the official openai client --------------------------------------

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(app, client) of a server started with --reasoning-parser deepseek_r1."""
    import openai
    from test_part15_server import tiny_llm, tiny_model_folder

    from conftest import running_server
    from part15_full.async_llm import AsyncLLM
    from part15_full.cli_args import FrontendArgs
    from part15_full.server import build_app

    from part15_full import LLM

    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny"))
    llm = LLM(model=str(folder), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16,
              reasoning_parser="deepseek_r1")
    app = build_app(AsyncLLM(llm.engine), "tiny", frontend=FrontendArgs())
    with running_server(app) as url:
        yield app, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def answer(client, stream: bool, **kw) -> tuple[str | None, str | None, str | None]:
    """(reasoning, reasoning_content, content) of a greedy chat completion, streamed or not."""
    kw = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 12, **kw}
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return getattr(m, "reasoning", None), getattr(m, "reasoning_content", None), m.content
    parts: list[str | None] = [None, None, None]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for i, key in enumerate(("reasoning", "reasoning_content", "content")):
                piece = getattr(ch.delta, key, None)
                if piece:
                    parts[i] = (parts[i] or "") + piece
    return tuple(parts)


@pytest.mark.parametrize("stream", [False, True])
def test_the_parsers_split_the_text_a_plain_server_returns(served, stream):
    from part15_full.serving_chat import OpenAIServingChat

    app, client = served
    r1 = app.state.serving
    plain = OpenAIServingChat(r1.tokenizer, "tiny", r1.max_model_len)
    qwen3 = OpenAIServingChat(r1.tokenizer, "tiny", r1.max_model_len, reasoning_parser="qwen3")
    try:
        app.state.serving = plain
        _, _, text = answer(client, stream)
        assert text and "think>" not in text  # random weights write no tags: the oracle below holds
        app.state.serving = qwen3  # qwen3: no <think>, no reasoning
        assert answer(client, stream) == (None, None, text)
    finally:
        app.state.serving = r1
    assert answer(client, stream) == (text, text, None)  # deepseek_r1: all reasoning until </think>
    assert answer(client, stream, extra_body={"include_reasoning": False}) == (None, None, None)


def test_reasoning_with_structured_outputs_is_refused(served):
    import openai

    _, client = served
    for param, kw in (("response_format", {"response_format": {"type": "json_object"}}),
                      ("tool_choice", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                       "tool_choice": "required"})):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, **kw)
        assert e.value.body["param"] == param and "reasoning" in e.value.body["message"]
    assert answer(client, False)[0]  # still serving


# ---- structured outputs after the reasoning ------------------------------------------------------

def test_the_last_tag_of_the_prompt_decides_where_a_sequence_starts():
    from part15_full.structured_output.reasoning import ReasoningTags

    tags = ReasoningTags(start_id=7, end_id=8)
    assert not tags.ended_in([1, 2, 3])  # no tag: the model's text starts with its reasoning
    assert not tags.ended_in([1, 8, 2, 7, 3])  # the template opened a <think> last
    assert tags.ended_in([1, 7, 8, 3])  # an empty block (thinking off): the answer comes at once


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A server with --reasoning-parser deepseek_r1 over a tiny dummy Llama whose tokenizer has
    <think> and </think> as tokens of their own (as DeepSeek-R1's and Qwen3's have, and, as theirs,
    not special: skip_special_tokens keeps them in the text): (client, the </think> id)."""
    import openai
    from test_part15_server import tiny_model_folder
    from transformers import AutoTokenizer, LlamaConfig

    from conftest import running_server
    from part15_full import LLM
    from part15_full.async_llm import AsyncLLM
    from part15_full.server import build_app

    folder = tiny_model_folder(tmp_path_factory.mktemp("thinking"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])  # added, not special (as Qwen3's): the text keeps them
    tok.save_pretrained(folder)
    config = LlamaConfig.from_pretrained(folder)
    config.vocab_size = len(tok)
    config.save_pretrained(folder)
    llm = LLM(model=str(folder), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16,
              reasoning_parser="deepseek_r1")
    with running_server(build_app(AsyncLLM(llm.engine), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), tok.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize("stream", [False, True])
def test_the_grammar_constrains_only_what_follows_the_reasoning(thinking, stream):
    """A +100 bias makes </think> the model's first token. A grammar applied from the first token
    would forbid it (then all the text is reasoning to deepseek_r1, and content is None); a grammar
    that waits for the reasoning lets it through and constrains the answer after it."""
    client, end_id = thinking
    kw = dict(model="tiny", messages=ASK, temperature=0, max_tokens=8, logit_bias={str(end_id): 100},
              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        content = message.content
    else:
        content = "".join(ch.delta.content or "" for chunk in client.chat.completions.create(stream=True, **kw)
                          for ch in chunk.choices)
    assert content in ("yes", "no")
