"""Part 03: the paged engine gives HF's greedy tokens, in static batches of any size, and the
block pool is whole again after every run. (The prompt set as one static batch of 8 is in
test_parity.py, for every part.)"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import NEW_TOKENS, build_llm, pool_is_full
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("length", [15, 16, 17, 32])
def test_prompt_lengths_around_block_boundaries(llm03, hf_greedy, length):
    ids = [(7 * i + 11) % 5000 + 100 for i in range(length)]  # a deterministic pseudo-text
    out = llm03.generate([ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(ids, 20)
    assert pool_is_full(llm03)


def test_tiny_pool_splits_into_several_static_batches(prompt_token_ids, hf_greedy):
    from part03_paged_attention.kv_cache_manager import num_blocks_for_budget

    # A block of SmolLM2 holds 16 tokens x 30 layers x K,V x 3 heads x 64 dims x 4 bytes = 720 KiB,
    # so 12 MiB is 17 blocks; each request's worst case (up to ~72 tokens) takes up to 5.
    small = build_llm("part03_paged_attention", kv_cache_memory_mb=12)
    blocks = small.engine.runner.num_blocks
    assert blocks == 17
    batches = []
    engine = small.engine
    reqs = [engine.make_request(ids, GREEDY) for ids in prompt_token_ids]
    waiting = list(reqs)
    while waiting:
        batch = engine.take_batch(waiting)
        batches.append(len(batch))
        for _ in engine.run_batch(batch):
            assert small.engine.kv_cache_manager.num_free_blocks >= 0
    assert len(batches) > 1 and sum(batches) == len(reqs)
    for r, ids in zip(reqs, prompt_token_ids):
        assert r.output().outputs[0].token_ids == hf_greedy(ids)
    assert pool_is_full(small)
    assert num_blocks_for_budget(12 * 2**20, 30, 3, 64, 16, engine.runner.dtype) == blocks


def test_blocks_grow_one_at_a_time(llm03):
    engine = llm03.engine
    kv = engine.kv_cache_manager
    req = engine.make_request(list(range(100, 116)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen = []
    for _ in engine.run_batch([req]):
        seq = req.sequences[0]
        seen.append((seq.num_computed_tokens, len(kv.get_block_ids(seq.seq_id))))
    # 16 prompt tokens fill exactly one block; the 17th token (first decode input) needs a second.
    assert seen[0] == (16, 1)
    assert seen[1] == (17, 2)
    assert all(blocks == -(-computed // 16) for computed, blocks in seen[:-1])
    assert pool_is_full(llm03)


def test_n_samples_and_abort_free_blocks(llm03):
    engine = llm03.engine
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=40, ignore_eos=True)
    first = llm03.generate(["Tell me a joke."], params)[0]
    second = llm03.generate(["Tell me a joke."], params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    req = engine.make_request("Tell me a joke.", params)
    for step, _ in enumerate(engine.run_batch([req])):
        if step == 3:
            req.aborted = True
    assert all(c.finish_reason == "abort" for c in req.output().outputs)
    assert pool_is_full(llm03)


def test_request_larger_than_pool_is_refused():
    small = build_llm("part03_paged_attention", kv_cache_memory_mb=12)  # 17 blocks: 16 usable
    with pytest.raises(InvalidRequestError) as e:
        small.engine.make_request("hi", SamplingParams(max_tokens=4000))
    assert e.value.param == "max_tokens"
    small.engine.make_request("hi", SamplingParams(max_tokens=200))  # fits: accepted
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        build_llm("part03_paged_attention", kv_cache_memory_mb=1)  # below two blocks: refused at start-up


@pytest.mark.parametrize("part", ["part03_paged_attention", "part15_full"])
def test_kv_pool_is_zeros_and_takes_ram_only_once_written(part):
    """On the CPU the pool is the OS's untouched zero pages (shared.device.kv_cache_zeros): a 512 MiB
    pool adds next to nothing to resident memory until blocks are written, reads as zeros, and is
    written in place. (torch.zeros would write every page up front: +512 MiB.)"""
    import importlib

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    paged_attention = importlib.import_module(f"{part}.paged_attention")
    before = rss_mib()
    pool = paged_attention.PagedAttention(num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=4,
                                          head_dim=256, dtype=torch.float32, device="cpu")
    assert pool.nbytes == 2 * 4 * 1024 * 16 * 4 * 256 * 4  # 512 MiB reserved
    assert rss_mib() - before < 64
    pool.k_cache[:, 7] = 1.0  # one block in every layer: 256 KiB
    assert rss_mib() - before < 64
    assert pool.k_cache.sum().item() == 4 * 16 * 4 * 256 and pool.v_cache.abs().sum().item() == 0
