"""Part 15's MoE layers under CUDA graphs: the tokens are sorted by expert on the device
(moe_kernels.align_block_size), into arrays whose sizes follow from the shapes alone, so nothing of
an MoE step reads the host. Checked here: the sort against a plain host one for many routings; the
Triton grouped GEMM (interpreted) against the torch reference; and a tiny Mixtral engine whose
experts run through that kernel, replayed from graphs (cuda_graph.py's EagerGraph stands in for a
CUDA graph on the CPU), giving the eager engine's and HF's greedy tokens.

Triton runs under TRITON_INTERPRET=1, set before triton is imported: the engine check runs in a
child process, this file run as a script, which prints one JSON line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted_script


def host_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The sort on the host (what parts 11-14 do): each expert's pairs in order, padded to block_m."""
    flat = ids.flatten().tolist()
    slots, experts = [], []
    for e in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(pairs) // block_m) * block_m
        slots += pairs + [len(flat)] * (padded - len(pairs))
        experts += [e] * (padded // block_m)
    return slots, experts


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(1, 4, 2, 16), (21, 6, 2, 16), (40, 8, 3, 4),
                                                              (7, 3, 1, 2), (64, 8, 2, 16)])
def test_the_device_sort_is_the_host_sort_at_sizes_set_by_the_shapes(tokens, experts, top_k, block_m):
    from part15_full.moe_kernels import align_block_size

    g = torch.Generator().manual_seed(tokens)
    for trial in range(5):
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
        if trial == 0:
            ids.fill_(experts - 1)  # every pair to one expert
        sorted_ids, block_expert, num_padded = align_block_size(ids, experts, block_m)
        max_blocks = -(-tokens * top_k // block_m) + experts
        assert sorted_ids.shape == (max_blocks * block_m,) and block_expert.shape == (max_blocks,)
        slots, owners = host_align(ids, experts, block_m)
        n = int(num_padded)
        assert n == len(slots) and sorted_ids[:n].tolist() == slots and block_expert[:n // block_m].tolist() == owners
        assert (sorted_ids[n:] == tokens * top_k).all()  # the rest is padding


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_interpreted_script(__file__, tmp_path_factory.mktemp("moe_graphs"))


def test_the_grouped_gemm_matches_the_reference(results):
    errs = results["kernel_errors"]
    assert len(errs) == 3 and all(v < 1e-4 for v in errs.values()), errs


def test_an_moe_model_replays_graphs_with_the_eager_engines_tokens(results):
    r = results["engine"]
    assert r["eager"] == r["hf"] and r["graphed"] == r["eager"]
    assert r["mode"] == "FULL_AND_PIECEWISE" and r["replays"]["FULL"] >= 3 and r["replays"]["PIECEWISE"] >= 1, r


def _run(tmp: Path) -> dict:
    import transformers

    from conftest import greedy, hf_greedy_tokens, save_tiny
    from part15_full import LLM
    from part15_full import fused_moe
    from part15_full.config import CUDAGraphMode
    from part15_full.cuda_graph import EagerGraph
    from part15_full.fused_moe import experts_reference, select_experts
    from part15_full.graph_runner import CUDAGraphRunner, GraphRunner, graph_mode_for
    from part15_full.input_batch import InputBatch
    from part15_full.moe_kernels import fused_experts
    from part15_full.paged_attention import AttentionCGSupport

    g = torch.Generator().manual_seed(0)
    errs = {}
    for t, e, k, h, i in [(1, 4, 2, 32, 16), (21, 6, 2, 48, 40), (40, 8, 3, 32, 24)]:
        x = torch.randn(t, h, generator=g)
        w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
        weights, ids = select_experts(torch.randn(t, e, generator=g), k, True)
        errs[f"{t}x{e}x{k}"] = (fused_experts(x, w13, w2, ids, weights) - experts_reference(x, w13, w2, ids, weights)
                                ).abs().max().item()

    # The experts through the grouped GEMM, as on a GPU (on a CPU the layer takes the torch reference).
    def apply(self, layer, x, ids, weights):
        return fused_experts(x, layer.w13_weight, layer.w2_weight, ids if ids.dim() == 2 else ids[:, None],
                             weights if weights is None or weights.dim() == 2 else weights[:, None])
    fused_moe.UnquantizedFusedMoEMethod.apply = apply

    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, intermediate_size=96, num_hidden_layers=2,
                                        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    path = save_tiny(tmp / "mixtral", config, seed=4, scale=0.3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 9)]
    llm = LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4,
              max_num_seqs=4, max_num_batched_tokens=16)
    runner = llm.engine.executor.runner
    assert all(m.use_triton for m in runner.model.modules() if isinstance(m, fused_moe.FusedMoE))
    mode, _ = graph_mode_for(CUDAGraphMode.FULL_AND_PIECEWISE, AttentionCGSupport.UNIFORM_BATCH, moe_on_host=any(
        isinstance(m, fused_moe.FusedMoE) and (m.expert_parallel or not m.use_triton) for m in runner.model.modules()))

    def run(graph_runner):
        runner.graph_runner = graph_runner
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8))
        return [o.outputs[0].token_ids for o in outs]
    eager = run(GraphRunner(runner.model, runner.attn))
    sizes = [1, 2, 4, 8, 16]
    runner.input_batch = InputBatch(runner.max_step_tokens, 4, runner.max_model_len // runner.block_size,
                                    runner.block_size, runner.device, config.vocab_size, (max(sizes), 4))
    graphs = CUDAGraphRunner(runner.model, runner.attn, mode, sizes, max_num_seqs=4,
                             buffers=runner.input_batch.device_arrays, max_model_len=runner.max_model_len,
                             graph_cls=EagerGraph)
    graphs.capture()
    graphed = run(graphs)
    llm.shutdown()
    return {"kernel_errors": errs,
            "engine": {"hf": hf_greedy_tokens(path, prompts, 8), "eager": eager, "graphed": graphed,
                       "mode": mode.name, "replays": {m.name: n for m, n in graphs.replays.items()}}}


if __name__ == "__main__":
    print(json.dumps(_run(Path(sys.argv[1]))))
