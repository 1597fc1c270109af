"""Part 15's pipeline parallelism on real processes (gloo on the CPU), every process ended by its test.

- The split: vLLM's get_pp_indices table (the remainder to the stages before the last) and
  VLLM_PP_LAYER_PARTITION; a stage builds, loads and caches its own layers only.
- The scheduler: with PP stages, up to PP steps in flight, each with sequences the others do not
  hold and at most max_num_seqs / PP of them.
- The engine: a 5-layer Llama at PP 2 and TP 2 x PP 2 and a 5-layer Qwen2-MoE at PP 3 (uneven) give
  PP 1's tokens, greedy and seeded, and HF's greedy ones, with chunked prefill, a prefix hit and a
  preemption; PP 2's steps are in flight together; int8 weights and expert parallelism inside a
  stage give one stage's tokens; a killed stage fails the engine with WorkerDied, ends the other
  stage, and the server answers 503; a --headless second "node" on loopback holds stage 1."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from conftest import free_port_run, greedy, hf_greedy_tokens, pool_is_full, running_server, save_tiny
from part15_full.pipeline import get_pp_indices
from part15_full.sampling_params import SamplingParams
from part15_full.scheduler import Scheduler, SchedulerConfig

PROMPTS = [list(range(3, 40)), [5, 9, 11], [7] * 20, [100, 3, 4], list(range(50, 75))]
SEEDED = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=8)


# ---- the split ----------------------------------------------------------------------------

@pytest.mark.parametrize("layers,size,expected", [
    (2, 2, [(0, 1), (1, 2)]), (3, 2, [(0, 2), (2, 3)]), (4, 3, [(0, 1), (1, 3), (3, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]), (20, 4, [(0, 5), (5, 10), (10, 15), (15, 20)])])
def test_layers_split_as_vllm_splits_them(layers, size, expected):
    assert [get_pp_indices(layers, r, size) for r in range(size)] == expected


def test_the_partition_variable_overrides_the_split(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,6,6,4")
    assert [get_pp_indices(20, r, 4) for r in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    for bad in ("5,5,5", "5,5,5,a", "5,5,5,6", "0,10,5,5"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
            get_pp_indices(20, 0, 4)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 pipeline stages"):
        get_pp_indices(3, 0, 4)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("pp")
    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, num_hidden_layers=5, bos_token_id=1, eos_token_id=127)
    return {
        "llama": save_tiny(root / "llama", transformers.LlamaConfig(**common, intermediate_size=96,
                                                                    tie_word_embeddings=True), seed=5, scale=0.3),
        # Wide KV heads: 1 MiB holds 7 blocks on the 3-layer stage of PP 2, too few for 4 sequences.
        "big_kv": save_tiny(root / "big_kv", transformers.LlamaConfig(**{**common, "num_key_value_heads": 4},
                                                                      head_dim=96, intermediate_size=96), seed=6),
        "moe": save_tiny(root / "moe", transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2], tie_word_embeddings=False), seed=3, scale=0.3),
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_holds_its_layers_and_their_kv_only(models, stage):
    """Built in this process (construction needs no group): stage 1 of 3 holds layers 2-3 and no
    embedding or head; the last stage of a tied model holds the embedding as its head."""
    from part15_full.config import EngineConfig
    from part15_full.model_runner import ModelRunner
    from part15_full.pipeline import PipelineStage

    config = EngineConfig(model=str(models["llama"]), device="cpu", dtype="float32", kv_cache_memory_mb=4)
    runner = ModelRunner(config, None, "cpu", PipelineStage(stage, 3, 1, stage))
    start, end = get_pp_indices(5, stage, 3)
    names = {n for n, _ in runner.model.named_parameters()}
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    assert layers == set(range(start, end))
    assert ("embed_tokens.weight" in names) == (stage in (0, 2))  # the last: the tied head's weight
    assert ("norm.weight" in names) == (stage == 2)
    assert runner.attn.k_cache.shape[0] == end - start
    full = ModelRunner(dataclass_replace(config), None, "cpu")
    assert runner.num_blocks > full.num_blocks  # the same budget over fewer layers


def dataclass_replace(config):
    import dataclasses

    return dataclasses.replace(config)


# ---- the scheduler ------------------------------------------------------------------------

def test_the_scheduler_keeps_sequences_in_flight_out_of_the_next_step():
    from part15_full.kv_cache_manager import KVCacheManager
    from part15_full.request import Sequence
    from sched_fakes import arrive, make_seq, names

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, pipeline_parallel_size=2),
                      KVCacheManager(64, 4, enable_caching=False))
    seqs = [make_seq(Sequence, f"s{i}", 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    first, second, third = sched.schedule(), sched.schedule(), sched.schedule()
    assert names(first) == [("s0", 5), ("s1", 5)] and names(second) == [("s2", 5), ("s3", 5)]  # 4 / 2 a step
    assert names(third) == []  # all four in flight: nothing to run until a step returns
    for s in seqs[:2]:  # the first step's tokens arrive: its sequences decode in the next step
        arrive(s)
    assert names(sched.schedule()) == [("s0", 1), ("s1", 1)]
    # One stage: the same scheduler runs every sequence in each step, a token in flight as a placeholder.
    one = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), KVCacheManager(64, 4, enable_caching=False))
    for i in range(4):
        one.add(make_seq(Sequence, f"t{i}", 5))
    assert len(one.schedule().scheduled) == 4 and len(one.schedule().scheduled) == 4


# ---- the engine ---------------------------------------------------------------------------

def llm(path: Path, **kw):
    from part15_full import LLM

    kw = {"kv_cache_memory_mb": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4, **kw}
    return LLM(model=str(path), device="cpu", dtype="float32", **kw)


def run(m) -> tuple[list, list]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return ([o.outputs[0].token_ids for o in m.generate(prompts, greedy(8))],
            [[c.token_ids for c in o.outputs] for o in m.generate(prompts[:2], SEEDED)])


@pytest.fixture(scope="module")
def single(models):
    out = {}
    for name, path in models.items():
        m = llm(path)
        out[name] = run(m)
        assert out[name][0] == hf_greedy_tokens(path, PROMPTS, 8)
    return out


@pytest.mark.parametrize("name,pp,tp", [("llama", 2, 1), ("llama", 2, 2), ("moe", 3, 1)])
def test_stages_give_one_stages_tokens(models, single, name, pp, tp):
    with llm(models[name], pipeline_parallel_size=pp, tensor_parallel_size=tp) as m:
        procs = list(m.engine.executor.procs.values())
        assert len(procs) == pp * tp
        ex, most = m.engine.executor, []  # how many steps are unanswered as each one launches
        launch = ex.execute_batch

        def counting(*args, **kwargs):
            future = launch(*args, **kwargs)
            most.append(sum(not f.done() for f in ex.pending))
            return future
        ex.execute_batch = counting
        assert run(m) == single[name]
        assert m.engine.max_steps_in_flight == pp and max(most) == pp, most  # PP steps overlap
        # A prefix hit: two blocks of the first prompt again.
        stats = m.engine.kv_cache_manager.prefix_cache_stats
        hits = stats.hits
        again = [PROMPTS[0][:32] + [9, 9, 9]]
        out = m.generate([{"prompt_token_ids": again[0]}], greedy(6))[0].outputs[0].token_ids
        assert out == hf_greedy_tokens(models[name], again, 6)[0] and stats.hits - hits == 32
        assert pool_is_full(m)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("setup", ["int8", "ep"])
def test_quantized_weights_and_experts_inside_a_stage(models, setup):
    """int8 weights at PP 2 give int8's tokens at PP 1; expert parallelism inside each of 2 stages of
    TP 2 gives the single process's tokens."""
    name, kw = ("llama", dict(quantization="int8")) if setup == "int8" else \
        ("moe", dict(tensor_parallel_size=2, enable_expert_parallel=True))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    one = llm(models[name], **(kw if setup == "int8" else {}))
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(6))]
    with llm(models[name], pipeline_parallel_size=2, **kw) as m:
        assert len(m.engine.executor.procs) == 2 * kw.get("tensor_parallel_size", 1)
        assert [o.outputs[0].token_ids for o in m.generate(prompts, greedy(6))] == want


def test_a_preemption_recomputes_across_the_stages(models):
    """7 blocks of 16 tokens (the smaller stage's pool) for 4 sequences growing to 54 tokens: some are
    preempted and recomputed, and every one still gets HF's tokens."""
    path = models["big_kv"]
    prompts = [list(range(3 + i, 33 + i)) for i in range(4)]
    with llm(path, pipeline_parallel_size=2, kv_cache_memory_mb=1) as m:
        assert m.engine.executor.num_blocks == 7
        out = [o.outputs[0].token_ids for o in m.generate([{"prompt_token_ids": p} for p in prompts], greedy(24))]
        assert m.engine.scheduler.num_preemptions > 0
        assert out == hf_greedy_tokens(path, prompts, 24)
        assert pool_is_full(m)


def test_a_killed_stage_fails_the_engine_and_the_server_answers_503(models):
    from part15_full.async_llm import AsyncLLM
    from part15_full.process_utils import WorkerDied
    from part15_full.server import build_app

    # Stage 1 dies under a running server, which then answers 503 and keeps running; the engine has
    # failed with WorkerDied and ended stage 0 too, not left it waiting.
    m = llm(models["llama"], pipeline_parallel_size=2)
    procs = list(m.engine.executor.procs.values())
    try:
        with running_server(build_app(AsyncLLM(m.engine), "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert client.completions.create(model="tiny", prompt=[5, 9, 11], max_tokens=2).choices[0].text is not None
            os.kill(procs[1].pid, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt=[5, 9, 11], max_tokens=2)
            assert err.value.status_code == 503 and "rank 1 (exit code -9)" in str(err.value)
            assert client.models.list().data[0].id == "tiny"  # still serving
        with pytest.raises(WorkerDied, match=r"worker died during step: .*rank 1 \(exit code -9\)"):
            m.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(2))
        deadline = time.monotonic() + 15
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.is_alive() for p in procs)
    finally:
        m.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()


def test_a_headless_node_holds_the_second_stage(models, single):
    port = free_port_run(3)
    common = ["--model", str(models["llama"]), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-mb", "4",
              "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--max-num-batched-tokens", "16", "--max-num-seqs", "4"]
    node1 = subprocess.Popen([sys.executable, "-m", "part15_full.server", *common, "--node-rank", "1", "--headless"])
    try:
        m = llm(models["llama"], pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                master_port=port)
        try:
            assert list(m.engine.executor.procs) == [0]  # this node holds stage 0 only
            assert run(m) == single["llama"]
        finally:
            m.shutdown()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_what_pipeline_parallelism_refuses(models):
    from part15_full.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(device="cpu", pipeline_parallel_size=2, speculative_method="draft_model",
                     num_speculative_tokens=2).validate()
    with pytest.raises(ValueError, match="KV connector"):
        EngineConfig(device="cpu", pipeline_parallel_size=2, kv_offloading_size=1.0).validate()
    with pytest.raises(ValueError, match="needs --distributed-executor-backend mp"):
        EngineConfig(device="cpu", pipeline_parallel_size=2, distributed_executor_backend="uni").validate()
    with pytest.raises(ValueError, match="5 layers cannot be split over 6 pipeline stages"):
        llm(models["llama"], pipeline_parallel_size=6)
