"""Part 15's fused CPU kernels for the decoder's elementwise work (RMSNorm with the residual add,
the rotary embedding, SiLU x up) against float64 references of the maths and the shared torch
layers; their in-place contract, the torch fallback for what they do not take, the factory that puts
them in the model (also under a wrapping factory), the engine using them and the off-switch. The
engine's greedy parity with HF through them is tests/test_parity.py (part 15 runs them on CPU)."""
from __future__ import annotations

import platform

import pytest
import torch

import part15_full.cpu.build as cpu_build
import part15_full.cpu.layers as cpu_ops
from part15_full.cpu.kernels import CSRC, bind
from part15_full.cpu.layers import CpuLayers, CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from shared.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from shared.model import LayerFactory, WrappedLayers
from shared.weights import load_model

from conftest import save_tiny
from test_layer_seam import logits, tiny_checkpoint

EPS = 1e-5


@pytest.fixture(scope="module")
def ops():
    lib = cpu_ops.load_ops()
    assert lib is not None, "no C compiler here? the set-up installs none; cc must be on PATH"
    return lib


def rms_ref(x, w, eps=EPS):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norms(hidden, ops, seed=0):
    g = torch.Generator().manual_seed(seed)
    ours, torch_layer = CpuRMSNorm(hidden, EPS, ops), RMSNorm(hidden, EPS)
    w = torch.randn(hidden, generator=g)
    ours.weight.data.copy_(w)
    torch_layer.weight.data.copy_(w)
    return ours, torch_layer, g


# 1 row, a decode step's rows, rows enough for the threaded path; a width off the 16-wide lanes.
@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 576), (300, 576), (5, 37)])
def test_rms_norm_and_fused_add_match_float64_and_the_torch_layer(ops, rows, hidden):
    ours, torch_layer, g = norms(hidden, ops)
    x = torch.randn(rows, hidden, generator=g) * 3
    residual = torch.randn(rows, hidden, generator=g)
    torch.testing.assert_close(ours(x).double(), rms_ref(x, ours.weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x), torch_layer(x), atol=1e-5, rtol=1e-5)

    want_out, want_res = torch_layer(x, residual)
    xs, rs = x.clone(), residual.clone()
    got_out, got_res = ours(xs, rs)
    assert got_out is xs and got_res is rs  # in place, as the decoder layer uses it
    torch.testing.assert_close(got_res, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(got_out.double(), rms_ref(x + residual, ours.weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)


def test_the_norm_without_residual_leaves_its_input_alone(ops):
    """The first layer keeps the embedding as its residual: normalising it in place would change it."""
    ours, _, g = norms(64, ops)
    x = torch.randn(4, 64, generator=g)
    before = x.clone()
    out = ours(x)
    assert out.data_ptr() != x.data_ptr() and torch.equal(x, before)


def rotary_ref(positions, x, layer):
    """The rotation written from its definition, in float64: pairs (i, i + D/2) turned by the
    angle pos * theta_i, whose cos and sin are the layer's table (fp32 angles: the table's own
    rounding, which the torch layer shares, is not what is tested here)."""
    d = x.shape[-1]
    cos, sin = layer.cos[positions, : d // 2].double()[:, None], layer.sin[positions, : d // 2].double()[:, None]
    x = x.double()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (33, 9, 3, 64), (200, 8, 2, 128)])
def test_rotary_rotates_the_qkv_views_in_place(ops, tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    ours = CpuRotaryEmbedding(RotaryEmbedding(head_dim, 4096, 10000.0), ops)
    torch_layer = RotaryEmbedding(head_dim, 4096, 10000.0)
    # q, k as the model makes them: views into one fused projection's rows, v after them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 4096, (tokens,), generator=g)

    def views(t):
        q = t[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = t[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        return q, k
    want_q, want_k = torch_layer(positions, *views(qkv))
    original = qkv.clone()
    got_q, got_k = ours(positions, *views(qkv))
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(got_q.double(), rotary_ref(positions, views(original)[0], ours), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k.double(), rotary_ref(positions, views(original)[1], ours), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v], original[:, v])  # v untouched


def test_a_position_outside_the_table_raises_and_changes_nothing(ops):
    ours = CpuRotaryEmbedding(RotaryEmbedding(8, 16, 10000.0), ops)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(IndexError, match="outside the rotary table"):
        ours(torch.tensor([0, 5, 16]), q, k)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (3, 37)])
def test_silu_and_mul_matches_float64_over_the_whole_range(ops, rows, inter):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 2 * inter, generator=g) * 20
    x[0, :8] = torch.tensor([0.0, -0.0, 87.5, -87.5, 100.0, -100.0, 1e4, -1e4])  # exp's clamps
    gate, up = x.double().chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    got = CpuSiluAndMul(ops)(x)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got.double(), want, atol=1e-30, rtol=1e-6)
    torch.testing.assert_close(got, SiluAndMul()(x), atol=1e-6, rtol=1e-6)


def test_what_the_kernels_do_not_take_goes_to_the_torch_layers(ops):
    """fp16, a weight of another dtype, or rows that are not contiguous: the shared layer's own
    forward, same results."""
    ours, torch_layer, g = norms(64, ops)
    x = torch.randn(4, 64, generator=g).to(torch.float16)
    ours.weight.data = ours.weight.data.to(torch.float16)
    torch_layer.weight.data = torch_layer.weight.data.to(torch.float16)
    assert torch.equal(ours(x), torch_layer(x))
    assert torch.equal(ours(x.float()), torch_layer(x.float()))  # fp32 rows, an fp16 weight
    wide = torch.randn(4, 128, generator=g)
    strided = wide[:, ::2]
    ours32, torch32, _ = norms(64, ops)
    r1 = torch.randn(4, 64)
    r2 = r1.clone()
    got, got_res = ours32(strided, r1)
    want, want_res = torch32(strided, r2)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert torch.equal(CpuSiluAndMul(ops)(wide[:, ::2]), SiluAndMul()(wide[:, ::2]))
    q, k = torch.randn(3, 4, 8).transpose(0, 1), torch.randn(4, 1, 8)  # heads not side by side
    rot, rot_ref = CpuRotaryEmbedding(RotaryEmbedding(8, 16, 10000.0), ops), RotaryEmbedding(8, 16, 10000.0)
    pos = torch.tensor([1, 2, 3, 4])
    assert all(torch.equal(a, b) for a, b in zip(rot(pos, q, k), rot_ref(pos, q, k)))


# bf16: the kernels widen each element to fp32, compute, and round once where they store, so an
# output is within half a bf16 step (at most 2^-8 of its size) of the float64 maths on the same
# bf16 inputs. The torch layers round after every op: about a step from the kernels.
BF16_STEP = dict(rtol=2 ** -8, atol=1e-6)


def bf16(*shape, generator, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 576), (300, 576), (5, 37)])
def test_bf16_norms_round_once_and_the_residual_is_torchs_sum(ops, rows, hidden):
    g = torch.Generator().manual_seed(4)
    ours, torch_layer = CpuRMSNorm(hidden, EPS, ops), RMSNorm(hidden, EPS)
    w = bf16(hidden, generator=g)
    ours.weight.data, torch_layer.weight.data = w.clone(), w.clone()
    x, residual = bf16(rows, hidden, generator=g, scale=3), bf16(rows, hidden, generator=g)
    got = ours(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), rms_ref(x, w), **BF16_STEP)
    torch.testing.assert_close(got, torch_layer(x), rtol=2 ** -6, atol=1e-2)

    xs, rs = x.clone(), residual.clone()
    got_out, got_res = ours(xs, rs)
    assert got_out is xs and got_res is rs
    assert torch.equal(got_res, x + residual)  # torch's bf16 add: the exact sum, rounded once
    torch.testing.assert_close(got_out.double(), rms_ref(got_res, w), **BF16_STEP)
    want_out, _ = torch_layer(x, residual)
    torch.testing.assert_close(got_out, want_out, rtol=2 ** -6, atol=1e-2)


def test_bf16_rounding_is_to_nearest_even_and_keeps_inf_and_nan(ops):
    """The residual add's sums, chosen to fall exactly between two bf16 numbers (ties go to the
    even one), just past a tie, past the largest bf16 (inf), and NaN: torch's own rounding."""
    ours = CpuRMSNorm(8, EPS, ops)
    ours.weight.data = torch.ones(8, dtype=torch.bfloat16)
    residual = torch.tensor([[1.0, 1.0, 1.0 + 2 ** -7, 1.0, 3e38, -3e38, float("nan"), float("inf")]])
    x = torch.tensor([[2 ** -8, 3 * 2 ** -8, 2 ** -8, 2 ** -8 + 2 ** -12, 3e38, -3e38, 1.0, 1.0]])
    want = residual.to(torch.bfloat16) + x.to(torch.bfloat16)
    _, got = ours(x.to(torch.bfloat16), residual.to(torch.bfloat16))
    assert torch.equal(got.float().isnan(), want.float().isnan())
    ok = ~want.float().isnan()
    assert torch.equal(got.float()[ok], want.float()[ok]), (got, want)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (33, 9, 3, 64), (200, 8, 2, 128)])
def test_bf16_rotary_rotates_in_place_within_one_rounding(ops, tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(5)
    ours = CpuRotaryEmbedding(RotaryEmbedding(head_dim, 4096, 10000.0), ops)
    qkv = bf16(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    want_q, want_k = rotary_ref(positions, q, ours), rotary_ref(positions, k, ours)
    want_torch = RotaryEmbedding(head_dim, 4096, 10000.0)(positions, q.clone(), k.clone())
    got_q, got_k = ours(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr() and got_q.dtype == torch.bfloat16
    torch.testing.assert_close(got_q.double(), want_q, rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(got_k.double(), want_k, rtol=2 ** -8, atol=1e-5)
    for got, want in zip((got_q, got_k), want_torch):  # torch's: cos/sin in bf16, three roundings
        torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2e-2)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (3, 37)])
def test_bf16_silu_and_mul_within_one_rounding(ops, rows, inter):
    g = torch.Generator().manual_seed(6)
    x = bf16(rows, 2 * inter, generator=g, scale=6)
    gate, up = x.double().chunk(2, -1)
    got = CpuSiluAndMul(ops)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate) * up, rtol=2 ** -8, atol=1e-30)
    torch.testing.assert_close(got, SiluAndMul()(x), rtol=2 ** -6, atol=1e-2)


class Renamed(WrappedLayers):
    """A wrapping factory that changes nothing (as MoELayers wraps the part's factory)."""


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "under_a_wrapper"])
def test_the_factory_puts_every_elementwise_layer_on_the_kernels(ops, tmp_path, wrapped):
    path = tiny_checkpoint(tmp_path)
    layers = CpuLayers(LayerFactory(), ops)
    model = load_model(path, torch.device("cpu"), torch.float32, layers=Renamed(layers) if wrapped else layers)
    kinds = {type(m) for m in model.modules()}
    assert {CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul} <= kinds
    assert not kinds & {RMSNorm, RotaryEmbedding, SiluAndMul}  # exact classes: none left in torch
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    dense = load_model(path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(logits(model, ids), logits(dense, ids), atol=1e-4, rtol=1e-4)


def test_the_engine_runs_them_on_cpu_and_the_off_switch_removes_them(monkeypatch, tmp_path):
    from part15_full.model_runner import ModelRunner
    from part15_full.config import EngineConfig

    path = tiny_checkpoint(tmp_path)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4)
    runner = ModelRunner(config)
    assert any(isinstance(m, CpuRMSNorm) for m in runner.model.modules())
    monkeypatch.setenv("VLLM_COURSE_CPU_FUSED_OPS", "0")
    assert cpu_ops.load_ops() is None
    runner = ModelRunner(config)
    assert not any(isinstance(m, (CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul)) for m in runner.model.modules())


def test_the_engine_in_bf16_tracks_the_fp32_oracle(prompt_token_ids, fp32_oracle):
    """Part 15 in bf16 on the CPU, held to the fp32 oracle with the bf16 tolerances the GPU tier
    holds every part to on CUDA: through the bf16 kernels (attention, norm, rotary, SiLU), and with
    the weights packed for the AMX kernel where the CPU has AMX (cpu/gemm.py), else prepacked for
    oneDNN where it has native bf16."""
    from part15_full import LLM
    from part15_full.cpu.attention import CpuAttention
    from part15_full.cpu.gemm import load_amx
    from shared.layers import Linear, cpu_has_native_bf16

    from conftest import assert_bf16_greedy_tracks, assert_bf16_teacher_forced

    with LLM(device="cpu", dtype="bfloat16", kv_cache_memory_mb=128) as llm:
        runner = llm.engine.executor.runner
        kinds = {type(m) for m in runner.model.modules()}
        assert {CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul} <= kinds
        assert isinstance(runner.attn, CpuAttention)
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        amx, native = load_amx() is not None, cpu_has_native_bf16()
        assert all((getattr(m, "gemm_weight", None) is not None) == amx for m in linears)
        assert all((m.packed_weight is not None) == (native and not amx) for m in linears)
        assert_bf16_teacher_forced(llm, prompt_token_ids, fp32_oracle)
        assert_bf16_greedy_tracks(llm, prompt_token_ids, fp32_oracle)


def test_a_build_without_openmp_or_march_gives_the_same_results(ops, tmp_path, monkeypatch):
    """A plainer compiler line (the set-up's last fallback): one thread, no AVX, same maths."""
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_FLAG_SETS", (["-O2"],))
    plain = cpu_ops.by_dtype(bind("fused_ops_cpu.c", cpu_build.build(CSRC / "fused_ops_cpu.c")))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2 * 96, generator=g) * 5  # over the threaded path's threshold
    torch.testing.assert_close(CpuSiluAndMul(plain)(x), CpuSiluAndMul(ops)(x), atol=1e-6, rtol=1e-6)
    a, _, _ = norms(192, plain)
    b, _, _ = norms(192, ops)
    torch.testing.assert_close(a(x), b(x), atol=1e-5, rtol=1e-5)


def test_the_wide_vectors_switch_is_a_build_of_its_own_with_the_same_maths(ops, tmp_path, monkeypatch):
    """VLLM_COURSE_CPU_WIDE_VECTORS=0 leaves GCC's own vector width: the flags are in the build's
    cache key, so each setting gets its own library, and both compute the same SiLU and norm (to
    float rounding: another vector width may contract other multiply-adds)."""
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    builds = {}
    for wide in ("1", "0"):
        monkeypatch.setenv("VLLM_COURSE_CPU_WIDE_VECTORS", wide)
        builds[wide] = cpu_build.build(CSRC / "fused_ops_cpu.c")
    assert builds["1"] is not None and builds["0"] is not None
    # Only x86 compilers get the flag: elsewhere both settings are the same build.
    assert (builds["1"] != builds["0"]) == (platform.machine().lower() in ("x86_64", "amd64"))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 2 * 1536, generator=g) * 5
    wide, narrow = (cpu_ops.by_dtype(bind("fused_ops_cpu.c", builds[w])) for w in "10")
    torch.testing.assert_close(CpuSiluAndMul(wide)(x), CpuSiluAndMul(narrow)(x), atol=1e-6, rtol=1e-6)
    a, _, _ = norms(576, wide)
    b, _, _ = norms(576, narrow)
    torch.testing.assert_close(a(x[:, :576]), b(x[:, :576]), atol=1e-5, rtol=1e-5)


def test_a_compiler_that_refuses_the_wide_flag_still_builds_with_openmp(tmp_path, monkeypatch):
    """The 512-bit preference is an extra: a compiler that does not know it gets the same line
    without it, not the plain -O2 fallback (which has no OpenMP and no -march)."""
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    run, tried = cpu_build._compile, []

    def refuse_the_flag(cmd):
        tried.append(cmd)
        if "-mprefer-vector-width=512" in cmd:
            return cpu_build.subprocess.CompletedProcess(cmd, 1, "", "unrecognized command-line option")
        return run(cmd)
    monkeypatch.setattr(cpu_build, "_compile", refuse_the_flag)
    assert cpu_build.build(CSRC / "fused_ops_cpu.c") is not None
    assert "-fopenmp" in tried[-1] and "-march=native" in tried[-1]
    assert "-mprefer-vector-width=512" not in tried[-1]


def test_an_moe_model_on_the_kernels_keeps_hf_greedy(tmp_path):
    """Qwen2-MoE: the MoE factory wraps the kernels' factory; a dense layer and the shared expert
    build their MLPs through it."""
    import transformers
    from part15_full import LLM

    from conftest import greedy, hf_greedy_tokens
    from test_part11_ep import CONFIGS, PROMPTS

    cls, kw = CONFIGS["qwen2_moe"]
    path = save_tiny(tmp_path / "qwen2_moe", getattr(transformers, cls)(**kw), seed=3, scale=0.3)
    from part15_full.config import EngineConfig
    from part15_full.model_runner import ModelRunner

    model = ModelRunner(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4)).model
    assert isinstance(model.layers[1].mlp.act, CpuSiluAndMul)  # the dense layer
    assert isinstance(model.layers[0].mlp.shared_expert.act, CpuSiluAndMul)
    with LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4) as engine:
        got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy(12))]
    assert [list(t) for t in got] == hf_greedy_tokens(path, PROMPTS, 12)


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """The cache key holds the headers beside the source: a reader's edit to vec_math.h rebuilds."""
    import shutil

    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path / "cache"))
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_build.CSRC, csrc)
    first = cpu_build.build(csrc / "fused_ops_cpu.c")
    assert first is not None and cpu_build.build(csrc / "fused_ops_cpu.c") == first
    header = csrc / "vec_math.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    second = cpu_build.build(csrc / "fused_ops_cpu.c")
    assert second is not None and second != first
