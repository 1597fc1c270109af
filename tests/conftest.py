"""Session-wide fixtures: the embedded model, HF's reference model and the prompt set are loaded
once per test session and shared by every test.

Every part's engine comes from one factory, `llm_for(part)`: built on first use and reused, on the
oracle's tier (cpu, fp32: the tier HF's reference runs on, whatever hardware runs the tests), with
a 128 MiB KV pool for the paged parts. `build_llm(part, **overrides)` builds an uncached one (a
tiny pool, say) on the same tier. `PARTS` is every part folder there is (`shared.course.stages()`),
so a new part is in the cross-part tests as soon as its folder exists."""
from __future__ import annotations

import contextlib
import importlib
import os
import random
from pathlib import Path

# Before numpy and torch start their thread pools: an idle OpenMP thread sleeps instead of
# spinning. Beside another busy process (a notebook kernel, a server subprocess, anything else on
# a small CI runner) spinning threads fight the working ones for the cores: on the 2-core course
# machine, with one other process busy, HF's 32-token greedy run took 12.0 s with the default
# policy and 1.5 s with PASSIVE. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (`make test`: two workers on the course's two cores) each worker takes its share
# of the cores for its OpenMP threads, and the servers and notebook kernels it starts inherit that:
# two workers of two threads each on two cores make every parallel op wait on a descheduled thread.
# On four part files, 1 thread a worker used a third of the system time of 2 (5.2-5.9 s against
# 14.8-15.2). The kernels' thread splits are tested with their thread counts set explicitly.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import numpy as np
import pytest
import torch

from shared.course import stages

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

# The oracle tier: greedy parity is checked against HF transformers in fp32 on the CPU, so every
# engine compared with it runs there too (an automatic device would pick cuda + bf16 on a GPU).
ORACLE = {"device": "cpu", "dtype": "float32"}
PAGED_KV_MB = 128  # KV pool of the parts that have one (part 03 on): 182 blocks, 2900 tokens
PARTS = [s.name for s in stages()]

# `make test` hands whole files to two pytest-xdist workers in collection order
# (--no-loadscope-reorder). The two longest files go first, so neither is left running alone at
# the end; the rest keep their order.
LONGEST_FIRST = ("test_notebooks.py", "test_servers.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def part_number(part: str) -> int:
    return int(part[4:6])  # part03_paged_attention -> 3


def build_llm(part: str, **overrides):
    """A new `LLM` of `part` on the oracle tier (uncached: for tests that need their own engine)."""
    kwargs = dict(ORACLE)
    if part_number(part) >= 3:
        kwargs["kv_cache_memory_mb"] = PAGED_KV_MB
    kwargs.update(overrides)
    return importlib.import_module(part).LLM(**kwargs)


def release_memory() -> None:
    """Collect what a test module or an evicted engine left, and hand glibc's freed heap back to
    the OS: the weights' tensors are heap allocations (glibc raises its mmap threshold after the
    first big free), and without a trim every engine built in the session stays resident."""
    import ctypes
    import gc

    # FastAPI caches facts about every endpoint function it has seen (lru_caches keyed by the
    # function), and a server's endpoints are closures over its engine: every app a test built
    # would keep its engine alive for the rest of the session.
    with contextlib.suppress(ImportError):
        import fastapi.dependencies.models as fastapi_models

        for obj in list(vars(fastapi_models).values()):
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    yield
    release_memory()


@pytest.fixture
def release_memory_after_each_test():
    """For modules whose tests each build engines of their own (a module opts in with
    `pytestmark = pytest.mark.usefixtures("release_memory_after_each_test")`): without it their
    engines pile up until the module ends (part 13's file reached 9.9 GB)."""
    yield
    release_memory()


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
    """hf_greedy(ids, n) -> the n token ids HF's own greedy generate produces.

    Greedy decoding is prefix-stable (the first k tokens of a longer run are the k-token run), so
    each prompt is generated once, for max(n, NEW_TOKENS) tokens, and shorter asks are slices."""
    from transformers import GenerationConfig

    cache: dict[tuple, list[int]] = {}

    def run(ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = tuple(ids)
        if key not in cache or len(cache[key]) < n:
            with torch.no_grad():
                # No EOS: HF runs the full n tokens, as our engine does with ignore_eos=True.
                config = GenerationConfig(max_new_tokens=max(n, NEW_TOKENS), do_sample=False,
                                          eos_token_id=[], pad_token_id=0)
                out = hf_model.generate(torch.tensor([ids]), generation_config=config,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            cache[key] = out[0, len(ids):].tolist()
        return cache[key][:n]

    return run


# Engines kept alive at once by `llm_for` (about 0.65 GB each: weights and pool). Tests run part by
# part, so two cover the switch from one part's tests to the next; rebuilding one costs ~2 s. Under
# `make test` two pytest-xdist workers each keep their own, so one each.
MAX_CACHED_LLMS = int(os.environ.get("COURSE_TEST_MAX_LLMS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))


@pytest.fixture(scope="session")
def llm_for():
    """llm_for(part) -> that part's `LLM` on the oracle tier, built on first use and reused for the
    rest of the session. At most MAX_CACHED_LLMS are kept (least recently used dropped first, and
    rebuilt if asked for again: a second or two), so memory stays bounded however many parts there
    are; a dropped engine lives on while a test or fixture still holds it. At session end the kept
    engines that have a `shutdown()` (worker processes, threads) are shut down."""
    from collections import OrderedDict

    cache: OrderedDict[str, object] = OrderedDict()

    def get(part: str):
        if part in cache:
            cache.move_to_end(part)
        else:
            while len(cache) >= MAX_CACHED_LLMS:
                cache.popitem(last=False)
                release_memory()
            cache[part] = build_llm(part)
        return cache[part]

    yield get
    for llm in cache.values():
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()


# Thin aliases, for tests about one part. Module-scoped: a session-scoped alias would keep its
# engine alive to the end, past llm_for's bound.
@pytest.fixture(scope="module")
def llm01(llm_for):
    return llm_for("part01_simple_server")


@pytest.fixture(scope="module")
def llm02(llm_for):
    return llm_for("part02_streaming")


@pytest.fixture(scope="module")
def llm03(llm_for):
    return llm_for("part03_paged_attention")


@pytest.fixture(scope="module")
def llm04(llm_for):
    return llm_for("part04_continuous_batching")


def build_app(part: str, llm, model_name: str):
    """`part`'s server app over an LLM's engine. From part 10 on, servers take an EngineClient; the
    in-process one (AsyncLLM) wraps the same engine."""
    server = importlib.import_module(f"{part}.server")
    if part_number(part) >= 10:
        llm = importlib.import_module(f"{part}.async_llm").AsyncLLM(llm.engine)
    return server.build_app(llm, model_name)


def engine_client(app):
    """What drives the app's engine: its AsyncLLM (parts 02-08) or its EngineClient (09 on)."""
    return getattr(app.state, "engine_client", None) or app.state.async_llm


def free_port() -> int:
    """A free loopback port, from the same range as free_port_run (below): one the OS handed out
    itself (bind to 0) lies in its ephemeral range, where another socket may take it before the
    test's server binds it."""
    return free_port_run(1)


_next_port: int | None = None  # free_port_run's walk through this worker's slice


def free_port_run(n: int) -> int:
    """The first of n consecutive free loopback ports, for a launcher that binds the ports after the
    one it is given (part 09's --master-port: +1 and +2; part 10's RPC port and part 13's --kv-port:
    +1).

    Chosen below the OS's ephemeral range, where the kernel's own picks (bind to 0, any outgoing
    connection) never land, and from a slice of that range owned by this pytest-xdist worker alone,
    walked upward so that no port is handed out twice in a session. A port checked free is not
    yet bound: a server takes seconds to start before it binds. Two failures taught this: a run
    picked in the ephemeral range lost master_port + 1 to another socket between check and bind,
    and random picks shared by both workers once gave a port to two servers starting at the same
    time (`address already in use`)."""
    import socket

    global _next_port
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = (min(low, 32768) - 20000) // workers
    first, last = 20000 + worker * span, 20000 + (worker + 1) * span
    if _next_port is None or not first <= _next_port < last:
        # A random start inside the slice: a second test session on the same machine (a developer
        # running one file beside `make test`) most likely walks other ports.
        _next_port = random.Random().randrange(first, last - n)
    for _ in range(span):
        base = _next_port
        if base + n > last:
            base = first
        _next_port = base + n
        sockets = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(sockets):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {first}-{last}")



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


def greedy(n: int, **kw):
    """Greedy sampling of exactly n tokens (no EOS): the parity tests' parameters."""
    from shared.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def hf_greedy_tokens(path, prompts, n: int, attn_implementation: str | None = None) -> list[list[int]]:
    """HF transformers' fp32 greedy continuation of each prompt (n tokens, no EOS) from the
    checkpoint at `path`, on the CPU: the oracle for a tiny checkpoint a test saved."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ref[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="session")
def fp32_oracle(prompt_token_ids, hf_greedy, hf_model):
    """Per prompt: HF's fp32 greedy continuation (NEW_TOKENS), and HF's fp32 logits at each of its
    positions (row k: the logits that chose continuation[k]), both on the CPU. What an engine in bf16
    is held to (assert_bf16_teacher_forced, assert_bf16_greedy_tracks)."""
    out = []
    with torch.no_grad():
        for ids in prompt_token_ids:
            cont = hf_greedy(ids, NEW_TOKENS)
            logits = hf_model(torch.tensor([ids + cont])).logits[0, len(ids) - 1:len(ids) - 1 + NEW_TOKENS]
            out.append((cont, logits.float()))
    return out


def assert_bf16_teacher_forced(llm, prompt_token_ids, oracle) -> None:
    """An engine in bf16 against the fp32 oracle, with bf16 tolerances. Teacher forcing: each prefix
    prompt + oracle[:k] is its own 1-token request, so one early near-tie cannot derail the rest; at
    least 90% of positions must pick the oracle's token, and where they do not, the oracle itself
    must be near a tie there (its two tokens within 1 logit) and the engine must rank the oracle's
    token in its top 5."""
    new = NEW_TOKENS
    prefixes = [ids + cont[:k] for ids, (cont, _) in zip(prompt_token_ids, oracle) for k in range(new)]
    outs = llm.generate(prefixes, greedy(1, logprobs=5))
    agree, misses = 0, []
    for i, (cont, logits) in enumerate(oracle):
        for k in range(new):
            c = outs[i * new + k].outputs[0]
            ours, want = c.token_ids[0], cont[k]
            if ours == want:
                agree += 1
                continue
            margin = (logits[k].max() - logits[k, ours]).item()  # how far the oracle is from our pick
            misses.append((i, k, margin, want in c.logprobs[0]))
    total = len(prompt_token_ids) * new
    assert agree >= 0.9 * total, (agree, total, misses)
    for i, k, margin, in_top5 in misses:  # only near-ties may flip, and only to a close second
        assert margin < 1.0 and in_top5, (i, k, margin, in_top5)


def assert_bf16_greedy_tracks(llm, prompt_token_ids, oracle) -> None:
    """Free-running greedy decode in bf16 against the fp32 oracle, over the first 8 tokens of each
    prompt: at least half the prompts agree on all 8, and a prompt that leaves the oracle leaves it
    only where the oracle itself is near a tie (the token we picked within 1 logit of its best).
    After the first flip the two runs continue different texts, so nothing later is compared; a
    count of agreeing prompts alone would be a coin toss on where bf16's rounding lands a tie."""
    outs = llm.generate(prompt_token_ids, greedy(NEW_TOKENS))
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    first8 = [o.outputs[0].token_ids[:8] == cont[:8] for o, (cont, _) in zip(outs, oracle)]
    assert sum(first8) >= len(first8) // 2, first8
    for o, (cont, logits) in zip(outs, oracle):
        ours = o.outputs[0].token_ids
        k = next((j for j in range(8) if ours[j] != cont[j]), None)
        if k is not None:
            margin = (logits[k].max() - logits[k, ours[k]]).item()
            assert margin < 1.0, (k, margin)


def num_kv_blocks(engine) -> int:
    """The engine's pool size: its runner's, or (part 09 on) its executor's, which may be processes."""
    return engine.runner.num_blocks if hasattr(engine, "runner") else engine.executor.num_blocks


def pool_is_full(llm) -> bool:
    """Every usable KV block is back in the pool and no request holds any: nothing leaked."""
    kv = llm.engine.kv_cache_manager
    return kv.num_free_blocks == num_kv_blocks(llm.engine) - 1 and not kv.req_to_blocks



def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit of observed counts against probabilities; the chi-square
    survival function is the regularised upper incomplete gamma function Q(df / 2, x / 2)."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2).item()


def save_tiny(path, config, seed: int = 0, scale: float = 0.1, **save_kwargs):
    """save_pretrained of a tiny randomly initialised HF model. Every parameter is random (HF
    initialises biases to zero and norms to one, which would hide one we fail to load): weights
    with std `scale` (0.1 keeps logits O(1); larger makes next-token distributions peakier),
    norms 1 +- 0.2."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * (scale if "norm" not in name else 0.2)
            p.copy_(noise + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path, **save_kwargs)
    return path


def run_interpreted_script(script: str, tmp, timeout: int = 900, **env) -> dict:
    """Run a test file as a script in a child process under TRITON_INTERPRET=1 (which must be set
    before triton is imported) with `env` added, and return the one JSON line it prints last."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    # The caller's import path first: `shared.course grade` puts the reader's copy of a part there.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(repo), str(repo / "tests")]
    env = dict(os.environ, TRITON_INTERPRET="1", **env, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, script, str(tmp)], env=env, cwd=repo, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
