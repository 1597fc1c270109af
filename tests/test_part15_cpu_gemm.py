"""Part 15's fp32 GEMM kernel for the CPU (cpu/csrc/gemm_cpu.c, cpu/gemm.py): each output within the
rounding error bound of a K-term sum, whatever the shape (off the kernel's row blocks and column
panels, chunked rows, a bias); a row's result the same bit for bit alone, with other rows or on
one thread; the AVX2 and plain builds; the engine putting every linear layer on it, keeping HF's
greedy tokens (a bias too), and what it leaves to oneDNN (bf16 without AMX, quantized weights, the switch)."""
from __future__ import annotations

import pytest
import torch

import part15_full.cpu.build as cpu_build
import part15_full.cpu.gemm as cpu_gemm
from part15_full.cpu.gemm import CpuUnquantizedLinearMethod
from part15_full.cpu.kernels import CSRC, bind
from shared.layers import Linear, UnquantizedLinearMethod
from shared.weights import load_model

from conftest import greedy, hf_greedy_tokens, save_tiny
from test_layer_seam import logits, tiny_checkpoint

U = 2.0 ** -24  # fp32's unit roundoff
SOURCE = CSRC / "gemm_cpu.c"


@pytest.fixture(scope="module")
def lib():
    built = cpu_build.build(SOURCE)
    assert built is not None, "no C compiler here? the set-up installs none; cc must be on PATH"
    return bind("gemm_cpu.c", built)


def run(lib, x, w, bias=None, threads=None):
    packed = cpu_gemm.pack_weight(lib, w)
    if threads is None:
        return cpu_gemm.gemm(lib, x, packed, w.shape[0], bias)
    out = torch.empty(x.shape[0], w.shape[0])
    lib.gemm(x.shape[0], w.shape[0], x.shape[1], x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(),
             w.shape[0], None if bias is None else bias.data_ptr(), threads)
    return out


def assert_within_bound(got, x, w, bias=None, out_roundoff=0.0):
    """|got - exact| <= gamma_{K+1} (|x| |w|^T + |b|) per element: the bound of any order of a
    (K+1)-term fp32 sum (Higham, 3.1), so it cannot fail by luck, and a wrong product breaks it.
    With `out_roundoff` (a narrower output type's unit roundoff, as bf16's for the AMX kernel) the
    output may be one rounding further off, out_roundoff of its size."""
    k = x.shape[1] + 1
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    sum_err = k * U / (1 - k * U) * scale
    excess = (got.double() - exact).abs() - (sum_err + out_roundoff * (exact.abs() + sum_err))
    assert excess.max().item() <= 0, excess.max().item()


# Rows: one; a decode step's (not a multiple of the row block); rows over a chunk (K=1536 chunks
# at 84 rows). Columns: under one panel, off the panel width, a model's. K: odd, small, a model's.
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 7, True), (25, 96, 576, False), (37, 100, 33, True),
                                        (300, 960, 576, False), (200, 70, 1536, True)])
def test_the_kernel_is_within_the_rounding_bound_of_the_exact_product(lib, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 7 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = run(lib, x, w, b)
    assert got.shape == (m, n)
    assert_within_bound(got, x, w, b)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(lib):
    """Every output is summed in one order (k = 0..K-1), whatever the row count, the blocks and
    chunks rows are cut into, or the thread a panel lands on."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(200, 1536, generator=g), torch.randn(160, 1536, generator=g), torch.randn(160, generator=g)
    full = run(lib, x, w, b)
    for rows in (1, 5, 13, 14, 15, 29, 85, 199):  # around the row blocks (14 on AVX-512) and chunks
        assert torch.equal(run(lib, x[:rows], w, b), full[:rows]), rows
        assert torch.equal(run(lib, x[rows - 1:rows], w, b), full[rows - 1:rows]), rows
    assert torch.equal(run(lib, x, w, b, threads=1), full)
    assert torch.equal(run(lib, x, w, b, threads=2), full)


def test_strided_and_batched_inputs_and_no_rows(lib):
    g = torch.Generator().manual_seed(2)
    wide, w = torch.randn(9, 80, generator=g), torch.randn(33, 64, generator=g)
    x = wide[:, :64]  # rows 80 floats apart
    assert torch.equal(run(lib, x, w), run(lib, x.contiguous(), w))
    x3 = torch.randn(2, 5, 64, generator=g)
    assert torch.equal(run(lib, x3, w), run(lib, x3.reshape(10, 64), w).view(2, 5, 33))
    assert run(lib, torch.empty(0, 64), w).shape == (0, 33)


def gated(lib, x, w, silu):
    return cpu_gemm.gemm_gated(lib, x, cpu_gemm.pack_weight_gated(lib, w), w.shape[0] // 2, silu)


@pytest.mark.parametrize("inter", [40, 96])  # off the vector width (2.5 of 16), and a whole number of them
def test_the_gated_packing_gives_the_plain_bits_and_its_activation_silu_and_muls(lib, inter):
    """The MLP's gate/up weight packed gate column beside up column: gate | up the same bits as the
    plain packing, at any row count; with the activation as the GEMM's last step, the bits
    fused_ops_cpu.c's silu_and_mul gives on them (so the flat forward keeps the modules' bits)."""
    from part15_full.cpu.layers import load_ops

    g = torch.Generator().manual_seed(inter)
    x, w = 3 * torch.randn(130, 200, generator=g), torch.randn(2 * inter, 200, generator=g)  # gates up to ~+-150
    plain = run(lib, x, w)
    for rows in (1, 14, 15, 31, 130):  # 130: threads take rows, not panels (gemm_cpu.c's SPLIT_ROWS)
        assert torch.equal(gated(lib, x[:rows], w, False), plain[:rows]), rows
    act = torch.empty(130, inter)
    load_ops()[torch.float32].silu_and_mul(plain.data_ptr(), act.data_ptr(), 130, inter)
    assert torch.equal(gated(lib, x, w, True), act)
    gate, up = plain.double().chunk(2, -1)  # and it is silu(gate) * up, within test_part15_cpu_ops' bound
    torch.testing.assert_close(act.double(), torch.nn.functional.silu(gate) * up, atol=1e-30, rtol=1e-6)


@pytest.mark.parametrize("flags", [["-O3", "-march=haswell", "-fopenmp"], ["-O2"]], ids=["avx2", "plain"])
def test_the_avx2_and_plain_builds(flags, tmp_path, monkeypatch):
    """The narrower micro-kernels (6 rows x 16 on AVX2, 4 x 8 without -march): the same bound and
    row invariance. AVX2 only where this CPU runs it."""
    if flags[1:2] == ["-march=haswell"] and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("VLLM_COURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_FLAG_SETS", (flags,))
    plain = bind("gemm_cpu.c", cpu_build.build(SOURCE))
    assert plain.gemm_panel_width() == (16 if "-march=haswell" in flags else 8)
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(40, 300, generator=g), torch.randn(50, 300, generator=g), torch.randn(50, generator=g)
    full = run(plain, x, w, b)
    assert_within_bound(full, x, w, b)
    for rows in (1, 7, 13):
        assert torch.equal(run(plain, x[:rows], w, b), full[:rows])
    assert torch.equal(gated(plain, x[:13], w[:36], False), run(plain, x[:13], w[:36]))  # 18 off the vectors


@pytest.fixture
def forced_on(monkeypatch):
    """The kernel on whatever the build (the default is on with AVX-512 only)."""
    monkeypatch.setenv("VLLM_COURSE_CPU_GEMM", "1")


def runner(path, **kw):
    from part15_full.config import EngineConfig
    from part15_full.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(path), device="cpu", kv_cache_memory_mb=4, **kw))


def linears(model):
    found = [m for m in model.modules() if isinstance(m, Linear)]
    assert found
    return found


def test_the_engine_puts_every_linear_layer_on_it_and_keeps_the_logits(tmp_path, forced_on):
    path = tiny_checkpoint(tmp_path)
    model = runner(path, dtype="float32").model
    for m in linears(model):
        assert isinstance(m.quant_method, CpuUnquantizedLinearMethod) and m.gemm == "fp32"
        assert m.gemm_weight is not None and m.packed_weight is None  # ours instead of oneDNN's
    assert [m.gemm_gated for m in linears(model)] == [m.prefix.endswith("gate_up_proj") for m in linears(model)]
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    dense = load_model(path, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(logits(model, ids), logits(dense, ids), atol=1e-4, rtol=1e-4)


def test_quantization_composes_and_bf16_and_switched_off_layers_stay_on_onednn(tmp_path, forced_on, monkeypatch):
    """The GEMM is chosen per layer in the unquantized method's weight processing: quantized layers keep
    their method (part 14), the layers quantization leaves (the LM head) get the kernel."""
    path = tiny_checkpoint(tmp_path)
    model = runner(path, dtype="float32", quantization="int8").model
    quantized = [m for m in linears(model) if not isinstance(m.quant_method, UnquantizedLinearMethod)]
    plain = [m for m in linears(model) if isinstance(m.quant_method, UnquantizedLinearMethod)]
    assert quantized and plain and all(m.gemm == "fp32" for m in plain)
    if not torch.cpu._is_amx_tile_supported():  # bf16 without AMX: oneDNN
        assert all(m.gemm is None for m in linears(runner(path, dtype="bfloat16").model))
    monkeypatch.setenv("VLLM_COURSE_CPU_GEMM", "0")
    assert cpu_gemm.load_gemm() is None
    for m in linears(runner(path, dtype="float32").model):
        assert m.gemm is None and m.packed_weight is not None


def test_the_default_follows_the_build(tmp_path, monkeypatch):
    """auto: on where the kernel was built with AVX-512 (and OpenMP), oneDNN elsewhere."""
    monkeypatch.setenv("VLLM_COURSE_CPU_GEMM", "auto")
    lib = bind("gemm_cpu.c", cpu_build.build(SOURCE))
    expected = lib.gemm_panel_width() == 32 and lib.gemm_threaded() == 1
    assert (cpu_gemm.load_gemm() is not None) == expected
    on = any(m.gemm == "fp32" for m in linears(runner(tiny_checkpoint(tmp_path), dtype="float32").model))
    assert on == expected


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_engine_on_the_kernel_keeps_hf_greedy(tmp_path, forced_on, family):
    """Greedy tokens equal HF's (fp32, CPU); Qwen2's q/k/v projections carry a bias."""
    import transformers
    from part15_full import LLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config)(**common)
    path = save_tiny(tmp_path / family, config, seed=5, scale=0.3)
    prompts = [[1, 5, 9, 33, 2, 77], [1, 100, 3], list(range(1, 50))]
    with LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_mb=4) as engine:
        assert all(m.gemm == "fp32" for m in linears(engine.engine.executor.runner.model))
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(12))]
    assert [list(t) for t in got] == hf_greedy_tokens(path, prompts, 12)
