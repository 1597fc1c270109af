"""Part 09: tensor parallelism, as real process groups (gloo on the CPU).

- The layers: on every rank of TP=2 and TP=4 (the latter with more ranks than KV heads, and with a
  tied, padded vocabulary), each sharded weight is 1/N of the dense one (or one KV head when they
  are replicated), the ranks' slices put together are the checkpoint's tensor, and the logits
  equal the dense model's.
- The engine: TP=2 and TP=4 greedy, seeded-sampling and speculative output identical (tokens)
  to TP=1; TP=3 on the embedded model identical to HF's greedy on the prompt set; two "nodes" on
  loopback (a --headless process holding rank 1).
- Lifecycle: shutdown ends every worker; a killed worker makes the engine fail with WorkerDied
  naming it, and the server answer 503 while it keeps running; no process outlives its test.
- The server at TP=2 through the openai client."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port, free_port_run, greedy, pool_is_full, running_server, save_tiny
from shared.sampling_params import SamplingParams

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=127, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 60)), [1, 7, 7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    from shared.tokenizer import TOKENIZER_FILES
    from shared.weights import embedded_model_path

    root = tmp_path_factory.mktemp("tp")
    paths = {"untied": save_tiny(root / "untied", LlamaConfig(**TINY), seed=0, scale=0.3),
             # 130 does not divide by 4: the last rank's vocabulary range is padded
             "tied_odd": save_tiny(root / "tied", LlamaConfig(**{**TINY, "vocab_size": 130, "eos_token_id": 129,
                                                                 "tie_word_embeddings": True}), seed=1, scale=0.3)}
    # A tiny model with the embedded tokenizer, for the server (text prompts, chat template).
    served = save_tiny(root / "served", LlamaConfig(**{**TINY, "vocab_size": 49152, "eos_token_id": 2}), seed=2)
    for name in os.listdir(embedded_model_path()):
        if name in TOKENIZER_FILES or name.startswith(("special_tokens", "chat_template")):
            shutil.copy(embedded_model_path() / name, served / name)
    paths["served"] = served
    return paths


def tp_llm(path, tp: int, **kw):
    from part09_tp import LLM

    return LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4, tensor_parallel_size=tp, **kw)


def all_gone(procs) -> bool:
    deadline = time.monotonic() + 15
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in procs)


# ---- the layers, on real process groups ---------------------------------------------------

def _rank_report(rank: int, size: int, path: str, port: int, out: str, fmt: str) -> None:
    import torch.distributed as dist

    from layer_fakes import TransposedConfig

    from part09_tp.parallel_layers import TensorParallelLayers
    from shared.attention import NoCacheAttention
    from shared.forward_context import set_forward_context
    from shared.weights import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        from pathlib import Path

        # float64: a sum split over ranks rounds differently from the dense one; in float64 that
        # difference is ~1e-15, so a tight bound cannot fail by luck.
        config = TransposedConfig() if fmt == "transposed" else None
        model = load_model(Path(path), torch.device("cpu"), torch.float64,
                           layers=TensorParallelLayers(rank, size, config))
        ids = torch.tensor(PROMPTS[2])
        with torch.no_grad(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
            logits = model.compute_logits(model(ids, torch.arange(len(ids))))
        torch.save({"logits": logits, "state": {k: v.clone() for k, v in model.state_dict().items()}},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,size,fmt", [("untied", 2, "dense"), ("untied", 4, "dense"), ("tied_odd", 4, "dense"),
                                           ("untied", 2, "transposed")])
def test_each_rank_holds_its_slices_and_logits_match(tiny, tmp_path, name, size, fmt):
    """"transposed": every linear weight in a layout of the tests' own (layer_fakes.py); the
    tensor-parallel loaders shard it by its declared dims, and the logits are the dense model's."""
    from shared.attention import NoCacheAttention
    from shared.forward_context import set_forward_context
    from shared.weights import load_model

    mp.spawn(_rank_report, args=(size, str(tiny[name]), free_port(), str(tmp_path), fmt), nprocs=size, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    dense = load_model(tiny[name], torch.device("cpu"), torch.float64)
    ids = torch.tensor(PROMPTS[2])
    with torch.no_grad(), set_forward_context(NoCacheAttention(dense.config.head_dim ** -0.5)):
        want = dense.compute_logits(dense(ids, torch.arange(len(ids))))
    for r in ranks:  # every rank ends with the whole row of logits
        torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-10)
    if fmt == "transposed":
        return  # the slice checks below read the dense layout

    cfg, full = dense.config, dense.state_dict()
    hd, kv = cfg.head_dim, cfg.num_key_value_heads
    q_rows, kv_rows = cfg.num_attention_heads * hd, kv * hd
    for key, w in full.items():
        parts = [r["state"][key] for r in ranks]
        if "norm" in key:  # replicated
            assert all(torch.equal(p, w) for p in parts)
        elif "qkv_proj" in key:  # [q | k | v] per rank: q split; k, v split or one replicated head
            kv_local = max(kv // size, 1)
            assert all(p.shape[0] == q_rows // size + 2 * kv_local * hd for p in parts)
            q = torch.cat([p[:q_rows // size] for p in parts])
            torch.testing.assert_close(q, w[:q_rows], rtol=0, atol=0)
            for r, p in enumerate(parts):
                head = r * kv // size if size > kv else r
                k_want = w[q_rows:q_rows + kv_rows].view(kv, hd, -1)[head * kv_local:(head + 1) * kv_local]
                assert torch.equal(p[q_rows // size:q_rows // size + kv_local * hd], k_want.reshape(kv_local * hd, -1))
        elif "o_proj" in key or "down_proj" in key:  # row-parallel: input features split
            assert all(p.shape[1] * size == w.shape[1] for p in parts)
            assert torch.equal(torch.cat(parts, dim=1), w)
        elif "gate_up" in key:  # [gate slice; up slice] per rank
            half = w.shape[0] // 2
            assert all(p.numel() * size == w.numel() for p in parts)
            gate = torch.cat([p[:half // size] for p in parts])
            up = torch.cat([p[half // size:] for p in parts])
            assert torch.equal(torch.cat([gate, up]), w)
        else:  # embedding, head: vocabulary ranges, the last one padded with zero rows
            assert all(p.shape[0] == -(-w.shape[0] // size) for p in parts), key
            joined = torch.cat(parts)
            assert torch.equal(joined[:w.shape[0]], w) and not joined[w.shape[0]:].any()


def test_shapes_that_do_not_split_are_refused_before_any_process_starts(tiny):
    with pytest.raises(ValueError, match=r"query heads \(4\) must divide by the tensor-parallel size \(3\)"):
        tp_llm(tiny["untied"], 3)


def test_parallel_config_comes_from_flags_or_the_launchers_environment(monkeypatch):
    from part09_tp.parallel_state import ParallelConfig

    for var in ("NNODES", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    one = ParallelConfig.resolve(2)
    assert (one.nnodes, one.node_rank, one.master_addr, list(one.local_ranks)) == (1, 0, "127.0.0.1", [0, 1])
    assert one.master_port > 0
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's name for the node rank
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    env = ParallelConfig.resolve(4)
    assert (env.nnodes, env.node_rank, env.init_method, list(env.local_ranks)) == (2, 1, "tcp://10.0.0.1:29555", [2, 3])
    flags = ParallelConfig.resolve(4, nnodes=2, node_rank=0, master_addr="h", master_port=1234)
    assert (flags.node_rank, flags.init_method, list(flags.local_ranks)) == (0, "tcp://h:1234", [0, 1])
    with pytest.raises(ValueError, match="divide evenly"):
        ParallelConfig.resolve(3, nnodes=2, master_port=1)
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig.resolve(4, nnodes=2, node_rank=2, master_port=1)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="master-port"):
        ParallelConfig.resolve(4)


# ---- the engine ---------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, n=2, max_tokens=12, presence_penalty=0.5)


def run_all(llm) -> list:
    greedy_out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(16))]
    seeded_out = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, SEEDED)]
    return [greedy_out, seeded_out]


@pytest.fixture(scope="module")
def tp1_outputs(tiny):
    llm = tp_llm(tiny["untied"], 1, max_num_batched_tokens=64)
    return run_all(llm)


@pytest.mark.parametrize("size", [2, 4])
def test_tp_output_identical_to_tp1(tiny, tp1_outputs, size):
    """Greedy and seeded sampling (n=2, top-p, a penalty) in chunks of 64 tokens with async
    scheduling: the same tokens at TP=N as at TP=1, and no block leaked."""
    llm = tp_llm(tiny["untied"], size, max_num_batched_tokens=64)
    procs = list(llm.engine.executor.procs.values())
    try:
        assert len(procs) == size and llm.engine.max_steps_in_flight == 2
        assert run_all(llm) == tp1_outputs
        assert pool_is_full(llm)
    finally:
        llm.shutdown()
    assert all_gone(procs) and all(p.exitcode == 0 for p in procs)  # a clean exit, not a kill


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_at_tp2_identical_to_tp1(tiny, method):
    kw = dict(speculative_method=method, num_speculative_tokens=3, prompt_lookup_min=2, speculative_draft_layers=1)
    want = [o.outputs[0].token_ids for o in tp_llm(tiny["untied"], 1, **kw).generate(PROMPTS, greedy(20))]
    with tp_llm(tiny["untied"], 2, **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(20))]
        assert llm.engine.spec_decoding_stats.num_draft_tokens > 0
    assert got == want


def test_tp3_on_the_embedded_model_matches_hf(prompt_token_ids, hf_greedy):
    """The oracle: 9 query heads and 3 KV heads over 3 ranks, greedy equal to HF on the prompt set."""
    from part09_tp import LLM

    with LLM(device="cpu", dtype="float32", tensor_parallel_size=3, kv_cache_memory_mb=64) as llm:
        outs = llm.generate([list(p) for p in prompt_token_ids], greedy(16))
        for o, ids in zip(outs, prompt_token_ids):
            assert o.outputs[0].token_ids == hf_greedy(ids, 16)


def test_two_nodes_on_loopback(tiny, tp1_outputs):
    """Node 1 is a --headless server process holding rank 1; node 0 runs the engine and rank 0."""
    port = free_port_run(3)  # the driver binds port + 1 and port + 2 too
    common = ["--model", str(tiny["untied"]), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "4",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "part09_tp.server", *common, "--node-rank", "1", "--headless"])
    try:
        llm = tp_llm(tiny["untied"], 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                     max_num_batched_tokens=64)
        try:
            assert list(llm.engine.executor.procs) == [0]  # this node holds rank 0 only
            assert run_all(llm) == tp1_outputs
        finally:
            llm.shutdown()
        assert node1.wait(timeout=30) == 0  # rank 0's shutdown reached the other node
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_killed_worker_fails_the_engine_clearly(tiny):
    from part09_tp.multiproc_executor import WorkerDied

    llm = tp_llm(tiny["untied"], 2)
    procs = list(llm.engine.executor.procs.values())
    try:
        llm.generate(PROMPTS[:1], greedy(4))
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"worker died during step: .*rank 1 \(exit code -9\)"):
            llm.generate(PROMPTS, greedy(8))
        assert all_gone(procs)  # rank 0 was killed too, not left waiting on rank 1
        with pytest.raises(WorkerDied):  # and the engine stays failed, at once
            llm.generate(PROMPTS[:1], greedy(2))
    finally:
        llm.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()


def test_a_hung_rank_fails_the_engine_within_the_step_timeout(tiny):
    """A rank that stops answering (SIGSTOP: alive, silent) is an error after execute_model_timeout_s,
    not a hang; a caller's shorter wait on a step only times out that wait."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from part09_tp.multiproc_executor import WorkerDied

    llm = tp_llm(tiny["untied"], 2, execute_model_timeout_s=4)
    engine, procs = llm.engine, list(llm.engine.executor.procs.values())
    try:
        llm.generate(PROMPTS[:1], greedy(4))
        os.kill(procs[0].pid, signal.SIGSTOP)
        engine.add_request(engine.make_request(PROMPTS[0], greedy(2)))
        out = engine.scheduler.schedule()
        future = engine.executor.execute_batch(engine._batch_entries(out), [])
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.5)
        assert engine.executor.error is None  # the caller's wait ended, the executor did not
        start = time.monotonic()
        # Rank 1's all-reduce times out too: whichever is first, rank 1's error or the driver's own
        # limit, the engine fails with the step timeout, and no later than a bounded time after it.
        with pytest.raises(WorkerDied):
            future.result()
        assert time.monotonic() - start < 30
        assert all_gone(procs)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        llm.shutdown()


def test_a_headless_node_exits_when_node_0_is_gone(tiny):
    """kill -9 of node 0's server: node 1 (and its rank) notice the driver is gone and exit."""
    port, http = free_port_run(3), free_port()
    common = ["--model", str(tiny["untied"]), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "4",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "part09_tp.server", *common, "--node-rank", "1", "--headless"])
    node0 = subprocess.Popen([sys.executable, "-m", "part09_tp.server", *common, "--node-rank", "0",
                              "--port", str(http)])
    try:
        deadline = time.monotonic() + 120
        while not _healthy(f"http://127.0.0.1:{http}"):
            assert time.monotonic() < deadline and node0.poll() is None and node1.poll() is None
            time.sleep(0.2)
        node0.kill()
        node0.wait()
        assert node1.wait(timeout=30) is not None  # exited on its own
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---- the server -----------------------------------------------------------------------------

def test_server_at_tp2_through_the_openai_client(tiny):
    from part09_tp.server import build_app

    llm = tp_llm(tiny["served"], 2)
    procs = list(llm.engine.executor.procs.values())
    ref = tp_llm(tiny["served"], 1)
    want = ref.generate("The capital of France is", greedy(8))[0].outputs[0].text
    try:
        app = build_app(llm, "tiny")
        with running_server(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                          temperature=0)
            assert r.choices[0].text == want
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=6, temperature=0, stream=True)
            assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1

            os.kill(procs[1].pid, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
            assert err.value.status_code == 503 and "rank 1 (exit code -9)" in str(err.value)
            with pytest.raises(openai.APIError, match="rank 1 \\(exit code -9\\)"):  # a stream: its last event
                for _ in client.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=True):
                    pass
            import httpx

            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
    finally:
        llm.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()
    assert all_gone(procs)


def test_all_reduce_timer_measures_real_collectives():
    """Notebook 09's communication figures come from shared.bench.collectives: positive times,
    one per size asked for, from a real 2-process gloo group."""
    from shared.bench.collectives import time_all_reduce

    lat = time_all_reduce([16, 4096], world_size=2)
    assert sorted(lat) == [16, 4096] and all(0 < t < 1 for t in lat.values())
