"""Part 15's bf16 GEMM on AMX tiles (cpu/csrc/gemm_amx.c, cpu/gemm.py): each output within the
rounding bound of its K-term fp32 sum and one bf16 rounding, whatever the shape (under a tile's 16
rows, rows off a multiple of 16, rows over a chunk, a bias, strided rows); a row's result the same bit for bit
alone, with other rows or on one thread; the engine putting every linear layer on it in bf16, and
what stays on oneDNN (sizes off the tiles, fp32, the switch). Runs where the CPU has AMX: elsewhere
the kernel cannot run, and the one test left checks that the engine does not ask for it."""
from __future__ import annotations

import pytest
import torch

import part15_full.cpu.build as cpu_build
import part15_full.cpu.gemm as amx
from part15_full.cpu.gemm import CpuUnquantizedLinearMethod
from part15_full.cpu.kernels import CSRC, bind
from shared.layers import Linear
from shared.weights import default_dtype, load_model

from test_layer_seam import logits, tiny_checkpoint
from test_part15_cpu_gemm import assert_within_bound, linears, runner

HAS_AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX: the kernel's instructions do not exist here")
U16 = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)


@pytest.fixture(scope="module")
def lib():
    built = cpu_build.build(CSRC / "gemm_amx.c")
    assert built is not None, "no C compiler here? the set-up installs none; cc must be on PATH"
    lib = bind("gemm_amx.c", built)
    assert lib.amx_init() == 1, "Linux did not lend this process the tile registers"
    return lib


def run(lib, x, w, bias=None, threads=None):
    packed = amx.amx_pack_weight(lib, w)
    if threads is None:
        return amx.amx_gemm(lib, x, packed, w.shape[0], bias)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    assert lib.amx_gemm(x.shape[0], w.shape[0], x.shape[1], x.data_ptr(), x.stride(0), packed.data_ptr(),
                        out.data_ptr(), w.shape[0], None if bias is None else bias.data_ptr(), threads) == 0
    return out


def bf16(*shape, generator):
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


# Rows: one; a tail under a tile's 16; exactly one and two tiles; one over; rows over a chunk (768 KiB
# of x: 672 rows at K=576, 256 at K=1536). Columns and K: the tiles' 32, and a model's sizes.
@pytest.mark.parametrize("m,n,k,bias", [(1, 32, 32, False), (5, 64, 576, True), (16, 960, 576, False),
                                        (32, 96, 1536, True), (33, 64, 64, False), (700, 96, 576, False),
                                        (300, 64, 1536, True)])
@needs_amx
def test_the_kernel_is_within_the_rounding_bound_of_the_exact_product(lib, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 7 + n)
    x, w = bf16(m, k, generator=g), bf16(n, k, generator=g)
    b = bf16(n, generator=g) if bias else None
    got = run(lib, x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # The products of two bf16 are exact in fp32: the fp32 sum's bound, then one bf16 rounding.
    assert_within_bound(got, x, w, b, out_roundoff=U16)


@needs_amx
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(lib):
    """Every output starts from a zeroed tile and adds its k-steps in order, whatever the row count,
    the tile a row lands in (a last tile overlapping the one before it, or one under 16 rows high),
    the chunk or the thread."""
    g = torch.Generator().manual_seed(1)
    # Sums that cancel: x offset by 64 and each weight row's second half the negated first, so the
    # partial sums run ~50x the result and another order of adding shows in the bf16 bits (a test
    # on plain random data let a kernel that summed a pair of tiles' k-steps backwards through).
    x, w, b = bf16(300, 1536, generator=g) + 64, bf16(96, 768, generator=g), bf16(96, generator=g)
    w = torch.cat([w, -w], 1)
    full = run(lib, x, w, b)
    for rows in (1, 5, 15, 16, 17, 31, 32, 33, 255, 257, 299):  # around the tiles, pairs of tiles, chunks
        assert torch.equal(run(lib, x[:rows], w, b), full[:rows]), rows
        assert torch.equal(run(lib, x[rows - 1:rows].clone(), w, b), full[rows - 1:rows]), rows
    assert torch.equal(run(lib, x, w, b, threads=1), full)
    assert torch.equal(run(lib, x, w, b, threads=2), full)


@needs_amx
def test_strided_and_batched_inputs_and_no_rows(lib):
    g = torch.Generator().manual_seed(2)
    wide, w = bf16(19, 96, generator=g), bf16(32, 64, generator=g)
    x = wide[:, :64]  # rows 96 elements apart; 19 rows: a last tile overlapping the first
    assert torch.equal(run(lib, x, w), run(lib, x.contiguous(), w))
    x3 = bf16(2, 5, 64, generator=g)
    assert torch.equal(run(lib, x3, w), run(lib, x3.reshape(10, 64), w).view(2, 5, 32))
    assert run(lib, torch.empty(0, 64, dtype=torch.bfloat16), w).shape == (0, 32)


@needs_amx
def test_the_engine_puts_every_bf16_linear_layer_on_it_and_keeps_the_logits(tmp_path):
    path = tiny_checkpoint(tmp_path)
    model = runner(path, dtype="bfloat16").model
    for m in linears(model):
        assert isinstance(m.quant_method, CpuUnquantizedLinearMethod) and m.gemm == "amx"
        assert m.gemm_weight is not None and m.packed_weight is None  # ours instead of oneDNN's
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    dense = load_model(path, torch.device("cpu"), torch.bfloat16)
    for m in linears(dense):  # the reference: the dense weight through F.linear, in fp32
        m.packed_weight = None
    torch.testing.assert_close(logits(model, ids), logits(dense, ids), atol=0.1, rtol=0.05)


@needs_amx
def test_sizes_off_the_tiles_fp32_and_the_switch_stay_on_onednn(tmp_path, monkeypatch):
    with default_dtype(torch.bfloat16):
        odd = Linear(576, 40)
    odd.quant_method = CpuUnquantizedLinearMethod()  # as the CPU layer factory gives it
    odd.weight.data.copy_(torch.randn(40, 576, generator=torch.Generator().manual_seed(4)))
    odd.quant_method.process_weights_after_loading(odd)
    assert odd.gemm_weight is None and odd.packed_weight is not None  # 40 columns: oneDNN's copy
    x = torch.randn(3, 576).to(torch.bfloat16)
    torch.testing.assert_close(odd(x).float(), torch.nn.functional.linear(x.float(), odd.weight.float()),
                               atol=0.05, rtol=0.02)
    path = tiny_checkpoint(tmp_path)
    assert not any(m.gemm == "amx" for m in linears(runner(path, dtype="float32").model))
    monkeypatch.setenv("VLLM_COURSE_CPU_AMX", "0")
    assert amx.load_amx() is None
    for m in linears(runner(path, dtype="bfloat16").model):
        assert m.gemm is None and m.packed_weight is not None


def test_the_engine_asks_for_it_only_where_the_cpu_has_amx(tmp_path):
    """Where the CPU has AMX the kernel loads and every bf16 linear layer is on it; elsewhere no
    library is loaded and the layers stay on oneDNN."""
    assert (amx.load_amx() is not None) == HAS_AMX
    on = [m.gemm == "amx" for m in linears(runner(tiny_checkpoint(tmp_path), dtype="bfloat16").model)]
    assert all(on) if HAS_AMX else not any(on)
