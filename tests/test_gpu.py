"""The GPU tier: what only a CUDA machine can check (skipped without one).

(a) bf16: every part, in bf16 on CUDA, against the fp32 CPU oracle (HF's greedy continuation of
    the prompt set), with bf16 tolerances: conftest.assert_bf16_teacher_forced (each position
    forced to the oracle's prefix) and assert_bf16_greedy_tracks (free-running decode).
    (Calibration: the same checks in bf16 on CPU give 250/256 positions, mismatches all within
    0.16 logits, and 8/8 prompts equal for at least 16 tokens; test_part15_cpu_ops.py runs them
    for part 15 on the CPU.)
(b) The Triton kernels, compiled, in bf16 against the torch reference and dense attention:
    decode, prefill, prefill on cached context, mixed; MHA, GQA and MQA; head dims 64, 80, 128;
    block sizes 16 and 32. Every distinct triton_kernels.py among the parts is tested.
(c) Continuous batching in fp32 on CUDA (TF32 off, so fp32 means fp32) for every part from 04
    on: 16 concurrent requests equal HF's greedy exactly, and every KV block is back afterwards.
(d) Speculative decoding (part 08 on) in fp32 on CUDA: n-gram and draft-model verification through
    the Triton kernels equals HF's greedy, with drafts accepted and no block leaked.
(e) The multiprocess executor (part 09 on) on CUDA: the model in a worker process (TP=1, NCCL,
    one GPU) equals HF's greedy in fp32, and shutdown leaves no worker behind.
(f) MoE (part 11 on) on CUDA: a tiny Mixtral through the Triton grouped GEMM equals HF's greedy in
    fp32, and the kernel in bf16 stays within bf16 tolerance of the fp32 reference.
(g) Async scheduling's overlap (part 05 on): a step's sampled tokens reach the host without
    waiting for the GPU work queued after them (the next step's kernels).
(h) Part 15's CUDA graphs: FULL_AND_PIECEWISE, PIECEWISE and FULL_DECODE_ONLY keep HF's greedy
    tokens in fp32 over every capture size, padded batches, mixed steps, prefix caching and async
    scheduling, with no capture after start-up; the KV cache sized from --gpu-memory-utilization.

Parts are discovered with shared.course.stages(), so a new part is in this tier at once."""
from __future__ import annotations

import gc
import hashlib
import importlib

import pytest
import torch

from shared.course import stages
from test_paged_kernels import Case, make_batch, max_err_vs_dense
from conftest import assert_bf16_greedy_tracks, assert_bf16_teacher_forced, greedy, num_kv_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STAGES = stages()
PARTS = [s.name for s in STAGES]
BATCHING_PARTS = [s.name for s in STAGES if s.number >= 4]


def build(part: str, dtype: str):
    return importlib.import_module(part).LLM(device="cuda", dtype=dtype)


def release(llm) -> None:
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()
    gc.collect()
    torch.cuda.empty_cache()


# ---- (a) bf16 against the fp32 CPU oracle ------------------------------------------------

@pytest.fixture(scope="module", params=PARTS)
def llm_bf16(request):
    llm = build(request.param, "bfloat16")
    yield llm
    release(llm)


def test_bf16_teacher_forced_matches_fp32_oracle(llm_bf16, prompt_token_ids, fp32_oracle):
    assert_bf16_teacher_forced(llm_bf16, prompt_token_ids, fp32_oracle)


def test_bf16_greedy_decode_tracks_fp32_oracle(llm_bf16, prompt_token_ids, fp32_oracle):
    assert_bf16_greedy_tracks(llm_bf16, prompt_token_ids, fp32_oracle)


# ---- (b) Triton kernels in bf16 ----------------------------------------------------------

def kernel_parts() -> list[str]:
    """The first part holding each distinct triton_kernels.py."""
    seen: dict[str, str] = {}
    for s in STAGES:
        f = s.path / "triton_kernels.py"
        if f.exists():
            seen.setdefault(hashlib.sha256(f.read_bytes()).hexdigest(), s.name)
    return list(seen.values())


AROUND = ((1, 1), (15, 1), (16, 1), (17, 1), (33, 1), (300, 1), (1000, 1))  # decode at block edges
BF16_CASES = {
    # Llama-3 8B / 1B shapes: 32 query heads over 8 KV heads, head_dim 128 / 64.
    "gqa32-8_d128_bs16_decode": Case(32, 8, 128, 16, AROUND, torch.bfloat16),
    "gqa32-8_d128_bs16_prefill": Case(32, 8, 128, 16, ((1, 1), (17, 17), (100, 100), (257, 257)), torch.bfloat16),
    "gqa32-8_d64_bs16_mixed": Case(32, 8, 64, 16, ((17, 1), (16, 16), (33, 2), (300, 44), (1, 1),
                                                   (64, 64), (129, 1)), torch.bfloat16),
    # SmolLM2's 9 over 3 (a group of 3: padded to 4 rows in the kernel).
    "gqa9-3_d64_bs16_mixed": Case(9, 3, 64, 16, ((15, 1), (16, 16), (1, 1), (17, 1), (33, 2),
                                                 (32, 15), (200, 200)), torch.bfloat16),
    "mha8-8_d64_bs32_mixed": Case(8, 8, 64, 32, ((31, 31), (32, 1), (65, 3), (96, 96), (400, 1)), torch.bfloat16),
    "mqa8-1_d80_bs16_mixed": Case(8, 1, 80, 16, ((8, 8), (9, 1), (170, 9), (48, 48)), torch.bfloat16),  # D not 2^n
    "gqa28-4_d128_bs32_prefix": Case(28, 4, 128, 32, ((64, 32), (100, 3), (513, 200)), torch.bfloat16),
}
BF16_ATOL = 3e-2  # max |err|: bf16 inputs, fp32 accumulation, bf16 probabilities and output
BF16_MEAN_ATOL = 3e-3  # mean |err|: catches a small systematic error the max would allow


@pytest.mark.parametrize("part", kernel_parts())
@pytest.mark.parametrize("name", BF16_CASES)
def test_triton_bf16_matches_reference(part, name):
    kernels = importlib.import_module(f"{part}.triton_kernels")
    ref_mod = importlib.import_module(f"{part}.paged_attention")
    case = BF16_CASES[name]
    batch = make_batch(case, seed=1, device="cuda")
    n, md = batch["num_tokens"], batch["metadata"]
    # The reference in fp32 on the very same (bf16-rounded) inputs: only the kernel's own error is left.
    ref_k, ref_v = batch["k_cache"].float(), batch["v_cache"].float()
    ref_mod.reshape_and_cache_ref(batch["k"].float(), batch["v"].float(), ref_k, ref_v, md.slot_mapping)
    ref = ref_mod.paged_attention_ref(batch["q"][:n].float(), ref_k, ref_v, md, batch["scale"])

    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    kernels.reshape_and_cache(batch["k"], batch["v"], k_cache, v_cache, md.slot_mapping)
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)  # a copy is exact
    out = kernels.paged_attention(batch["q"][:n], k_cache, v_cache, md, batch["scale"])
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.float() - ref).abs()
    assert err.max().item() < BF16_ATOL and err.mean().item() < BF16_MEAN_ATOL, (err.max().item(), err.mean().item())
    assert max_err_vs_dense(out, batch, case) < BF16_ATOL


# ---- (c) continuous batching in fp32 on CUDA --------------------------------------------

@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32: TF32 (Ampere+) would round inputs to 10 mantissa bits."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("part", BATCHING_PARTS)
def test_sixteen_concurrent_requests_fp32_cuda_match_hf(part, no_tf32, prompt_token_ids, hf_greedy):
    llm = build(part, "float32")
    try:
        engine = llm.engine
        runner = engine.runner if hasattr(engine, "runner") else engine.executor.runner
        assert runner.device.type == "cuda" and runner.dtype == torch.float32
        prompts = prompt_token_ids + [ids[: max(3, len(ids) // 2)] for ids in prompt_token_ids]
        lengths = [8 + (5 * i) % 25 for i in range(len(prompts))]
        running: list[int] = []
        schedule = engine.scheduler.schedule

        def observed_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            running.append(len(engine.scheduler.running))
            return out

        engine.scheduler.schedule = observed_schedule
        outs = llm.generate(prompts, [greedy(n) for n in lengths])
        torch.cuda.synchronize()
        assert max(running) == len(prompts)  # all 16 in one running batch
        for o, p, n in zip(outs, prompts, lengths):
            assert o.outputs[0].token_ids == hf_greedy(p, n)
        kv = engine.kv_cache_manager
        assert kv.num_free_blocks == num_kv_blocks(engine) - 1 and not kv.req_to_blocks
    finally:
        release(llm)


# ---- (d) speculative decoding on CUDA -----------------------------------------------------

SPEC_PARTS = [s.name for s in STAGES if s.number >= 8]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("part", SPEC_PARTS)
def test_speculation_on_cuda_fp32_matches_hf(part, method, no_tf32, prompt_token_ids, hf_greedy):
    """Verification through the Triton kernels (q_len = k + 1 per sequence) and, for the draft
    model, its own paged cache on the target's block tables: greedy output equals HF in fp32
    (TF32 off), drafts were accepted, and every KV block is back afterwards."""
    llm = importlib.import_module(part).LLM(device="cuda", dtype="float32", speculative_method=method,
                                            num_speculative_tokens=4, speculative_draft_layers=30)
    try:
        prompts = [(prompt_token_ids[0] + prompt_token_ids[1]) * 3, *prompt_token_ids]
        outs = llm.generate(prompts, greedy(24))
        torch.cuda.synchronize()
        for o, p in zip(outs, prompts):
            assert o.outputs[0].token_ids == hf_greedy(p, 24)
        assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == num_kv_blocks(llm.engine) - 1 and not kv.req_to_blocks
    finally:
        release(llm)


# ---- (e) the multiprocess executor on CUDA ------------------------------------------------

MP_PARTS = [s.name for s in STAGES if s.number >= 9]


@pytest.mark.parametrize("part", MP_PARTS)
def test_worker_process_on_cuda_fp32_matches_hf(part, no_tf32, prompt_token_ids, hf_greedy):
    """TP needs more than one GPU; on one, the model still runs in a worker process (NCCL group
    of one) driven by the engine's process: greedy output equals HF, no block leaked, and after
    shutdown the worker is gone."""
    llm = importlib.import_module(part).LLM(device="cuda", dtype="float32", distributed_executor_backend="mp")
    procs = list(llm.engine.executor.procs.values())
    try:
        outs = llm.generate([list(p) for p in prompt_token_ids], greedy(24))
        for o, p in zip(outs, prompt_token_ids):
            assert o.outputs[0].token_ids == hf_greedy(p, 24)
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == num_kv_blocks(llm.engine) - 1 and not kv.req_to_blocks
    finally:
        release(llm)
    assert not any(p.is_alive() for p in procs)


# ---- (f) MoE on CUDA ------------------------------------------------------------------------

MOE_PARTS = [s.name for s in STAGES if s.number >= 11]


@pytest.mark.parametrize("part", MOE_PARTS)
def test_moe_through_triton_on_cuda(part, no_tf32, tmp_path):
    import transformers

    from conftest import hf_greedy_tokens, save_tiny

    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=127)
    path = save_tiny(tmp_path / "mixtral", cfg, seed=3, scale=0.3)
    prompts = [[1, 5, 9, 33, 2, 77], list(range(1, 50))]
    expected = hf_greedy_tokens(path, prompts, 12)
    llm = importlib.import_module(part).LLM(model=str(path), device="cuda", dtype="float32", use_triton=True,
                                            kv_cache_memory_mb=64)
    try:
        outs = llm.generate(prompts, greedy(12))
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    finally:
        release(llm)
    fused = importlib.import_module(f"{part}.fused_moe")
    kernels = importlib.import_module(f"{part}.moe_kernels")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 256, device="cuda", generator=g)
    w13 = torch.randn(8, 2 * 512, 256, device="cuda", generator=g) * 0.05
    w2 = torch.randn(8, 256, 512, device="cuda", generator=g) * 0.05
    weights, ids = fused.select_experts(torch.randn(300, 8, device="cuda", generator=g), 2, True)
    want = fused.experts_reference(x, w13, w2, ids, weights)
    got = kernels.fused_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, weights).float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


# ---- (g) the sampler's results reach the host without waiting for later steps -------------

@pytest.mark.parametrize("logprobs", [None, 2])
def test_sampled_tokens_reach_the_host_while_later_work_runs(logprobs):
    """Part 05's engine launches step N+1 and only then reads step N's tokens. The read must wait
    for step N alone: here the "next step" is a second of GPU sleep queued after sampling, and
    reading the tokens must come back while it still runs (a .tolist() on the stream would wait
    for it: a wrong implementation fails this whatever the timing)."""
    from shared.sampler import Sampler, SamplingRow
    from shared.sampling_params import SamplingParams

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(6, 500, device="cuda", generator=g)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=logprobs)) for _ in range(6)]
    batch = Sampler().sample(logits, rows)
    torch.cuda._sleep(2_000_000_000)  # about a second at the H100's clock: the next step's kernels
    later = torch.cuda.Event()
    later.record()
    out = batch.to_output()
    still_running = not later.query()
    torch.cuda.synchronize()
    assert still_running
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    if logprobs is not None:
        want = logits.log_softmax(dim=-1).max(dim=-1).values.tolist()
        assert out.logprobs == pytest.approx(want, abs=1e-5) and out.ranks == [1] * 6
        assert all(len(t) == 2 for t in out.top_logprobs)


# ---- (h) part 15's CUDA graphs ---------------------------------------------------------------

GRAPH_MODES = ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY"]


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_cuda_graphs_keep_the_eager_tokens(mode, no_tf32, prompt_token_ids, hf_greedy):
    """Part 15 with CUDA graphs (compilation none, so the graphs are the only change) against HF's
    greedy in fp32: 16 requests of different lengths, so the decode batch shrinks through every
    size from 16 to 1 (padded to the capture sizes), with prompt chunks beside decodes (mixed
    batches), prefix caching (half the prompts are prefixes of the others) and async scheduling.
    Every capture size replays, and no graph is captured after start-up."""
    from part15_full import LLM
    from part15_full.config import CUDAGraphMode
    from test_part15_cuda_graphs import _graph_count

    sizes = [1, 2, 4, 8, 16, 32]
    llm = LLM(device="cuda", dtype="float32", compilation_mode="none", max_num_seqs=16, max_num_batched_tokens=64,
              compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": sizes})
    try:
        runner = llm.engine.executor.runner
        gr = runner.graph_runner
        assert runner.cudagraph_mode == CUDAGraphMode[mode]

        at_start = _graph_count(gr)
        seen = set()
        dispatch = gr.dispatcher.dispatch

        def observed(num_tokens, num_reqs, max_query_len):
            out = dispatch(num_tokens, num_reqs, max_query_len)
            seen.add(out)
            return out
        gr.dispatcher.dispatch = observed
        prompts = prompt_token_ids + [ids[: max(3, len(ids) // 2)] for ids in prompt_token_ids]
        lengths = [4 + 3 * i for i in range(len(prompts))]
        outs = llm.generate(prompts, [greedy(n) for n in lengths])
        torch.cuda.synchronize()
        for o, p, n in zip(outs, prompts, lengths):
            assert o.outputs[0].token_ids == hf_greedy(p, n)
        assert _graph_count(gr) == at_start > 0
        replayed = {d.num_tokens for m, d in seen if d is not None}
        if CUDAGraphMode[mode].decode_mode() == CUDAGraphMode.FULL:
            assert {1, 2, 4, 8, 16} <= replayed, replayed
        assert gr.replays[CUDAGraphMode.FULL] + gr.replays[CUDAGraphMode.PIECEWISE] > 0
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == num_kv_blocks(llm.engine) - 1 and not kv.req_to_blocks
    finally:
        release(llm)


def test_kv_cache_is_sized_from_free_memory():
    """Without --kv-cache-memory-mb, part 15 on CUDA gives the KV cache what --gpu-memory-utilization
    leaves after the profile: more blocks at 0.5 than at 0.3, and the process stays within its share."""
    from part15_full import LLM

    blocks = {}
    for util in (0.3, 0.5):
        llm = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=util, enforce_eager=True)
        try:
            runner = llm.engine.executor.runner
            blocks[util] = runner.num_blocks
            total = torch.cuda.get_device_properties(0).total_memory
            assert torch.cuda.memory_reserved() <= util * total
        finally:
            release(llm)
    assert blocks[0.5] > blocks[0.3] > 0
