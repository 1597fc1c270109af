"""Part 15's flat forward on a CPU (flat_forward.py): the modules' calls made from one loop, with
the same kernels in the same order, so the hidden states are the modules' own bit for bit (fp32 on
the GEMM kernel, a q/k/v bias, bf16, int8 weights); in the engine, tokens and logprobs equal to
the modules' path and to HF's greedy; the bound loop (BoundLayers) the same again, falling back to
the flat loop in a step it cannot run; and no flat forward where it does not apply (the switch, a
compiled model, MoE blocks)."""
from __future__ import annotations

import pytest
import torch
import transformers

import part15_full.flat_forward as flat_forward
from shared.attention import NoCacheAttention
from shared.forward_context import set_forward_context

from conftest import greedy, hf_greedy_tokens, save_tiny
from test_part15_cpu_gemm import runner

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def checkpoint(tmp_path, family="llama"):
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**COMMON)
    return save_tiny(tmp_path / family, config, seed=5, scale=0.3)


@pytest.mark.parametrize("family,kw", [("llama", dict(dtype="float32")), ("qwen2", dict(dtype="float32")),
                                       ("llama", dict(dtype="bfloat16")),
                                       ("llama", dict(dtype="float32", quantization="int8"))],
                         ids=["fp32", "fp32-qkv-bias", "bf16", "int8"])
def test_the_flat_forward_equals_the_modules_bit_for_bit(tmp_path, family, kw):
    r = runner(checkpoint(tmp_path, family), **kw)
    assert isinstance(r.flat_forward, flat_forward.FlatForward)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, COMMON["vocab_size"], (37,), generator=g)
    positions = torch.arange(37)
    with torch.no_grad(), set_forward_context(NoCacheAttention(r.model.config.head_dim ** -0.5)):
        modules, flat = r.model(ids, positions), r.flat_forward(ids, positions)
    assert flat.dtype == modules.dtype and torch.equal(flat, modules)


def test_the_elementwise_kernels_are_called_without_their_modules(tmp_path, monkeypatch):
    """The norms, the rotary embedding and SiLU go straight to their kernels (their forwards are
    not called), with the same bits; positions the kernel does not take (int32) still work."""
    from part15_full.cpu_ops import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul

    r = runner(checkpoint(tmp_path))
    ids, positions = torch.randint(0, COMMON["vocab_size"], (9,), generator=torch.Generator().manual_seed(1)), \
        torch.arange(9)
    with torch.no_grad(), set_forward_context(NoCacheAttention(r.model.config.head_dim ** -0.5)):
        modules, modules_int32 = r.model(ids, positions), r.model(ids, positions.int())
        with monkeypatch.context() as m:
            for cls in (CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul):
                m.setattr(cls, "forward", lambda *a, **k: pytest.fail("a module's forward was called"))
            flat = r.flat_forward(ids, positions)
        flat_int32 = r.flat_forward(ids, positions.int())  # the rotary module's own (torch) path
    assert torch.equal(flat, modules) and torch.equal(flat_int32, modules_int32)


def test_the_mlp_ends_its_gate_up_gemm_with_the_activation(tmp_path, monkeypatch):
    """On the GEMM kernel (forced on, whatever the build) the gate/up weight is packed gated and each
    layer's MLP input is one GEMM whose last step is SiLU: the activation's kernel is not called,
    and the hidden states are the modules' bit for bit (gate/up, then silu_and_mul)."""
    import part15_full.cpu_gemm as cpu_gemm
    from part15_full.cpu_ops import CpuSiluAndMul

    monkeypatch.setattr(cpu_gemm, "SWITCH", "1")
    cpu_gemm.load_gemm.cache_clear()
    try:
        r = runner(checkpoint(tmp_path))
    finally:
        cpu_gemm.load_gemm.cache_clear()
    assert all(layer.mlp.gate_up_proj.gemm_gated and not layer.mlp.down_proj.gemm_gated
               and not layer.self_attn.qkv_proj.gemm_gated for layer in r.model.layers)
    fused, real = [], flat_forward.gemm_gated
    monkeypatch.setattr(flat_forward, "gemm_gated", lambda *a: fused.append(a[-1]) or real(*a))
    ids = torch.randint(0, COMMON["vocab_size"], (23,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), set_forward_context(NoCacheAttention(r.model.config.head_dim ** -0.5)):
        modules = r.model(ids, torch.arange(23))
        with monkeypatch.context() as m:
            m.setattr(CpuSiluAndMul, "forward", lambda *a, **k: pytest.fail("the activation was called"))
            flat = r.flat_forward(ids, torch.arange(23))
    assert fused == [True] * len(r.model.layers)
    assert torch.equal(flat, modules)


def test_the_engine_keeps_its_tokens_logprobs_and_hf_greedy(tmp_path, monkeypatch):
    """One continuous batch (prefills beside decodes) through the paged attention kernel, with the
    flat forward and without it: the same tokens and the same logprobs, bit for bit, and HF's
    greedy continuation."""
    from part15_full import LLM

    path = checkpoint(tmp_path)
    prompts = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 50)), [7] * 20]
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(flat_forward, "ENABLED", enabled)
        with LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4) as engine:
            assert (engine.engine.executor.runner.flat_forward is not None) == enabled
            outs = engine.generate(prompts, greedy(12, logprobs=2))
        results[enabled] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    assert [tokens for tokens, _ in results[True]] == hf_greedy_tokens(path, prompts, 12)


def test_no_flat_forward_where_it_does_not_apply(tmp_path, monkeypatch):
    path = checkpoint(tmp_path)
    assert runner(path, compilation_mode="piecewise").flat_forward is None  # the compiled forward stays
    mixtral = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    assert runner(save_tiny(tmp_path / "mixtral", mixtral, seed=3)).flat_forward is None  # MoE blocks
    monkeypatch.setattr(flat_forward, "ENABLED", False)  # VLLM_COURSE_FLAT_FORWARD=0
    assert runner(path).flat_forward is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bound_loop_keeps_the_bits_and_skips_the_wrappers(tmp_path, monkeypatch, dtype):
    """On the GEMM kernel (in bf16: the AMX one), a step whose calls are all C kernels runs
    BoundLayers (ctypes calls on integers, no Python wrappers): the same tokens and logprobs, bit
    for bit, as FlatForward's loop and as the modules, and (fp32) HF's greedy. A step with a long
    fresh prefill (SDPA's, here from 17 tokens) falls back to FlatForward's loop, in the same run."""
    import part15_full.cpu_attention as cpu_attention
    import part15_full.cpu_gemm as cpu_gemm
    from part15_full import LLM

    if dtype == "bfloat16" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("bf16 runs the bound loop on the AMX GEMM only: this CPU has no AMX")
    monkeypatch.setattr(cpu_gemm, "SWITCH", "1")
    monkeypatch.setattr(cpu_attention, "PREFILL_MAX_LEN", {torch.float32: 16, torch.bfloat16: 16})
    path = checkpoint(tmp_path, "qwen2")  # with a q/k/v bias
    prompts = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 50)), [7] * 12]
    results, served, wrapped = {}, [], []
    real_call, real_attention = flat_forward.BoundLayers.__call__, cpu_attention.CpuPagedAttention.forward
    monkeypatch.setattr(flat_forward.BoundLayers, "__call__", lambda self, *a: _record(served, real_call(self, *a)))
    monkeypatch.setattr(cpu_attention.CpuPagedAttention, "forward",
                        lambda self, *a: wrapped.append(1) or real_attention(self, *a))
    cpu_gemm.load_gemm.cache_clear()
    try:
        for mode in ("bound", "flat", "modules"):
            monkeypatch.setattr(flat_forward, "BOUND", mode == "bound")
            monkeypatch.setattr(flat_forward, "ENABLED", mode != "modules")
            served.clear(), wrapped.clear()
            with LLM(model=str(path), device="cpu", dtype=dtype, kv_cache_memory_mb=4) as engine:
                runner_ = engine.engine.executor.runner
                flat = runner_.flat_forward
                assert (flat is not None and flat.bound is not None) == (mode == "bound")
                outs = engine.generate(prompts, greedy(10, logprobs=2))
            results[mode] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
            if mode == "bound":  # every step but the long prefill's; the wrapper only in that one
                assert served.count(False) >= 1 and served.count(True) >= 9
                assert len(wrapped) == served.count(False) * COMMON["num_hidden_layers"]
    finally:
        cpu_gemm.load_gemm.cache_clear()
    assert results["bound"] == results["flat"] == results["modules"]
    if dtype == "float32":  # bf16 is held to the fp32 oracle with bf16 tolerances (test_part15_cpu_ops.py)
        assert [tokens for tokens, _ in results["bound"]] == hf_greedy_tokens(path, prompts, 10)


def _record(log, out):
    log.append(out is not None)
    return out
