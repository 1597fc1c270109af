"""Part 15's torch.compile of the model (compilation.py), on a tiny random Llama: attention_op
compilation (attention left out of the graph) keeps HF's greedy tokens across prefill, chunked
prefill and batched decode (token counts that vary every step: one dynamic graph); the modes
resolve as documented; the compile time is recorded."""
from __future__ import annotations

import pytest
import torch

from conftest import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return save_tiny(tmp_path_factory.mktemp("tiny"), config, seed=7, scale=0.3)


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=config,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]


def test_the_model_compiled_with_attention_as_an_op_keeps_hf_greedy_tokens(tiny):
    from torch._dynamo.utils import counters

    from part15_full import LLM, SamplingParams

    counters.clear()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 17, 90)]
    want = hf_greedy(tiny, prompts, 12)
    # A small token budget chunks the longer prompts, so steps mix prefill chunks and decodes.
    llm = LLM(model=str(tiny), device="cpu", dtype="float32", kv_cache_memory_mb=8, compilation_mode="attention_op",
              max_num_batched_tokens=32, max_num_seqs=4)
    try:
        runner = llm.engine.executor.runner
        assert runner.compilation_mode == "attention_op"
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert runner.model.compile_seconds > 0  # the first step's compile, reported
        # Dynamo made graphs, and few: attention is one opaque op (no graph break), token counts are
        # dynamic (a count of 1 gets its own graph).
        assert 1 <= counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        llm.shutdown()


def test_modes_resolve_as_documented():
    from part15_full.config import resolve_compilation_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compilation_mode(None, False, cpu) == "none"  # measured no faster on CPU (notebook 15)
    assert resolve_compilation_mode(None, False, cuda) == "attention_op"
    assert resolve_compilation_mode("full", True, cuda) == "none"  # --enforce-eager wins
    assert resolve_compilation_mode("attention_op", False, cpu) == "attention_op"
    with pytest.raises(ValueError, match="compilation_mode"):
        resolve_compilation_mode("max-autotune", False, cpu)
