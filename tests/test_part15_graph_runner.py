"""Part 15's runner seam (graph_runner.py) and its CPU implementation (cpu/graph_runner.py): a step
replayed as one loop of the C kernels, the weights bound at capture, gives the modules' hidden
states bit for bit (fp32 on the GEMM kernel, a q/k/v bias, bf16, int8 weights; prefills, decodes
and a long prefill's SDPA in one batch); the profiler names each kernel; in the engine, tokens and
logprobs equal to the modules' and HF's greedy; and the eager runner where the CPU one does not
apply (the switch, a compiled model, MoE blocks)."""
from __future__ import annotations

import pytest
import torch
import transformers

import part15_full.cpu.attention as cpu_attention
from part15_full.attention_metadata import PagedAttentionMetadata
from part15_full.cpu.graph_runner import CpuGraphRunner
from part15_full.graph_runner import GraphRunner

from conftest import greedy, hf_greedy_tokens, save_tiny
from test_part15_cpu_gemm import runner

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def checkpoint(tmp_path, family="llama"):
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**COMMON)
    return save_tiny(tmp_path / family, config, seed=5, scale=0.3)


def steps(block_size):
    """Two engine-like steps: a 37-token prefill beside a 5-token one, then a decode of each."""
    tables = [[1, 2, 3], [4]]
    yield PagedAttentionMetadata.build(tables, [37, 5], [37, 5], block_size), list(range(37)) + list(range(5))
    yield PagedAttentionMetadata.build(tables, [38, 6], [1, 1], block_size), [37, 5]


def assert_replays_the_modules(r, monkeypatch=None):
    """Each step through the CPU runner and through the eager one: the same bits."""
    assert isinstance(r.graph_runner, CpuGraphRunner)
    eager = GraphRunner(r.model, r.attn)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for metadata, positions in steps(r.block_size):
            ids = torch.randint(0, COMMON["vocab_size"], (len(positions),), generator=g)
            positions = torch.tensor(positions)
            modules = eager(ids, positions, metadata)  # both store the same K/V in the same slots
            replayed = r.graph_runner(ids, positions, metadata)
            assert replayed.dtype == modules.dtype and torch.equal(replayed, modules)


@pytest.mark.parametrize("family,kw", [("llama", dict(dtype="float32")), ("qwen2", dict(dtype="float32")),
                                       ("llama", dict(dtype="bfloat16")),
                                       ("llama", dict(dtype="float32", quantization="int8"))],
                         ids=["fp32", "fp32-qkv-bias", "bf16", "int8"])
def test_the_cpu_runner_replays_the_modules_bit_for_bit(tmp_path, family, kw):
    assert_replays_the_modules(runner(checkpoint(tmp_path, family), **kw))


def test_a_long_prefill_goes_through_sdpa_inside_the_replayed_step(tmp_path, monkeypatch):
    """A fresh prefill past PREFILL_MAX_LEN (here 16 tokens) takes attention's gather + SDPA, in the
    same replayed step as the kernel's rows."""
    monkeypatch.setattr(cpu_attention, "PREFILL_MAX_LEN", {torch.float32: 16, torch.bfloat16: 16})
    r = runner(checkpoint(tmp_path))
    plan = r.attn.plan(next(steps(r.block_size))[0])
    assert len(plan.long) == 1 and plan.row_idx.numel() == 5
    assert_replays_the_modules(r)


def test_the_profiler_names_each_kernel_and_the_mlp_ends_its_gemm_with_the_activation(tmp_path, monkeypatch):
    """On the fp32 GEMM kernel (forced on, whatever the build) a replayed step is the C kernels alone,
    each under its name in the profiler's trace (kernels.py); the gate/up weight is packed gated and
    each layer's MLP input is one GEMM whose last step is SiLU: the activation's kernel is not called."""
    monkeypatch.setenv("VLLM_COURSE_CPU_GEMM", "1")
    r = runner(checkpoint(tmp_path))
    assert all(layer.mlp.gate_up_proj.gemm_gated and not layer.mlp.down_proj.gemm_gated
               and not layer.self_attn.qkv_proj.gemm_gated for layer in r.model.layers)
    metadata, positions = next(steps(r.block_size))
    ids = torch.arange(len(positions)) % COMMON["vocab_size"]
    with torch.no_grad(), torch.profiler.profile() as prof:
        r.graph_runner(ids, torch.tensor(positions), metadata)
    names = [e.name for e in prof.events()]
    layers = COMMON["num_hidden_layers"]
    assert names.count("gemm_gated") == layers and names.count("gemm") == 3 * layers
    assert names.count("paged_attention_rows") == names.count("store_kv") == layers
    assert names.count("rotary_embedding") == layers and names.count("rms_norm") == 1
    assert names.count("fused_add_rms_norm") == 2 * layers  # (the first layer's input norm is rms_norm; the final norm)
    assert "silu_and_mul" not in names and "aten::linear" not in names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_keeps_its_tokens_logprobs_and_hf_greedy(tmp_path, monkeypatch, dtype):
    """One continuous batch (prefills beside decodes, a long prefill through SDPA) with the CPU runner
    and with the modules (VLLM_COURSE_CPU_RUNNER=0): the same tokens and the same logprobs, bit for
    bit, and (fp32) HF's greedy continuation. bf16 is held to the fp32 oracle with bf16 tolerances
    (test_part15_cpu_ops.py)."""
    from part15_full import LLM

    monkeypatch.setattr(cpu_attention, "PREFILL_MAX_LEN", {torch.float32: 16, torch.bfloat16: 16})
    path = checkpoint(tmp_path, "qwen2")  # with a q/k/v bias
    prompts = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 50)), [7] * 20]
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv("VLLM_COURSE_CPU_RUNNER", on)
        with LLM(model=str(path), device="cpu", dtype=dtype, kv_cache_memory_mb=4) as engine:
            assert isinstance(engine.engine.executor.runner.graph_runner, CpuGraphRunner) == (on == "1")
            outs = engine.generate(prompts, greedy(12, logprobs=2))
        results[on] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    assert results["1"] == results["0"]
    if dtype == "float32":
        assert [tokens for tokens, _ in results["1"]] == hf_greedy_tokens(path, prompts, 12)


def test_the_eager_runner_where_the_cpu_one_does_not_apply(tmp_path, monkeypatch):
    from part15_full.model_runner import ModelRunner

    path = checkpoint(tmp_path)
    with monkeypatch.context() as m:  # the runner is chosen before any step: no warm-up compiles here
        m.setattr(ModelRunner, "_warm_up", lambda self: None)
        assert type(runner(path, compilation_mode="attention_op").graph_runner) is GraphRunner  # compiled forward
    mixtral = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    assert type(runner(save_tiny(tmp_path / "mixtral", mixtral, seed=3)).graph_runner) is GraphRunner  # MoE
    monkeypatch.setenv("VLLM_COURSE_CPU_ATTENTION", "0")  # the torch reference attention
    assert type(runner(path).graph_runner) is GraphRunner
    monkeypatch.setenv("VLLM_COURSE_CPU_ATTENTION", "1")
    monkeypatch.setenv("VLLM_COURSE_CPU_RUNNER", "0")
    assert type(runner(path).graph_runner) is GraphRunner
