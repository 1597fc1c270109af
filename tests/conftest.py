"""Session-wide fixtures: the embedded model, HF's reference model and the prompt set are loaded
once per test session and shared by every test."""
from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three fruits.",
]
NEW_TOKENS = 32


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_path():
    from shared.weights import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompt_token_ids(model_path) -> list[list[int]]:
    """8 prompts: 4 plain, 4 chat-templated, as token ids."""
    from shared.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    plain = [tok.encode(p) for p in PLAIN_PROMPTS]
    chat = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return plain + chat


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(ids, n) -> the n token ids HF's own greedy generate produces (memoised)."""
    from transformers import GenerationConfig

    cache: dict[tuple, list[int]] = {}

    def run(ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                # No EOS: HF runs the full n tokens, as our engine does with ignore_eos=True.
                config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=[],
                                          pad_token_id=0)
                out = hf_model.generate(torch.tensor([ids]), generation_config=config,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def llm01():
    from part01_simple_server import LLM

    return LLM()


@pytest.fixture(scope="session")
def llm02():
    from part02_streaming import LLM

    return LLM()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app):
    """Serve a FastAPI app with uvicorn on a loopback port in a background thread."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="session")
def llm03():
    from part03_paged_attention import LLM

    return LLM(kv_cache_memory_mb=256)


@pytest.fixture(scope="session")
def llm04():
    from part04_continuous_batching import LLM

    return LLM(kv_cache_memory_mb=256)
