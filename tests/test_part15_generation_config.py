"""Part 15's engine flags for request defaults, on a tiny random Llama (dummy weights):
--generation-config (the model's generation_config.json as defaults, a request's value wins,
max_new_tokens caps max_tokens; `vllm` ignores the file), --seed (two engine starts sample the same
tokens for unseeded requests; another seed does not), --chat-template (a file replaces the
tokenizer's template, and chat_template_kwargs reach it)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import running_server
from test_part15_server import tiny_model_folder

GEN = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5, "do_sample": True}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting | default('') }}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny"))
    (folder / "generation_config.json").write_text(json.dumps(GEN))
    return folder


def llm_for(folder: Path, **kw):
    from part15_full import LLM

    return LLM(model=str(folder), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_mb=16, **kw)


def test_defaults_from_the_generation_config_and_the_request_wins(tiny):
    from part15_full.generation_config import default_sampling_params
    from part15_full.protocol import ChatCompletionRequest, CompletionRequest

    defaults = default_sampling_params("auto", tiny)
    assert defaults == {"temperature": 0.0, "top_k": 7, "max_tokens": 5}
    assert default_sampling_params("vllm", tiny) == {}
    p = CompletionRequest(prompt="x").to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 7, 5)
    p = CompletionRequest(prompt="x", temperature=0.9, top_k=3, max_tokens=2).to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.9, 3, 2)
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=50).to_sampling_params(defaults)
    assert p.max_tokens == 5  # vLLM takes the smaller
    p = CompletionRequest(prompt="x").to_sampling_params({})
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, 16)


def test_server_applies_the_generation_config_and_the_chat_template(tiny, tmp_path):
    from part15_full.async_llm import AsyncLLM
    from part15_full.server import build_app

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    llm = llm_for(tiny, chat_template=str(tmp_path / "t.jinja"))
    with running_server(build_app(AsyncLLM(llm.engine), "tiny")) as url:
        body = {"prompt": "The capital of France is", "ignore_eos": True}
        a, b = (httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for _ in range(2))
        assert a["usage"]["completion_tokens"] == 5  # max_new_tokens
        assert a["choices"][0]["text"] == b["choices"][0]["text"]  # temperature 0 from the file
        explicit = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0, "top_k": 0}, timeout=60).json()
        assert explicit["choices"][0]["text"] == a["choices"][0]["text"]
        msgs = [{"role": "user", "content": "Hi there"}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("Hi there", add_special_tokens=False))
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": msgs, "chat_template_kwargs": {"greeting": " and hello"}}).json()
        assert r["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("Hi there and hello", add_special_tokens=False))


def test_seed_makes_unseeded_sampling_repeat_across_starts(tiny):
    from part15_full.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = llm_for(tiny, seed=seed, generation_config="vllm")
        try:
            return [o.outputs[0].token_ids for o in llm.generate(["Hello", "The sky"], params)]
        finally:
            llm.shutdown()

    first = run(11)
    assert run(11) == first
    assert run(12) != first


def test_invalid_flags_are_named():
    from part15_full.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(scheduling_policy="lifo", generation_config="/nowhere", chat_template="/no/such.jinja",
                     device="cpu").validate()
    for flag in ("--scheduling-policy", "--generation-config", "--chat-template"):
        assert flag in str(e.value)
