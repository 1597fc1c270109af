"""Part 15 serves every family of the registry as HF runs it: greedy tokens equal to transformers'
over prompts five windows long, with chunked prefill (16-token steps), a prefix-cache hit and
speculative decoding; tensor parallelism over 2 processes for a dense family with windows and
soft-caps (Gemma 2) and an MoE family (Qwen3-MoE); int8 weights for Phi-3, whose fused projections
are split before they are quantized; prompt logprobs (the logits) within 1e-4 of HF's through the
paged backends. CUDA graphs of Gemma 2 and 3: tests/test_part15_cuda_graphs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import greedy, hf_greedy_tokens, pool_is_full, save_tiny
from model_families import FAMILIES, hf_model, save_families

PROMPTS = [list(range(3, 43)), [5, 9, 11], [7] * 3 + list(range(60, 90))]
N = 10


def hf_greedy(path: Path, prompts: list[list[int]], n: int = N) -> list[list[int]]:
    return hf_greedy_tokens(path, prompts, n, attn_implementation="eager")  # soft-caps need eager


def llm(path: Path, **kw):
    from part15_full import LLM

    kw = {"kv_cache_memory_mb": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4, **kw}
    return LLM(model=str(path), device="cpu", dtype="float32", **kw)


def run(m, prompts, n: int = N) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in m.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_families(tmp_path_factory.mktemp("families15"), seed=5)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_hf_with_chunked_prefill_and_a_prefix_hit(folders, name):
    path = folders[name]
    # Dynamic NTK is HF's up to the trained context: serve no longer than that.
    m = llm(path, max_model_len=512 if name == "llama-dynamic" else None)
    runner = m.engine.executor.runner
    windows = runner.model.config.layer_windows
    assert runner.attn.windows == windows
    assert run(m, PROMPTS) == hf_greedy(path, PROMPTS)
    # Two blocks of the first prompt again, then new tokens: the hit's blocks hold keys outside
    # the window of the tokens after them, which must not see them.
    stats = m.engine.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    again = [PROMPTS[0][:32] + [100, 101, 102, 103, 104, 105, 106]]
    assert run(m, again) == hf_greedy(path, again)
    assert stats.hits - hits == 32
    assert pool_is_full(m)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "qwen2-window"])
def test_prompt_logprobs_through_the_paged_backend_equal_hfs(folders, name):
    """Logits to 1e-4 through part 15's own path: the prompt scored in 16-token chunks, each chunk
    attending over the paged cache with its layers' windows (the CPU kernel; Gemma 2: the reference)."""
    from part15_full.sampling_params import SamplingParams

    path, ids = folders[name], PROMPTS[0]
    m = llm(path, enable_prefix_caching=False)
    out = m.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name,method", [("gemma3", "ngram"), ("mistral-window", "ngram"), ("gemma2", "draft_model")])
def test_speculative_decoding_keeps_the_windows(folders, name, method):
    """The verification rows are a multi-token query on a cached context, each row with its own
    window start; a self-draft of Gemma 2's first 2 layers scales and caps as its target does."""
    path = folders[name]
    prompts = [list(range(3, 23)) * 2, [9, 8, 7, 6] * 5]
    spec = dict(prompt_lookup_min=2, prompt_lookup_max=4) if method == "ngram" else dict(speculative_draft_layers=2)
    m = llm(path, speculative_method=method, num_speculative_tokens=3, **spec)
    assert run(m, prompts, 12) == hf_greedy(path, prompts, 12)
    assert m.engine.spec_decoding_stats.num_accepted_tokens > 0
    assert pool_is_full(m)


def qwen3_moe(path: Path) -> Path:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return save_tiny(path, config, seed=3, scale=0.3)


@pytest.mark.parametrize("name", ["gemma2", "qwen3-moe"])
def test_tensor_parallel_2_equals_hf(folders, tmp_path, name):
    path = qwen3_moe(tmp_path / name) if name == "qwen3-moe" else folders[name]
    ref = hf_greedy(path, PROMPTS)
    with llm(path, tensor_parallel_size=2) as m:
        procs = list(m.engine.executor.procs.values())
        assert run(m, PROMPTS) == ref
        assert pool_is_full(m)
    assert not any(p.is_alive() for p in procs)


def test_qwen3_moe_single_process_equals_hf(tmp_path):
    path = qwen3_moe(tmp_path / "q3moe")
    m = llm(path)
    assert type(m.engine.executor.runner.model).__name__ == "Qwen3ForCausalLM"
    assert run(m, PROMPTS) == hf_greedy(path, PROMPTS)


def int8_representable(path: Path) -> None:
    """Round every projection's weight to 255 levels per output row, as int8 per-channel quantization
    stores it, so that int8 loses nothing and must give HF's tokens on these weights."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, w in tensors.items():
        if w.dim() == 2 and "proj" in name:
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            tensors[name] = (w / scale).round().clamp(-127, 127) * scale
    save_file(tensors, file, metadata={"format": "pt"})


def test_int8_phi3_equals_hf_on_int8_representable_weights(folders, tmp_path):
    import shutil

    path = Path(shutil.copytree(folders["phi3"], tmp_path / "phi3-int8"))
    int8_representable(path)
    m = llm(path, quantization="int8")
    layer = m.engine.executor.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.wna16_bits == 8 and layer.mlp.gate_up_proj.wna16_bits == 8
    assert not hasattr(layer.self_attn.qkv_proj, "weight")
    assert run(m, PROMPTS) == hf_greedy(path, PROMPTS)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
