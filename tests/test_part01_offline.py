"""Part 01's offline API against HF transformers on the embedded model: KV-cache decode equal to
full recompute, EOS, seeded sampling, n, logprobs, stop strings and tokens, and request
validation. Greedy parity on the prompt set and the prompt forms (strings, dicts, chat) are
tested for every part, this one included, in test_parity.py."""
from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams


def hf_chat_ids(hf_tokenizer, text: str) -> list[int]:
    enc = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return list(ids)


# ------------------------------------------------------------------------------------- EOS

def test_capital_of_france(llm01, hf_greedy, hf_tokenizer):
    """Sanity that the GGUF conversion gives a working model, and EOS ends a chat answer exactly
    where HF's greedy run emits it."""
    out = llm01.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))[0].outputs[0]
    assert "Paris" in out.text
    eos = llm01.engine.eos_token_ids
    assert eos
    ref = hf_greedy(hf_chat_ids(hf_tokenizer, "What is the capital of France?"), NEW_TOKENS)
    first_eos = next((j for j, t in enumerate(ref) if t in eos), None)
    if first_eos is None:
        assert out.finish_reason == "length" and out.token_ids == ref
    else:
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.token_ids == ref[: first_eos + 1]
        assert "<|im_end|>" not in out.text
    completion = llm01.generate("The capital of France is",
                                SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert "Paris" in completion.text


# ---------------------------------------------------------------------------------- KV cache

def test_kv_cache_decode_equals_recompute(llm01, prompt_token_ids, hf_greedy):
    runner = llm01.engine.runner
    prompt = list(prompt_token_ids[2])
    steps = 10
    cache = runner.new_cache(len(prompt) + steps)
    tokens, start = list(prompt), 0
    for step in range(steps):
        cached = runner.forward(tokens[start:], start, cache)
        full = runner.forward(tokens, 0, None)
        assert cached.shape == full.shape == (1, runner.model_config.vocab_size)
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
        assert cached.argmax().item() == full.argmax().item()
        tokens.append(int(cached.argmax()))
        start = len(tokens) - 1
    assert tokens[len(prompt):] == hf_greedy(prompt_token_ids[2], NEW_TOKENS)[:steps]


def test_kv_cache_chunked_prefill_equals_recompute(llm01, prompt_token_ids):
    """Prefill in two chunks (the second attends to the first through the cache) gives the same
    logits as one pass."""
    runner = llm01.engine.runner
    prompt = list(prompt_token_ids[6])
    k = len(prompt) // 2
    cache = runner.new_cache(len(prompt))
    runner.forward(prompt[:k], 0, cache)
    chunked = runner.forward(prompt[k:], k, cache)
    torch.testing.assert_close(chunked, runner.forward(prompt, 0, None), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------- sampling

SAMPLED_PROMPT = "Once upon a time, in a small village,"


def test_seeded_sampling_reproducible(llm01):
    params = SamplingParams(temperature=1.2, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm01.generate(SAMPLED_PROMPT, params)[0].outputs[0]
    torch.manual_seed(999)  # the global RNG must not matter
    llm01.generate(SAMPLED_PROMPT, SamplingParams(temperature=1.0, max_tokens=3))  # unseeded in between
    b = llm01.generate(SAMPLED_PROMPT, params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    c = llm01.generate(SAMPLED_PROMPT, SamplingParams(temperature=1.2, seed=4321, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0]
    assert c.token_ids != a.token_ids


def test_n_with_seed(llm01):
    params = SamplingParams(n=3, temperature=1.2, seed=7, max_tokens=8, ignore_eos=True)
    first = llm01.generate(SAMPLED_PROMPT, params)[0]
    second = llm01.generate(SAMPLED_PROMPT, params)[0]
    assert first.finished
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # n samples, not one copied


def test_logprobs_match_hf(llm01, hf_model, prompt_token_ids):
    ids = prompt_token_ids[0]
    out = llm01.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                               ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + out.token_ids])).logits[0].float().log_softmax(-1)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + j]
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-3)
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        for t in top3:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-3)
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


# ----------------------------------------------------------------------------------- stops

@pytest.mark.parametrize("include", [False, True])
def test_stop_string_end_to_end(llm01, prompt_token_ids, hf_greedy, hf_tokenizer, include):
    ids = prompt_token_ids[2]
    ref_tokens = hf_greedy(ids, NEW_TOKENS)
    ref_text = hf_tokenizer.decode(ref_tokens, skip_special_tokens=True)
    start = len(ref_text) // 3
    stop = ref_text[start: start + 6]  # an arbitrary slice: usually spans token boundaries
    assert stop.strip(), f"degenerate stop string {stop!r}"
    idx = ref_text.index(stop)  # its first occurrence, maybe before `start`
    out = llm01.generate([ids], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                               stop=[stop, "unlikely-stop-string-xyz"],
                                               include_stop_str_in_output=include))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (ref_text[: idx + len(stop)] if include else ref_text[:idx])
    # Generation stopped at the token that completed the stop string.
    n = len(out.token_ids)
    assert out.token_ids == ref_tokens[:n]
    assert stop in hf_tokenizer.decode(ref_tokens[:n]) and stop not in hf_tokenizer.decode(ref_tokens[: n - 1])


def test_stop_token_id_end_to_end(llm01, prompt_token_ids, hf_greedy):
    ids = prompt_token_ids[1]
    ref = hf_greedy(ids, NEW_TOKENS)
    target = ref[5]
    first = ref.index(target)
    out = llm01.generate([ids], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                               stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == ref[: first + 1]


def test_max_tokens_stops_with_length(llm01, prompt_token_ids, hf_greedy):
    ids = prompt_token_ids[3]
    out = llm01.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy(ids, NEW_TOKENS)[:3]


# ------------------------------------------------------------------------------ validation

def test_over_long_prompt_is_refused(llm01):
    limit = llm01.engine.max_model_len
    with pytest.raises(InvalidRequestError) as err:
        llm01.generate([[1] * limit], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        llm01.generate([[1] * (limit - 4)], SamplingParams(max_tokens=16))
    assert err.value.param == "max_tokens"
    assert str(limit) in str(err.value)


def test_empty_and_bad_prompts_are_refused(llm01):
    with pytest.raises(InvalidRequestError) as err:
        llm01.generate("", SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        llm01.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=1))
    vocab = llm01.engine.runner.model_config.vocab_size
    with pytest.raises(InvalidRequestError):
        llm01.generate([[1, vocab]], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        llm01.generate([[1, -1]], SamplingParams(max_tokens=1))
