"""`load_format="dummy"` (vLLM's `--load-format dummy`): a model folder holding only config.json
gets seeded random weights in [-1e-3, 1e-3], every part runs it on token-id prompts (no tokenizer:
ids in, ids out, empty text, text prompts refused as with vLLM's --skip-tokenizer-init), and the
benchmark harness measures it. "auto" on such a folder says to use dummy."""
from __future__ import annotations

import importlib
import shutil

import httpx
import pytest
import torch

from shared.course import stages
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams
from shared.tokenizer import TOKENIZER_FILES
from shared.weights import load_model, resolve_model_path
from conftest import greedy

PARTS = [s.name for s in stages()]
VOCAB = 49152  # the embedded SmolLM2's, so its tokenizer fits the same config


def tiny_config_folder(path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]  # config only: no weights
    return path


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    return tiny_config_folder(tmp_path_factory.mktemp("config_only"))


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    path = tiny_config_folder(tmp_path_factory.mktemp("with_tokenizer"))
    embedded = resolve_model_path(None)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, path / name)
    return path


def dummy_llm(part: str, folder, **kw):
    if int(part[4:6]) >= 3:
        kw.setdefault("kv_cache_memory_mb", 4)  # the paged parts: a small pool for a small model
    return importlib.import_module(part).LLM(model=str(folder), load_format="dummy", device="cpu",
                                             dtype="float32", **kw)


@pytest.mark.parametrize("part", PARTS)
def test_every_part_generates_token_ids_from_random_weights(part, config_only):
    llm = dummy_llm(part, config_only)
    out = llm.generate([[5, 17, 300, 2024], [9, 8, 7]], greedy(6))
    for o in out:
        c = o.outputs[0]
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in c.token_ids)
        assert c.text == ""  # no tokenizer: ids only
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("a text prompt", greedy(2))
    assert e.value.param == "prompt" and "token ids" in str(e.value)
    if hasattr(llm, "shutdown"):
        llm.shutdown()


def test_no_tokenizer_refuses_chat_and_stop_strings(config_only):
    llm = dummy_llm("part04_continuous_batching", config_only)
    with pytest.raises(InvalidRequestError) as e:
        llm.chat([{"role": "user", "content": "hi"}], greedy(2))
    assert e.value.param == "messages" and "no tokenizer" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["x"]))
    assert e.value.param == "stop"
    # stop_token_ids need no tokenizer: greedy's own first token, made a stop token, ends it at once.
    first = llm.generate([[1, 2, 3]], greedy(1))[0].outputs[0].token_ids[0]
    c = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[first]))[0].outputs[0]
    assert c.token_ids == [first] and c.finish_reason == "stop" and c.stop_reason == first


def test_server_on_a_model_without_tokenizer(config_only):
    from conftest import running_server

    llm = dummy_llm("part04_continuous_batching", config_only)
    app = importlib.import_module("part04_continuous_batching.server").build_app(llm, "dummy")
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["choices"][0]["text"] == ""
        for path, body, param in [("/v1/completions", {"prompt": "hello"}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                   "messages")]:
            r = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "no tokenizer" in r.json()["error"]["message"]


def test_with_a_tokenizer_text_prompts_work(with_tokenizer):
    from transformers import AutoTokenizer

    llm = dummy_llm("part04_continuous_batching", with_tokenizer)
    hf = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    out = llm.generate("The capital of France is", greedy(5))[0]
    assert out.prompt_token_ids == hf("The capital of France is").input_ids
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.text == hf.decode(c.token_ids, skip_special_tokens=True)
    assert llm.chat([{"role": "user", "content": "hi"}], greedy(2))[0].outputs[0].token_ids


def test_auto_on_a_folder_without_weights_names_dummy(config_only):
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        load_model(config_only, torch.device("cpu"), torch.float32)
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        importlib.import_module("part04_continuous_batching").LLM(model=str(config_only), device="cpu")


def test_unknown_load_format_is_refused(config_only):
    with pytest.raises(ValueError, match="unknown load_format 'npz'.*auto, dummy"):
        load_model(config_only, torch.device("cpu"), torch.float32, load_format="npz")


def test_dummy_weights_are_small_seeded_and_not_constant(config_only):
    a = load_model(config_only, torch.device("cpu"), torch.float32, load_format="dummy")
    b = load_model(config_only, torch.device("cpu"), torch.float32, load_format="dummy")
    named = dict(a.named_parameters())
    for name, p in named.items():
        assert p.abs().max().item() <= 1e-3, name
        assert p.unique().numel() > p.numel() // 2, name  # random, not a constant fill
        assert torch.equal(p, dict(b.named_parameters())[name]), name  # seeded: every load the same
    flat = [p.flatten()[:64] for p in named.values()]
    assert not any(torch.equal(x, y) for i, x in enumerate(flat) for y in flat[i + 1:])  # one stream, not reseeded


def test_bench_harness_runs_on_a_dummy_folder(config_only):
    from shared.bench.throughput import run_throughput
    from shared.bench.workload import make_workload

    w = make_workload(str(config_only), num_requests=4, input_len="4:8", output_len="2:4", seed=0)
    assert w.vocab_size == VOCAB  # no tokenizer: the pool is the config's vocabulary
    res = run_throughput("part04_continuous_batching", w, model=str(config_only), device="cpu", dtype="float32",
                         engine_kwargs={"load_format": "dummy", "kv_cache_memory_mb": 4},
                         hf_batch_size=4, progress=False, floor=False)
    assert [s.name for s in res.systems] == ["ours", "hf-generate", "hf-generate-batch"]
    for s in res.systems:
        assert s.error is None and s.lengths_ok and s.output_tokens == w.output_tokens, (s.name, s.error)
        assert s.matches_ours is None  # different random weights: tokens are not compared
    assert res.workload["load_format"] == "dummy" and "dummy" in res.table()
