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



# ---- (i) part 15's default path: compiled, bf16, FULL decode graphs past 32 -------------------
#
# (h) holds the graphs to HF in fp32 with compilation off and at most 32 sequences. What part 15
# runs by default on a GPU is another path: the model torch.compiled whole, bf16, FULL_DECODE_ONLY
# graphs at vLLM's default capture sizes (every 8 up to 2 x max_num_seqs). Here 70 sequences decode
# together, so batches of 33-70 pad to the captured 40..72, and the batch then shrinks through
# every smaller size. The graphs' greedy tokens are held to the same engine without them:
# - in fp32 (TF32 off), compiled with graphs against enforce_eager: the same tokens exactly;
# - in bf16, the default, against enforce_eager and against the same compiled engine with
#   cudagraph_mode NONE (the graphs the only change). bf16 has no exact oracle: two runs round
#   differently (another kernel, a padded GEMM's other cuBLAS kernel), and a random model's logits
#   are close together, so runs part at near-ties. Each sequence must agree up to where it parts,
#   its tokens' logprobs within `tol` there, and it may part only where both runs have the two
#   tokens within `tol` of each other.
# The model is a small Llama with random weights saved by the test: the embedded SmolLM2 (a 98 MB
# GGUF) cannot be carried to a GPU machine without network, and needs HF's fp32 oracle besides.
# Calibration on a CPU, this model and workload in bf16, part 15's C kernels against its torch ops
# (VLLM_COURSE_CPU_RUNNER, _GEMM, _FUSED_OPS, _ATTENTION, _PREPACK all 0): logprobs within 0.047
# before parting, parting gaps at most 0.047, 63% of tokens compared; the C kernels in bf16 against
# fp32: 0.052, 0.062, 72%. Changing only each prompt's first token (seen through attention alone)
# fails the check at once: 7 of 1658 tokens compared, gaps past 0.26.

DEFAULT_PATH_SEQS, DEFAULT_PATH_MAX_SEQS = 70, 72
PADDED_PAST_32 = {40, 48, 56, 64, 72}  # the FULL graphs batches of 33-70 decoding sequences replay
BF16_TOL = 0.15  # logprob differences and near-tie gaps allowed in bf16 (3x the CPU calibration's)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 4-layer Llama (hidden 256, GQA 4/2, head_dim 64, vocabulary 2048), random weights of std
    0.05: small enough that a step's rounding moves the logprobs by hundredths (std 0.2 moved them
    by up to 0.85 on the CPU calibration), each layer still a large part of the residual stream."""
    import transformers

    from conftest import save_tiny

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=False)
    return save_tiny(tmp_path_factory.mktemp("default_path") / "llama", cfg, seed=7, scale=0.05)


def default_path_workload(n: int = DEFAULT_PATH_SEQS):
    """n prompts of 5-40 tokens (every fifth one extends the one before: prefix-cache hits) and
    output lengths 8-40, so the decode batch shrinks by about two sequences a step."""
    import random

    rng = random.Random(11)
    prompts: list[list[int]] = []
    for i in range(n):
        fresh = [rng.randrange(3, 2048) for _ in range(rng.randint(5, 40))]
        prompts.append(prompts[-1][:16] + fresh[:8] if i % 5 == 4 else fresh)
    return prompts, [8 + (7 * i) % 33 for i in range(n)]


def run_default_path(model: str, device: str = "cuda", **overrides) -> dict:
    """Part 15 at its defaults (device and overrides aside) over default_path_workload: each
    sequence's tokens and top-5 logprobs, what the runner resolved, and with CUDA graphs every
    step's dispatch and the replay and capture counts."""
    from part15_full import LLM
    from part15_full.graph_runner import CUDAGraphRunner
    from test_part15_cuda_graphs import _graph_count

    prompts, lengths = default_path_workload()
    llm = LLM(model=model, device=device, max_num_seqs=DEFAULT_PATH_MAX_SEQS, kv_cache_memory_mb=512, **overrides)
    try:
        runner = llm.engine.executor.runner
        gr = runner.graph_runner
        graphed = isinstance(gr, CUDAGraphRunner)
        steps: list[tuple] = []  # (tokens, sequences, longest query, mode, descriptor) per forward
        if graphed:
            at_start = _graph_count(gr)
            dispatch = gr.dispatcher.dispatch

            def observed(num_tokens, num_reqs, max_query_len):
                out = dispatch(num_tokens, num_reqs, max_query_len)
                steps.append((num_tokens, num_reqs, max_query_len, *out))
                return out
            gr.dispatcher.dispatch = observed
        outs = llm.generate(prompts, [greedy(n, logprobs=5) for n in lengths])
        if device == "cuda":
            torch.cuda.synchronize()
        kv = llm.engine.kv_cache_manager
        seqs = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]
        assert [len(t) for t, _ in seqs] == lengths
        return {"seqs": seqs, "dtype": runner.dtype, "compilation_mode": runner.compilation_mode,
                "cudagraph_mode": runner.cudagraph_mode, "sizes": list(runner.cudagraph_sizes or []),
                "steps": steps, "replays": dict(gr.replays) if graphed else None,
                "captured_after_start": _graph_count(gr) - at_start if graphed else 0,
                "pool_full": kv.num_free_blocks == num_kv_blocks(llm.engine) - 1 and not kv.req_to_blocks}
    finally:
        release(llm)


def assert_full_decode_replays(r: dict) -> None:
    """Compiled, FULL_DECODE_ONLY at the default sizes; every step of decoding sequences alone
    replayed a FULL graph, at the padded sizes past 32 too, padded up and never down; the other
    steps (prompts) ran the compiled forward; nothing captured after start-up; no KV block leaked."""
    from part15_full.config import CUDAGraphMode

    assert r["compilation_mode"] != "none" and r["cudagraph_mode"] == CUDAGraphMode.FULL_DECODE_ONLY, \
        (r["compilation_mode"], r["cudagraph_mode"])
    assert max(r["sizes"]) >= DEFAULT_PATH_MAX_SEQS and PADDED_PAST_32 <= set(r["sizes"]), r["sizes"]
    decode = [s for s in r["steps"] if s[2] == 1 and s[0] == s[1]]  # every sequence one new token
    others = [s for s in r["steps"] if not (s[2] == 1 and s[0] == s[1])]
    assert decode and others, r["steps"]
    assert all(s[3] == CUDAGraphMode.FULL for s in decode), [s for s in decode if s[3] != CUDAGraphMode.FULL]
    assert all(s[3] == CUDAGraphMode.NONE for s in others), others
    assert all(d.num_reqs == d.num_tokens >= n for n, _, _, _, d in decode)
    replayed = {d.num_tokens for *_, d in decode}
    assert PADDED_PAST_32 | {8, 16, 24, 32} <= replayed, sorted(replayed)
    assert r["replays"] == {CUDAGraphMode.FULL: len(decode), CUDAGraphMode.PIECEWISE: 0}, (r["replays"], len(decode))
    assert r["captured_after_start"] == 0 and r["pool_full"]


def _report(summary: dict) -> dict:
    import json
    import os

    if os.environ.get("GPU_TEST_SUMMARY"):  # scripts/gpu_step15.sh keeps these beside its log
        with open(os.environ["GPU_TEST_SUMMARY"], "a") as f:
            f.write(json.dumps(summary) + "\n")
    return summary


def assert_same_greedy_up_to_near_ties(got: dict, want: dict, tol: float, what: str,
                                       min_compared: float = 1 / 3) -> None:
    """See (i)'s comment. At least `min_compared` of all tokens lie before the sequences part."""
    import math

    parted, worst, compared = [], 0.0, 0
    for i, ((g, glp), (w, wlp)) in enumerate(zip(got["seqs"], want["seqs"], strict=True)):
        k = next((j for j in range(len(g)) if g[j] != w[j]), len(g))
        compared += k
        worst = max([worst] + [abs(glp[j][g[j]] - wlp[j][w[j]]) for j in range(k)])
        if k < len(g):
            gaps = (wlp[k][w[k]] - wlp[k].get(g[k], -math.inf), glp[k][g[k]] - glp[k].get(w[k], -math.inf))
            parted.append((i, k, *(round(x, 4) for x in gaps)))
    total = sum(len(g) for g, _ in got["seqs"])
    summary = _report({"check": what, "sequences": len(got["seqs"]), "equal": len(got["seqs"]) - len(parted),
                       "tokens compared": f"{compared}/{total}", "max logprob difference": round(worst, 4),
                       "parted (seq, token, gap in each run)": parted})
    assert worst < tol and all(a < tol and b < tol for *_, a, b in parted), summary
    assert compared >= min_compared * total, summary


@pytest.fixture(scope="module")
def default_path_bf16(tiny_llama):
    return run_default_path(str(tiny_llama))


def test_default_path_replays_full_decode_graphs_past_32(default_path_bf16):
    assert default_path_bf16["dtype"] == torch.bfloat16  # the default on CUDA
    assert_full_decode_replays(default_path_bf16)


def test_default_path_fp32_graphs_give_the_eager_tokens(tiny_llama, no_tf32):
    """In fp32 rounding cannot flip a token: compiled + FULL graphs give enforce_eager's tokens exactly."""
    graphs = run_default_path(str(tiny_llama), dtype="float32")
    assert_full_decode_replays(graphs)
    eager = run_default_path(str(tiny_llama), dtype="float32", enforce_eager=True)
    assert eager["compilation_mode"] == "none" and eager["replays"] is None and eager["pool_full"]
    same = [g == e for (g, _), (e, _) in zip(graphs["seqs"], eager["seqs"])]
    _report({"check": "default path in fp32: compiled + graphs vs enforce_eager", "sequences": len(same),
             "equal": sum(same)})
    assert all(same), [i for i, s in enumerate(same) if not s]


def test_default_path_bf16_graphs_track_eager(default_path_bf16, tiny_llama):
    eager = run_default_path(str(tiny_llama), enforce_eager=True)
    assert eager["dtype"] == torch.bfloat16 and eager["compilation_mode"] == "none" and eager["pool_full"]
    assert_same_greedy_up_to_near_ties(default_path_bf16, eager, BF16_TOL,
                                       "default path in bf16: compiled + graphs vs enforce_eager")


def test_default_path_bf16_graphs_track_graphless(default_path_bf16, tiny_llama):
    from part15_full.config import CUDAGraphMode

    plain = run_default_path(str(tiny_llama), compilation_config={"cudagraph_mode": "NONE"})
    assert plain["cudagraph_mode"] == CUDAGraphMode.NONE and plain["compilation_mode"] != "none"
    assert plain["dtype"] == torch.bfloat16 and plain["pool_full"]
    assert_same_greedy_up_to_near_ties(default_path_bf16, plain, BF16_TOL,
                                       "default path in bf16: compiled + graphs vs compiled, cudagraph_mode NONE")
