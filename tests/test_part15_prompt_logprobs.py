"""Part 15's prompt logprobs and echo (what evaluation harnesses send), on a tiny random Llama
checkpoint saved with real weights, so that HF transformers (cpu, fp32) loads the same model: its
log_softmax over the prompt's logits is the oracle.

- `prompt_logprobs` on /v1/completions and /v1/chat/completions equal HF's, with chunked prefill
  splitting the prompt (16-token steps) and with a prefix-cache hit attempted (the same prompt again:
  still exact, and no hit taken, while a plain request does hit);
- `echo` + `logprobs`: the prompt's tokens first (the first null), then the generated ones, text
  and text offsets to match; token-id prompts, lists of prompts, streaming;
- `max_tokens: 0` with echo returns the prompt alone (streamed too); without echo it is a 400;
- bad values are 400s naming the field and the server keeps serving; speculative decoding refuses
  prompt logprobs at the door; an engine core in its own process sends them across too."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import running_server

PROMPT_IDS = [1] + list(range(300, 339))  # 40 tokens: three 16-token prefill steps
TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
TOL = 1e-4


def tiny_checkpoint(path: Path) -> Path:
    """test_part15_server.py's tiny Llama folder (config and the embedded model's tokenizer), its
    random weights saved whole so that HF and the engine load the same ones."""
    from test_part15_server import tiny_model_folder
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_model_folder(path)
    config = LlamaConfig.from_pretrained(path)
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-weights"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(checkpoint))


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(. | ids[:i + 1])."""
    with torch.no_grad():
        return hf[0](torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def engine_config(checkpoint, **kw):
    from part15_full.config import EngineConfig

    return EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", kv_cache_memory_mb=16,
                        max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True, **kw)


@pytest.fixture(scope="module")
def server(checkpoint):
    """(url, engine): an in-process server whose prefills run 16 tokens a step."""
    from part15_full.async_llm import AsyncLLM
    from part15_full.engine import LLMEngine
    from part15_full.server import build_app

    engine = LLMEngine(engine_config(checkpoint))
    with running_server(build_app(AsyncLLM(engine), "tiny")) as url:
        yield url, engine


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": "tiny", **body}, timeout=60)


def assert_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape (null first, then token id -> {logprob, rank, decoded_token}) and HF's values."""
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry, row = entries[i], ref[i - 1]
        chosen = entry[str(ids[i])]
        assert chosen["logprob"] == pytest.approx(row[ids[i]].item(), abs=TOL)
        x = row[ids[i]]  # the rank counts the better tokens: those within fp32 noise of x may go either way
        assert int((row > x + TOL).sum()) + 1 <= chosen["rank"] <= int((row > x - TOL).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(entry) == {str(ids[i]), *map(str, top)}
        for r, t in enumerate(top, start=1):
            assert entry[str(t)]["rank"] == r or t == ids[i]
            assert entry[str(t)]["logprob"] == pytest.approx(row[t].item(), abs=TOL)


def test_prompt_logprobs_equal_hfs_across_chunks_and_take_no_prefix_cache_hit(server, hf):
    url, engine = server
    ref = hf_logprobs(hf, PROMPT_IDS)
    stats = engine.prefix_cache_stats
    for attempt in range(2):  # the second finds the first's blocks in the cache, and must not use them
        hits = stats.hits
        r = post(url, "completions", {"prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
        assert r.status_code == 200, r.text
        assert_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], PROMPT_IDS, ref, 3)
        assert stats.hits == hits
    hits = stats.hits  # the cache does hold the prompt: a request without prompt logprobs hits it
    assert post(url, "completions", {"prompt": PROMPT_IDS, "max_tokens": 1}).status_code == 200
    assert stats.hits > hits


def test_chat_prompt_logprobs_are_beside_the_choices(server, hf):
    url, _ = server
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = post(url, "chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert all(len(e) == 1 for e in entries[1:])  # 0: the prompt's own token only
    assert_prompt_logprobs(entries, ids, hf_logprobs(hf, ids), 0)
    assert post(url, "chat/completions", {"messages": messages, "max_tokens": 2}).json()["prompt_logprobs"] is None


def assert_echo_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, text: str) -> None:
    """Completions' logprobs over prompt + generated tokens `ids`: null first, HF's values, offsets."""
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL)
        best = ref[i - 1].max().item()
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(best, abs=TOL)
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets
    assert "".join(lp["tokens"]) == text


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_echo_with_logprobs_is_the_prompt_then_the_completion(server, hf, max_tokens):
    """lm-evaluation-harness's request (max_tokens 1) and a longer one; two token-id prompts in one
    request; the generated tokens are HF's greedy ones and their logprobs HF's too."""
    url, _ = server
    prompts = [PROMPT_IDS, PROMPT_IDS[:7]]
    r = post(url, "completions", {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                                  "echo": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    tok = hf[1]
    for prompt, choice in zip(prompts, choices):
        with torch.no_grad():
            full = hf[0].generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0].tolist()
        ref = hf_logprobs(hf, full)
        generated = tok.decode(full[len(prompt):])
        assert choice["text"] == tok.decode(prompt) + generated
        assert_echo_logprobs(choice["logprobs"], full, ref, choice["text"])


def test_echo_of_a_text_prompt_and_max_tokens_0(server, hf):
    url, _ = server
    ids = hf[1](TEXT)["input_ids"]
    body = {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    r = post(url, "completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == TEXT  # the prompt alone
    assert_echo_logprobs(choice["logprobs"], ids, hf_logprobs(hf, ids), TEXT)
    assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"][1:])
    # streamed: the same prompt, in one chunk, then [DONE]
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "tiny", **body, "stream": True},
                      timeout=60) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == TEXT
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(ids)
    # without echo, max_tokens 0 asks for nothing: a 400, as vLLM
    r = post(url, "completions", {"prompt": TEXT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_streamed_echo_is_the_whole_responses_text_and_logprobs(server):
    url, _ = server
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = post(url, "completions", body).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "tiny", **body, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["text"].startswith(TEXT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][key]] == pytest.approx(whole["logprobs"][key])


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # the whole vocabulary: more than the 20 allowed
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),  # vLLM does not stream them
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
])
def test_bad_requests_are_400s_and_the_server_keeps_serving(server, body, param):
    url, _ = server
    r = post(url, "completions", {"prompt": TEXT, "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    ok = post(url, "completions", {"prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["prompt_logprobs"]) > 1


def test_speculative_decoding_refuses_prompt_logprobs(checkpoint):
    from part15_full import LLM
    from part15_full.sampling_params import SamplingParams
    from shared.errors import InvalidRequestError

    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", kv_cache_memory_mb=16,
              speculative_method="ngram", num_speculative_tokens=2)
    try:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=1))
        assert e.value.param == "prompt_logprobs"
        assert llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1))[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_an_engine_core_process_sends_them_across(checkpoint, hf):
    """--multiprocess-engine-core: the prompt logprobs cross the msgpack socket with the first output."""
    from part15_full.core_client import AsyncMPClient
    from part15_full.server import build_app

    client = AsyncMPClient(engine_config(checkpoint, multiprocess_engine_core=True))
    with running_server(build_app(client, "tiny")) as url:
        r = post(url, "completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    assert_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], PROMPT_IDS, hf_logprobs(hf, PROMPT_IDS), 1)
