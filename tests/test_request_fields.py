"""OpenAI request fields that are honoured end to end through a server: `logit_bias` moves greedy
decoding exactly as HF's logits say it must, and `response_format: {"type": "text"}` (the only
format without structured output) is accepted and changes nothing. (Fields we cannot honour are
refused: see BAD_REQUESTS in test_servers.py.)"""
from __future__ import annotations

import importlib

import openai
import pytest
import torch

from conftest import running_server

MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def url(llm04):
    app = importlib.import_module("part04_continuous_batching.server").build_app(llm04, MODEL)
    with running_server(app) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_response_format_is_accepted(url, prompt_token_ids):
    c = client(url)
    plain = c.completions.create(model=MODEL, prompt=prompt_token_ids[0], max_tokens=8, **GREEDY).choices[0].text
    fmt = c.completions.create(model=MODEL, prompt=prompt_token_ids[0], max_tokens=8,
                               extra_body={"ignore_eos": True, "response_format": {"type": "text"}},
                               temperature=0).choices[0].text
    assert fmt == plain
    msgs = [{"role": "user", "content": "List three fruits."}]
    chat_plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, **GREEDY)
    chat_fmt = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, response_format={"type": "text"},
                                         **GREEDY)
    assert chat_fmt.choices[0].message.content == chat_plain.choices[0].message.content


def test_positive_logit_bias_forces_a_token(url, prompt_token_ids, hf_greedy, hf_tokenizer):
    ids = prompt_token_ids[0]  # "The capital of France is"
    forced = hf_tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert forced not in hf_greedy(ids, 4)  # without the bias greedy never picks it here
    c = client(url)
    unbiased = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY).choices[0].text
    assert unbiased == hf_tokenizer.decode(hf_greedy(ids, 4))
    biased = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, logit_bias={str(forced): 100},
                                  **GREEDY).choices[0].text
    assert biased == hf_tokenizer.decode([forced] * 4) != unbiased


def test_negative_logit_bias_bans_the_greedy_token(url, prompt_token_ids, hf_model, hf_tokenizer):
    c = client(url)
    for ids in prompt_token_ids[:4]:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
        first, runner_up = logits.topk(2).indices.tolist()
        resp = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=0,
                                    logit_bias={str(first): -100}, **GREEDY)
        # The next-best token by HF's own logits takes its place.
        assert resp.choices[0].logprobs.tokens == [hf_tokenizer.decode([runner_up])]
        assert resp.choices[0].logprobs.tokens != [hf_tokenizer.decode([first])]
