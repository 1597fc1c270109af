"""Part 04 on: the prompts of one /v1/completions request are submitted together, so continuous
batching runs them in the same steps; each comes back exactly as if it had been sent alone (and
as HF's greedy generate makes it), streamed chunks interleave, and a client that leaves aborts
every one of them."""
from __future__ import annotations

import importlib
import time

import httpx
import openai
import pytest

from conftest import NEW_TOKENS, PLAIN_PROMPTS, engine_client, num_kv_blocks, running_server

MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(llm04):
    app = importlib.import_module("part04_continuous_batching.server").build_app(llm04, MODEL)
    with running_server(app) as url:
        yield url, app


@pytest.fixture
def running_sets(served, monkeypatch):
    """After every engine step: the request ids in the scheduler's running queue."""
    engine = engine_client(served[1]).engine
    seen: list[set[str]] = []
    step = engine.step

    def observed_step():
        out = step()
        seen.append({seq.request.request_id for seq in engine.scheduler.running})
        return out

    monkeypatch.setattr(engine, "step", observed_step)
    return seen


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def alone(url: str, prompt: str) -> str:
    return client(url).completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text


def wait_until_idle(app, aborted_before: int, expected_aborts: int) -> None:
    async_llm, engine = engine_client(app), engine_client(app).engine
    kv = engine.kv_cache_manager

    def idle() -> bool:
        return (async_llm.num_unfinished == 0 and async_llm.num_aborted == aborted_before + expected_aborts
                and kv.num_free_blocks == num_kv_blocks(engine) - 1 and not kv.req_to_blocks)

    deadline = time.monotonic() + 30
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_unfinished == 0
    assert async_llm.num_aborted == aborted_before + expected_aborts
    assert kv.num_free_blocks == num_kv_blocks(engine) - 1 and not kv.req_to_blocks  # no leaked block


def test_prompt_list_runs_together_and_matches_alone(served, running_sets, prompt_token_ids, hf_greedy,
                                                     hf_tokenizer):
    url, _ = served
    resp = client(url).completions.create(model=MODEL, prompt=PLAIN_PROMPTS, **GREEDY)
    assert max(map(len, running_sets)) == len(PLAIN_PROMPTS)  # all four in one running batch
    assert [c.index for c in resp.choices] == list(range(len(PLAIN_PROMPTS)))
    for choice, prompt, ids in zip(resp.choices, PLAIN_PROMPTS, prompt_token_ids):
        assert choice.text == alone(url, prompt)
        assert choice.text == hf_tokenizer.decode(hf_greedy(ids), skip_special_tokens=True)
        assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == sum(len(ids) for ids in prompt_token_ids[:4])
    assert resp.usage.completion_tokens == NEW_TOKENS * len(PLAIN_PROMPTS)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_prompt_list_interleaves_and_matches_alone(served, running_sets, prompt_token_ids):
    url, _ = served
    n = 2  # choice index = prompt index * n + sample index
    chunks = list(client(url).completions.create(model=MODEL, prompt=prompt_token_ids[:4], n=n, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert max(map(len, running_sets)) == 4
    texts: dict[int, str] = {}
    order = []
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        order.append(choice.index)
    assert sorted(texts) == list(range(4 * n))
    for p, ids in enumerate(prompt_token_ids[:4]):
        expected = client(url).completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text
        assert [texts[p * n + c] for c in range(n)] == [expected] * n
    # Interleaved as the engine makes them, not one prompt after another.
    assert order.index(n * 3) < len(order) - 1 - order[::-1].index(0)
    usage = chunks[-1]
    assert not usage.choices
    assert usage.usage.prompt_tokens == sum(len(ids) for ids in prompt_token_ids[:4])
    assert usage.usage.completion_tokens == NEW_TOKENS * 4 * n


def test_raw_stream_ends_with_usage_then_done(served):
    url, _ = served
    body = {"model": MODEL, "prompt": ["Hello", "Good morning"], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"usage"' in events[-2] and '"completion_tokens":8' in events[-2]


LONG = {"model": MODEL, "prompt": ["Tell me a long story.", "Write a long poem.", "Count to a thousand."],
        "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def test_stream_disconnect_aborts_every_prompt(served):
    url, app = served
    aborted_before = engine_client(app).num_aborted
    seen = 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 6:
                break  # leaving the block closes the connection: a client disconnect
    wait_until_idle(app, aborted_before, len(LONG["prompt"]))


def test_non_streaming_disconnect_aborts_every_prompt(served):
    url, app = served
    aborted_before = engine_client(app).num_aborted
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0))
    wait_until_idle(app, aborted_before, len(LONG["prompt"]))
