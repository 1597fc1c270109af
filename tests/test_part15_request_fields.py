"""Part 15's request fields (request_fields.py): every field vLLM defines is honoured or refused
with a 400 naming it; an unknown one is logged and ignored. On a tiny random Llama (dummy weights):

- the sampler: allowed_token_ids and bad words (one token, several, the newest token still in
  flight) sample what the shared sampler samples with the same tokens banned by vLLM's rule;
- bad_words: the greedy output without them contains the word, with them no banned sequence;
  allowed_token_ids: every generated id is in the set (greedy and sampled);
- over HTTP: truncate_prompt_tokens, min_tokens with stop_token_ids, include_stop_str_in_output,
  skip_special_tokens, the chat template's knobs (add_generation_prompt, continue_final_message
  against HF's apply_chat_template), the refused fields, the unknown-field warning."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import running_server
from test_part15_server import tiny_model_folder

PROMPT = "The capital of France is"


@dataclass
class Entry:
    sampling: object
    prev_row: int | None = None


def vllm_bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's rule (vllm/v1/sample/ops/bad_words.py): a word's last token is banned when the output
    ends with the rest of the word."""
    return [w[-1] for w in words if len(w) <= len(output) + 1 and (len(w) == 1 or output[-(len(w) - 1):] == w[:-1])]


@pytest.mark.parametrize("in_flight", [False, True])
def test_sampler_bans_as_the_shared_sampler_with_vllms_rule(in_flight):
    from part15_full.sampler import Sampler
    from part15_full.sampling_metadata import SamplingState
    from part15_full.sampling_params import SamplingParams
    from shared.sampler import Sampler as RowSampler, SamplingRow, make_generator

    V, rng = 60, random.Random(3)
    rows_ref, rows_ours, prev = [], [], torch.tensor([rng.randrange(V) for _ in range(8)])
    cases = [dict(allowed_token_ids=[3, 9, 41]), dict(temperature=0.8, allowed_token_ids=list(range(10, 30))),
             dict(bad_words_token_ids=[[5], [7, 8], [1, 2, 3]]), dict(temperature=1.0, bad_words_token_ids=[[4, 4]]),
             dict(temperature=0.0), dict(allowed_token_ids=[11, 12], bad_words_token_ids=[[12]])]
    entries, matched = [], 0
    for i, knobs in enumerate(cases):
        params = SamplingParams(max_tokens=50, seed=i, temperature=knobs.pop("temperature", 0.0), **knobs)
        output = [rng.randrange(V) for _ in range(4)]
        prev_row = i if in_flight else None
        long_words = [w for w in params.bad_words_token_ids or [] if len(w) > 1]
        if long_words and i % 2 == 0:  # the output ends with a word's prefix (its newest token in flight)
            w = long_words[-1]
            output += w[:-2] if in_flight else w[:-1]
            if in_flight:
                prev[prev_row] = w[-2]
        full = output + ([int(prev[prev_row])] if in_flight else [])
        bans = vllm_bad_word_bans(params.bad_words_token_ids or [], full)
        matched += any(w[-1] in bans for w in long_words)
        if params.allowed_token_ids:
            bans += [t for t in range(V) if t not in params.allowed_token_ids]
        rows_ref.append(SamplingRow(params, make_generator(params.seed, torch.device("cpu")), [], full, tuple(bans)))
        rows_ours.append(SamplingRow(params, make_generator(params.seed, torch.device("cpu")), [], output, ()))
        entries.append(Entry(rows_ours[-1], prev_row))
    assert matched  # a multi-token word's ban is exercised
    state = SamplingState(len(cases), V)
    rows = np.arange(len(cases))
    for r, e in zip(rows, entries):
        state.write(int(r), e.sampling)
    for _ in range(3):
        logits = torch.randn(len(cases), V) * 3
        want = RowSampler().sample(logits.clone(), rows_ref).to_output().token_ids
        got = Sampler().sample(logits.clone(), state.metadata(rows, entries), prev).to_output().token_ids
        assert got == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny):
    from part15_full import LLM

    llm = LLM(model=str(tiny), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16)
    yield llm
    llm.shutdown()


def greedy(llm, **kw):
    from part15_full.sampling_params import SamplingParams

    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw))[0].outputs[0]


def vllm_bad_word_forms(tok, word: str) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer: the word alone, and after a space when that
    starts with another token and has as many."""
    alone = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids) - len(word) + 1))


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_keep_the_word_out_of_the_greedy_output(llm, length):
    tok = llm.tokenizer
    plain = greedy(llm).token_ids
    for k in range(2, len(plain) - length):  # a word whose banned tokenization is in the output
        word = tok.decode(plain[k:k + length])
        forms = vllm_bad_word_forms(tok, word)
        if plain[k:k + length] in forms:
            break
    else:
        pytest.fail("no word of the greedy output tokenizes back to itself")
    banned = greedy(llm, bad_words=[word]).token_ids
    assert contains(plain, plain[k:k + length])
    assert not any(contains(banned, f) for f in forms)
    assert banned[:k] == plain[:k]  # nothing changes before the word would start


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_is_all_that_is_generated(llm, temperature):
    from part15_full.sampling_params import SamplingParams

    allowed = [17, 250, 9001, 30000]
    out = llm.generate(PROMPT, SamplingParams(temperature=temperature, seed=1, max_tokens=12, ignore_eos=True,
                                              allowed_token_ids=allowed))[0].outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    assert not set(greedy(llm).token_ids) <= set(allowed)


# ---- over HTTP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny):
    from part15_full import LLM
    from part15_full.async_llm import AsyncLLM
    from part15_full.server import build_app

    llm = LLM(model=str(tiny), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16)
    with running_server(build_app(AsyncLLM(llm.engine), "tiny")) as url:
        yield url


def complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True, **body}, timeout=60)


def chat(url, messages, **body):
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0,
                                                          **body}, timeout=60)


def test_truncate_prompt_tokens_keeps_the_last_n(served, llm):
    ids = llm.tokenizer.encode(PROMPT)
    r = complete(served, truncate_prompt_tokens=3).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == complete(served, prompt=ids[-3:]).json()["choices"][0]["text"]
    assert complete(served, truncate_prompt_tokens=0).status_code == 400


def test_min_tokens_holds_back_a_stop_token(served):
    first = complete(served, max_tokens=1).json()["choices"][0]["text"]
    first_id = httpx.post(f"{served}/tokenize", json={"prompt": PROMPT + first, "add_special_tokens": False}).json()["tokens"][-1]
    stopped = complete(served, stop_token_ids=[first_id], ignore_eos=False).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = complete(served, stop_token_ids=[first_id], min_tokens=3, ignore_eos=False).json()
    assert held["usage"]["completion_tokens"] >= 3


def test_include_stop_str_in_output(served):
    text = complete(served).json()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = complete(served, stop=[stop]).json()["choices"][0]["text"]
    kept = complete(served, stop=[stop], include_stop_str_in_output=True).json()["choices"][0]["text"]
    assert stop not in cut and kept == cut + stop


def test_skip_special_tokens(served, llm):
    special = llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    body = dict(allowed_token_ids=special, max_tokens=2)
    assert complete(served, **body).json()["choices"][0]["text"] == ""
    assert complete(served, skip_special_tokens=False, **body).json()["choices"][0]["text"] == "<|im_start|>" * 2
    r = complete(served, skip_special_tokens=False, spaces_between_special_tokens=False, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


MESSAGES = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is"}]


def test_chat_template_knobs_match_hf(served, llm):
    hf = llm.tokenizer.hf
    want = {"add": hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False),
            "no": hf.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False),
            "cont": hf.apply_chat_template(MESSAGES, continue_final_message=True, tokenize=True, return_dict=False)}
    assert len(set(map(len, want.values()))) == 3
    got = {"add": chat(served, MESSAGES), "no": chat(served, MESSAGES, add_generation_prompt=False),
           "cont": chat(served, MESSAGES, continue_final_message=True)}
    assert {k: r.json()["usage"]["prompt_tokens"] for k, r in got.items()} == {k: len(v) for k, v in want.items()}
    both = chat(served, MESSAGES, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("endpoint, field, value", [
    ("completions", "use_beam_search", True), ("completions", "logprob_token_ids", [1]),
    ("completions", "return_token_ids", True), ("completions", "add_special_tokens", False),
    ("completions", "truncation_side", "right"), ("completions", "stream_interval", 4),
    ("completions", "vllm_xargs", {"a": 1}), ("completions", "priority", 2),
    ("chat", "chat_template", "{{ messages }}"), ("chat", "add_special_tokens", True),
    ("chat", "mm_processor_kwargs", {"x": 1}), ("chat", "chat_template_kwargs", {"messages": []}),
    ("chat", "echo", True)])
def test_fields_that_cannot_be_honoured_are_a_400_naming_them(served, endpoint, field, value):
    r = complete(served, **{field: value}) if endpoint == "completions" else \
        chat(served, [{"role": "user", "content": "Hi"}], **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert complete(served).status_code == 200  # still serving


def test_unknown_fields_are_logged_and_ignored(served, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_course.server"):
        r = complete(served, not_a_field=1, another=[2])
    assert r.status_code == 200
    logged = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(logged) == 1 and "not_a_field" in logged[0] and "another" in logged[0]
    with caplog.at_level(logging.WARNING, logger="vllm_course.server"):
        caplog.clear()
        complete(served, bad_words=["x"], session_id="s", user="u")
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]
