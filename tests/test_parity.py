"""Every part against HF transformers on the same weights, cpu fp32: greedy token parity on the
fixed prompt set (4 plain, 4 chat-templated prompts, NEW_TOKENS each, all submitted in one
`generate` call, so a part that batches runs them together), and the offline API's prompt forms
(a string, vLLM's prompt dicts, a chat conversation).

The parts are discovered (`shared.course.stages()` through conftest's PARTS): a new part folder is
tested here as soon as it exists. Each part's engine is conftest's `llm_for(part)`, built once per
session on the oracle tier. Tests about one part's technique live in test_partNN_*.py."""
from __future__ import annotations

import pytest

from conftest import CHAT_PROMPTS, NEW_TOKENS, PARTS, PLAIN_PROMPTS
from shared.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHORT = 4


@pytest.fixture(scope="module", params=PARTS)
def part_llm(request, llm_for):
    """(part, its LLM): module-scoped and parametrized, so pytest runs one part's tests together."""
    return request.param, llm_for(request.param)


@pytest.fixture(scope="module")
def greedy_outputs(part_llm, prompt_token_ids):
    """The part's greedy continuation of the 8 prompts, one `generate` call, once per part."""
    _, llm = part_llm
    return llm.generate([list(p) for p in prompt_token_ids], GREEDY)


@pytest.mark.parametrize("i", range(len(PLAIN_PROMPTS) + len(CHAT_PROMPTS)))
def test_greedy_matches_hf(part_llm, greedy_outputs, prompt_token_ids, hf_greedy, i):
    _, llm = part_llm
    out, ids = greedy_outputs[i], prompt_token_ids[i]
    assert out.prompt_token_ids == ids
    assert out.finished and len(out.outputs) == 1
    c = out.outputs[0]
    ref = hf_greedy(ids, NEW_TOKENS)
    diverge = next((j for j, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), None)
    assert c.token_ids == ref, f"differs from HF at generated token {diverge}"
    assert c.finish_reason == "length"
    assert c.text == llm.tokenizer.decode(c.token_ids)


def hf_chat_ids(hf_tokenizer, text: str) -> list[int]:
    enc = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def test_prompt_sets_are_what_hf_tokenizes(prompt_token_ids, hf_tokenizer):
    """The prompt ids every parity test uses are HF's own tokenization and chat template."""
    for text, ids in zip(PLAIN_PROMPTS, prompt_token_ids[:4]):
        assert ids == hf_tokenizer(text).input_ids
    for text, ids in zip(CHAT_PROMPTS, prompt_token_ids[4:]):
        assert ids == hf_chat_ids(hf_tokenizer, text)


def test_prompt_forms(part_llm, hf_tokenizer, hf_greedy):
    """Strings, vLLM's prompt dicts and chat conversations, one or a list, give HF's greedy tokens
    for the ids HF's tokenizer and chat template make of them."""
    _, llm = part_llm
    few = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True)
    outs = llm.generate(PLAIN_PROMPTS, few)
    assert len(outs) == len(PLAIN_PROMPTS)
    for text, out in zip(PLAIN_PROMPTS, outs):
        ids = hf_tokenizer(text).input_ids
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(ids, NEW_TOKENS)[:SHORT]
    text, ids = PLAIN_PROMPTS[0], hf_tokenizer(PLAIN_PROMPTS[0]).input_ids
    for prompt in (text, {"prompt": text}, {"prompt_token_ids": ids}):
        one = llm.generate(prompt, few)
        assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids

    conversations = [[{"role": "user", "content": CHAT_PROMPTS[0]}],
                     [{"role": "user", "content": CHAT_PROMPTS[3]}]]
    chats = llm.chat(conversations, few)
    assert len(chats) == 2
    for conv, out in zip(conversations, chats):
        ids = hf_chat_ids(hf_tokenizer, conv[0]["content"])
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(ids, NEW_TOKENS)[:SHORT]
    single = llm.chat(conversations[1], few)  # one conversation, not wrapped in a list
    assert len(single) == 1 and single[0].outputs[0].token_ids == chats[1].outputs[0].token_ids
