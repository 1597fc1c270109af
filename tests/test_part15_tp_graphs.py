"""Part 15's CUDA graphs under tensor parallelism: every rank captures the same FULL decode graphs
(the all-reduce inside them; PIECEWISE is lowered away, the split trace cannot hold it) and replays
them on the same steps. On the CPU, with gloo and VLLM_COURSE_GRAPH_STAND_IN=1 (each replay
recomputes its captured call, cuda_graph.EagerGraph), a TP 2 engine with graphs gives the greedy
tokens of the same engine without them and of HF.

Triton runs under TRITON_INTERPRET=1, set before triton is imported: the engines run in a child
process, this file run as a script, which prints one JSON line (the workers' logs go to stderr)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_interpreted_script


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_interpreted_script(__file__, tmp_path_factory.mktemp("tp_graphs"), VLLM_COURSE_GRAPH_STAND_IN="1")


def test_tensor_parallel_ranks_replay_full_decode_graphs_with_the_eager_tokens(results):
    assert results["graphed"] == results["eager"] == results["hf"]
    assert results["modes"] == {"eager": "NONE", "graphed": "FULL_DECODE_ONLY"}  # as the ranks resolved it


def _run(tmp: Path) -> dict:
    import torch
    import transformers

    from conftest import greedy, hf_greedy_tokens, save_tiny
    from part15_full import LLM

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = save_tiny(tmp / "llama", config, seed=5, scale=0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 9)]
    tokens, modes = {}, {}
    for name, graphs in (("eager", "NONE"), ("graphed", "FULL_AND_PIECEWISE")):
        with LLM(model=str(path), device="cpu", dtype="float32", use_triton=True, kv_cache_memory_mb=4,
                 max_num_seqs=2, max_num_batched_tokens=16, tensor_parallel_size=2,
                 compilation_config=json.dumps({"cudagraph_mode": graphs})) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            modes[name] = llm.engine.executor.cudagraph_mode.name
    return {**tokens, "hf": hf_greedy_tokens(path, prompts, 8), "modes": modes}


if __name__ == "__main__":
    print(json.dumps(_run(Path(sys.argv[1]))))
