"""Part 15's CUDA graphs, on the CPU: the configuration (vLLM's modes, default capture sizes, what
is refused), the dispatcher (the next capture size, FULL for uniform decode batches, PIECEWISE for
the rest, eager past the largest), the per-feature lowering of the mode, and the runner itself:
cuda_graph.py's EagerGraph stands in for a CUDA graph (a replay recomputes the captured call on the
captured tensors), so padding, static buffers, the FULL metadata and the split at attention all
run here. The engine with graphs gives the eager engine's greedy tokens (and HF's) over padded
decode batches and mixed prefill/decode steps, with speculative decoding (FULL graphs of whole
1 + k token sequences) and for Gemma 2 and 3 (sliding layers, soft-capped scores); a runner that leaves one input out of its static buffers is caught; padding
writes no KV; nothing is captured after start-up.

The engine checks use the Triton attention backend (the one a FULL graph can hold), which on a CPU
runs under TRITON_INTERPRET=1, set before triton is imported: so they run in a child process, this
file run as a script, which prints one JSON line (as tests/test_paged_kernels.py does)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from part15_full.config import CompilationConfig, CUDAGraphMode, EngineConfig, default_capture_sizes
from part15_full.cudagraph_dispatcher import BatchDescriptor, CUDAGraphDispatcher
from part15_full.graph_runner import graph_mode_for
from part15_full.paged_attention import AttentionCGSupport

M = CUDAGraphMode


def test_default_capture_sizes_are_vllms():
    sizes = default_capture_sizes(512)
    assert len(sizes) == 51 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16]
    # The largest: min(2 x max_num_seqs x (1 + k), 512), within the step's token budget.
    assert CompilationConfig().resolve(True, False, False, 64, 1024)[1][-1] == 128
    assert CompilationConfig().resolve(True, False, False, 1024, 8192)[1][-1] == 512
    assert CompilationConfig().resolve(True, False, False, 64, 100)[1][-1] == 96
    # Drafts (k = 2): a FULL decode graph holds whole sequences of 3 tokens.
    mode, sizes = CompilationConfig().resolve(True, False, False, 8, 1024, uniform_decode_query_len=3)
    assert mode == M.FULL_AND_PIECEWISE and all(n % 3 == 0 for n in sizes) and sizes[:3] == [3, 6, 9]


def test_mode_defaults_and_what_turns_graphs_off():
    assert CompilationConfig().resolve(True, False, False, 64, 1024)[0] == M.FULL_AND_PIECEWISE  # vLLM's default
    assert CompilationConfig().resolve(True, False, True, 64, 1024)[0] == M.FULL_DECODE_ONLY  # torch.compiled whole
    assert CompilationConfig().resolve(True, True, False, 64, 1024) == (M.NONE, [])  # --enforce-eager
    assert CompilationConfig().resolve(False, False, False, 64, 1024) == (M.NONE, [])  # no CUDA
    explicit = CompilationConfig.from_cli('{"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [8, 2, 4]}')
    assert explicit.resolve(True, False, False, 64, 1024) == (M.PIECEWISE, [2, 4, 8])


def test_the_start_up_summary_names_the_mode_and_sizes_the_runner_resolves():
    """config.summary's CUDA-graph line: the model runner's resolution (compilation mode, the step's
    token budget, 1 + k with drafts), shown here for a CUDA device without one."""
    import torch

    cuda = torch.device("cuda")
    c = EngineConfig(device="cpu", max_num_seqs=4)
    assert c._cudagraph_summary(torch.device("cpu"), 1024) == "NONE"
    assert c._cudagraph_summary(cuda, 1024) == "FULL_DECODE_ONLY at 4 sizes, 1..8 tokens"  # compiled by default
    assert EngineConfig(device="cpu", max_num_seqs=4, compilation_mode="none")._cudagraph_summary(cuda, 1024) \
        == "FULL_AND_PIECEWISE at 4 sizes, 1..8 tokens"
    spec = EngineConfig(device="cpu", max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=2)
    assert spec._cudagraph_summary(cuda, 16) == "FULL_DECODE_ONLY at 3 sizes, 3..9 tokens"  # whole 3-token sequences
    assert "CUDA graphs NONE" in c.summary(max_model_len=128)


@pytest.mark.parametrize("flag, message", [
    ('{"cudagraph_mode": "FULLY"}', "cudagraph_mode must be one of"),
    ('{"level": 3}', "unknown field"),
    ('{"cudagraph_capture_sizes": [0, 8]}', "positive integers"),
    ('{"cudagraph_mode": "FULL"', "Expecting"),
])
def test_compilation_config_refuses_bad_input(flag, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(compilation_config=flag, device="cpu").validate()


def test_a_bad_compilation_mode_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="--compilation-mode must be one of unset, none, attention_op, full"):
        EngineConfig(compilation_mode="max-autotune", device="cpu").validate()


def test_graphs_need_cuda_and_an_unsplit_forward():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(compilation_config='{"cudagraph_mode": "FULL"}', device="cpu").validate()
    EngineConfig(compilation_config='{"cudagraph_mode": "NONE"}', device="cpu").validate()
    import torch

    if not torch.cuda.is_available():  # the default device is then the CPU
        with pytest.raises(ValueError, match="needs a CUDA device"):
            EngineConfig(compilation_config='{"cudagraph_mode": "PIECEWISE"}').validate()
    with pytest.raises(ValueError, match="use FULL_DECODE_ONLY"):
        EngineConfig(compilation_config='{"cudagraph_mode": "PIECEWISE"}', compilation_mode="attention_op",
                     device="cpu", enforce_eager=True).validate()


def test_dispatcher_pads_up_and_falls_back_past_the_largest():
    d = CUDAGraphDispatcher(M.FULL_AND_PIECEWISE, [1, 2, 4, 8], max_num_seqs=8)
    assert d.dispatch(3, 3, 1) == (M.FULL, BatchDescriptor(4, 4, True))  # 3 decodes: the 4-sequence graph
    assert d.dispatch(8, 8, 1) == (M.FULL, BatchDescriptor(8, 8, True))
    assert d.dispatch(5, 2, 4) == (M.PIECEWISE, BatchDescriptor(8))  # a prefill chunk beside a decode
    assert d.dispatch(1, 1, 1) == (M.FULL, BatchDescriptor(1, 1, True))
    assert d.dispatch(9, 9, 1) == (M.NONE, None)  # past the largest size: eager
    assert d.dispatch(0, 0, 0) == (M.NONE, None)
    only_decode = CUDAGraphDispatcher(M.FULL_DECODE_ONLY, [1, 2, 4, 8], max_num_seqs=8)
    assert only_decode.dispatch(5, 2, 4) == (M.NONE, None)
    assert only_decode.dispatch(5, 5, 1) == (M.FULL, BatchDescriptor(8, 8, True))
    piecewise = CUDAGraphDispatcher(M.PIECEWISE, [1, 2, 4, 8], max_num_seqs=8)
    assert piecewise.dispatch(3, 3, 1) == (M.PIECEWISE, BatchDescriptor(4))
    # With 2 drafts each decoding sequence has 3 tokens: 2 sequences fill the 6-token graph.
    spec = CUDAGraphDispatcher(M.FULL_AND_PIECEWISE, [3, 6, 9, 12], max_num_seqs=4, uniform_decode_query_len=3)
    assert spec.dispatch(6, 2, 3) == (M.FULL, BatchDescriptor(6, 2, True))
    assert spec.dispatch(5, 2, 3) == (M.PIECEWISE, BatchDescriptor(6))  # one sequence has fewer drafts
    with pytest.raises(ValueError, match="mixed batches"):  # lowered before: no backend replays any batch
        CUDAGraphDispatcher(M.FULL, [1, 2], max_num_seqs=2)
    # Capture order: each mode's largest first.
    assert [(m, [x.num_tokens for x in ds]) for m, ds in d.capture_descs()] == \
        [(M.PIECEWISE, [8, 4, 2, 1]), (M.FULL, [8, 4, 2, 1])]


def test_mode_is_lowered_to_what_the_model_and_backend_can_replay():
    uniform, never = AttentionCGSupport.UNIFORM_BATCH, AttentionCGSupport.NEVER
    assert graph_mode_for(M.FULL_AND_PIECEWISE, uniform) == (M.FULL_AND_PIECEWISE, [])
    assert graph_mode_for(M.FULL, uniform)[0] == M.FULL_AND_PIECEWISE  # mixed batches: pieces
    assert graph_mode_for(M.FULL_AND_PIECEWISE, never)[0] == M.PIECEWISE  # the torch reference plans on the host
    assert graph_mode_for(M.FULL_AND_PIECEWISE, uniform, kv_connector=True)[0] == M.PIECEWISE
    assert graph_mode_for(M.FULL_AND_PIECEWISE, uniform, piecewise_ok=False)[0] == M.FULL_DECODE_ONLY
    assert graph_mode_for(M.PIECEWISE, uniform, piecewise_ok=False)[0] == M.NONE
    assert graph_mode_for(M.FULL_AND_PIECEWISE, uniform, moe_on_host=True)[0] == M.NONE  # expert parallelism
    assert graph_mode_for(M.FULL_AND_PIECEWISE, uniform, tensor_parallel=True)[0] == M.FULL_DECODE_ONLY  # no pieces


def test_batch_defaults_follow_the_gpu_as_vllms_server():
    from part15_full.config import batch_defaults, batch_defaults_for

    gib = 2**30
    assert batch_defaults_for(141 * gib, "NVIDIA H200") == (1024, 8192)
    assert batch_defaults_for(80 * gib, "NVIDIA H100 80GB HBM3") == (1024, 8192)
    assert batch_defaults_for(80 * gib, "NVIDIA A100-SXM4-80GB") == (256, 2048)  # kept small on A100s
    assert batch_defaults_for(24 * gib, "NVIDIA L4") == (256, 2048)
    assert batch_defaults("cpu") == (64, 1024)
    assert (EngineConfig(device="cpu").max_num_seqs, EngineConfig(device="cpu").max_num_batched_tokens) == (64, 1024)
    assert EngineConfig(device="cpu", max_num_seqs=8).max_num_seqs == 8  # a flag wins


def test_kv_cache_gets_what_the_profile_leaves():
    from part15_full.memory_profiling import kv_cache_budget_bytes

    gib = 2**30
    # 0.9 of 140 GiB, less a 3 GiB peak (weights and the largest step) and 1 GiB outside torch.
    assert kv_cache_budget_bytes(140 * gib, 0.9, 3 * gib, 1 * gib) == int(126 * gib) - 4 * gib
    # ...and the CUDA graphs' pool: the largest graph's activations, measured by the profile.
    assert kv_cache_budget_bytes(140 * gib, 0.9, 3 * gib, 1 * gib, 2 * gib) == int(126 * gib) - 6 * gib
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        kv_cache_budget_bytes(16 * gib, 0.5, 7 * gib, 1 * gib)


def test_a_weak_reference_shares_memory_without_keeping_it():
    """A graph's outputs are kept as weak references (cuda_graph.weak_ref), so the pool can reuse them."""
    import torch

    from part15_full.cuda_graph import weak_ref

    for dtype in (torch.float32, torch.bfloat16, torch.long):
        t = torch.arange(6).to(dtype).view(2, 3)
        uses = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
        w = weak_ref((t,))[0]
        assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == uses  # the allocation is not held
        assert (w.data_ptr(), w.shape, w.dtype) == (t.data_ptr(), t.shape, t.dtype)
        t[1, 2] = 42
        assert w[1, 2] == 42 and torch.equal(w, t)
    strided = t.t()
    assert weak_ref(strided) is strided  # not contiguous: kept as it is


# -- the engine with graphs (in a child process: Triton under TRITON_INTERPRET=1) -------------------

@pytest.fixture(scope="module")
def engine_results(tmp_path_factory) -> dict:
    from conftest import run_interpreted_script

    return run_interpreted_script(__file__, tmp_path_factory.mktemp("graphs"))


def test_graphs_give_the_eager_engines_tokens(engine_results):
    r = engine_results["graphs"]
    assert r["eager"] == r["hf"], "the eager Triton engine itself differs from HF"
    assert r["graphed"] == r["eager"]
    # Both kinds ran: decode batches of 1-3 sequences padded to 1, 2, 4 (FULL), steps holding prefill
    # chunks (PIECEWISE, up to the 16-token graph).
    assert r["replays"]["FULL"] >= 5 and r["replays"]["PIECEWISE"] >= 2, r["replays"]
    assert r["padded_steps"] > 0, "no step was padded"


def test_speculative_verification_replays_graphs_of_whole_sequences(engine_results):
    r = engine_results["spec"]
    assert r["eager"] == r["hf"] and r["graphed"] == r["eager"]
    assert r["full_shapes"] == [3, 6]  # FULL graphs hold whole sequences of 1 + k = 3 tokens
    assert r["replays"]["FULL"] >= 3 and r["replays"]["PIECEWISE"] >= 1, r["replays"]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_families_with_windows_and_caps_replay_graphs(engine_results, name):
    r = engine_results["families"][name]
    assert r["windows"] == [8, None, 8] and (r["softcap"] == 1.5) == (name == "gemma2")
    assert r["eager"] == r["hf"] and r["graphed"] == r["eager"]
    assert r["replays"]["FULL"] >= 3 and r["replays"]["PIECEWISE"] >= 1, r["replays"]


def test_nothing_is_captured_after_start_up(engine_results):
    r = engine_results["graphs"]
    assert r["graphs_after_run"] == r["graphs_at_start"] > 0


def test_padding_writes_no_kv(engine_results):
    assert engine_results["graphs"]["null_block_untouched"]


def test_a_runner_that_leaves_an_input_out_of_its_buffers_is_caught(engine_results):
    """The stand-in graph is faithful: positions not copied into the device arrays (the graphs' static
    buffers) replay stale ones."""
    r = engine_results
    assert r["stale_positions"] != r["graphs"]["eager"]


def _run_engine_checks(tmp: Path) -> dict:
    import torch
    import transformers

    from conftest import greedy, hf_greedy_tokens, save_tiny
    from part15_full import LLM
    from part15_full.cuda_graph import EagerGraph
    from part15_full.graph_runner import CUDAGraphRunner, GraphRunner
    from part15_full.input_batch import InputBatch

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = save_tiny(tmp / "llama", config, seed=5, scale=0.3)
    g = torch.Generator().manual_seed(3)
    # Three prompts, one long enough to be chunked under the 16-token budget: its chunks run
    # beside the others' decodes (mixed steps); then 1-3 sequences decode (padded to 1, 2, 4).
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 9)]
    n = 10
    llm = LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4,
              max_num_seqs=4, max_num_batched_tokens=16)
    runner = llm.engine.executor.runner

    def static_inputs(r, sizes):
        """The runner's InputBatch as an engine with graphs builds it: a device set of arrays at fixed
        addresses (the graphs' static inputs), padding written up to the largest size."""
        r.input_batch = InputBatch(r.max_step_tokens, r.config.max_num_seqs, r.max_model_len // r.block_size,
                                   r.block_size, r.device, r.model_config.vocab_size, (max(sizes), r.config.max_num_seqs))
        return r.input_batch.device_arrays

    def run(graph_runner):
        runner.graph_runner = graph_runner
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))
        return [o.outputs[0].token_ids for o in outs]

    def graphs(cls=CUDAGraphRunner):
        sizes = [1, 2, 4, 8, 16]
        gr = cls(runner.model, runner.attn, M.FULL_AND_PIECEWISE, sizes, max_num_seqs=4,
                 buffers=static_inputs(runner, sizes), max_model_len=runner.max_model_len, graph_cls=EagerGraph)
        gr.capture()
        return gr

    eager = run(GraphRunner(runner.model, runner.attn))
    gr = graphs()
    null_before = runner.attn.k_cache[:, 0].clone()
    padded = {"steps": 0}
    dispatch = gr.dispatcher.dispatch

    def counting(num_tokens, num_reqs, max_query_len):
        mode, desc = dispatch(num_tokens, num_reqs, max_query_len)
        padded["steps"] += desc is not None and desc.num_tokens > num_tokens
        return mode, desc
    gr.dispatcher.dispatch = counting
    entries_at_start = _graph_count(gr)
    graphed = run(gr)
    result = {"graphs": {
        "hf": hf_greedy_tokens(path, prompts, n), "eager": eager, "graphed": graphed,
        "replays": {m.name: k for m, k in gr.replays.items()}, "padded_steps": padded["steps"],
        "graphs_at_start": entries_at_start, "graphs_after_run": _graph_count(gr),
        "null_block_untouched": bool(torch.equal(runner.attn.k_cache[:, 0], null_before)),
    }}

    # Speculative decoding (a 1-layer self-draft, k = 2; its own passes run eagerly): a sequence
    # verifying 2 drafts has 3 tokens, so decode steps replay a FULL graph of 3 tokens a sequence, and
    # the prompt steps and the last, shorter verifications replay pieces.
    spec = LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4, max_num_seqs=2,
               max_num_batched_tokens=16, speculative_method="draft_model", num_speculative_tokens=2,
               speculative_draft_layers=1)
    spec_runner = spec.engine.executor.runner
    spec_prompts = [prompts[0], prompts[2]]

    def run_spec(graph_runner):
        spec_runner.graph_runner = graph_runner
        outs = spec.generate([{"prompt_token_ids": p} for p in spec_prompts], greedy(12))
        return [o.outputs[0].token_ids for o in outs]
    spec_eager = run_spec(GraphRunner(spec_runner.model, spec_runner.attn))
    spec_sizes = [1, 2, 3, 4, 6, 8, 16]
    spec_graphs = CUDAGraphRunner(spec_runner.model, spec_runner.attn, M.FULL_AND_PIECEWISE, spec_sizes,
                                  max_num_seqs=2, buffers=static_inputs(spec_runner, spec_sizes),
                                  max_model_len=spec_runner.max_model_len, uniform_decode_query_len=3,
                                  graph_cls=EagerGraph)
    spec_graphs.capture()
    result["spec"] = {"hf": hf_greedy_tokens(path, spec_prompts, 12), "eager": spec_eager,
                      "graphed": run_spec(spec_graphs),
                      "replays": {m.name: k for m, k in spec_graphs.replays.items()},
                      "full_shapes": sorted(d.num_tokens for d in spec_graphs.full.entries)}

    # An InputBatch that leaves the positions out of the device arrays: eager steps read the step's
    # own (host) positions, replays the stale ones in the graphs' buffers.
    stale = graphs()
    copy_all = runner.input_batch.to_device

    def without_positions(step):
        device_positions = runner.input_batch.device_arrays.positions
        stale_values, positions = device_positions.clone(), step.positions
        copy_all(step)
        device_positions.copy_(stale_values)
        step.positions = positions
    runner.input_batch.to_device = without_positions
    result["stale_positions"] = run(stale)
    result["families"] = _family_graphs(tmp, prompts[1], prompts[0])
    return result


def _family_graphs(tmp: Path, *prompts: list[int]) -> dict:
    """Gemma 2 (soft-capped scores in the Triton kernel, every other layer sliding) and Gemma 3 (q/k
    norms, two RoPE tables, five-to-one sliding layers), eager and through FULL and PIECEWISE graphs."""
    import torch

    from conftest import greedy, hf_greedy_tokens
    from model_families import save_family
    from part15_full import LLM
    from part15_full.cuda_graph import EagerGraph
    from part15_full.graph_runner import CUDAGraphRunner, GraphRunner
    from part15_full.input_batch import InputBatch

    out = {}
    for name in ("gemma2", "gemma3"):
        # Dynamo keeps its traces per code object (LlamaForCausalLM.forward, every model of this
        # process): forget the earlier engines' before they reach its recompile limit.
        torch._dynamo.reset()
        path = save_family(tmp / name, name, seed=5)
        llm = LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4,
                  max_num_seqs=4, max_num_batched_tokens=16)
        r = llm.engine.executor.runner

        def run(graph_runner):
            r.graph_runner = graph_runner
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6))]
        eager = run(GraphRunner(r.model, r.attn))
        sizes = [1, 2, 4, 8, 16]
        r.input_batch = InputBatch(r.max_step_tokens, 4, r.max_model_len // r.block_size, r.block_size, r.device,
                                   r.model_config.vocab_size, (max(sizes), 4))
        gr = CUDAGraphRunner(r.model, r.attn, M.FULL_AND_PIECEWISE, sizes, max_num_seqs=4,
                             buffers=r.input_batch.device_arrays, max_model_len=r.max_model_len, graph_cls=EagerGraph)
        gr.capture()
        out[name] = {"hf": hf_greedy_tokens(path, prompts, 6, attn_implementation="eager"), "eager": eager, "graphed": run(gr), "windows": list(r.attn.windows),
                     "softcap": r.attn.logit_softcap, "replays": {m.name: k for m, k in gr.replays.items()}}
        llm.shutdown()
    return out


def _graph_count(gr) -> int:
    """Graphs captured by the runner's FULL wrapper and by every piece of the split forward."""
    from part15_full.piecewise import _Piece

    split = gr.piecewise.state.get("modules", []) if gr.piecewise is not None else []
    pieces = [m for s in split for m in s.modules() if isinstance(m, _Piece)]
    return len(gr.full.entries) + sum(len(p.wrapper.entries) for p in pieces)


if __name__ == "__main__":
    print(json.dumps(_run_engine_checks(Path(sys.argv[1]))))
