"""Part 14's matmuls against the plain-torch reference (dequantize in fp32, one F.linear): the CPU
path in this process, the Triton W4A16/W8A16 kernel in a child process under TRITON_INTERPRET=1
(which must be set before triton is first imported; this process may have imported it already).

Bounds, not luck: two fp32 dot products of the same K products, summed in different orders, differ
by at most 2 * gamma(K) * sum_k |x_k w_k| with gamma(K) = K u / (1 - K u), u = 2^-24 (Higham,
"Accuracy and Stability of Numerical Algorithms", 3.1). The CPU path adds one rounding per
partial sum times its scale, covered by using gamma(K + 2). In fp16 the kernel also rounds each
dequantized weight to fp16 (at most u16 = 2^-11 relative) and both round their output once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from part14_quant.quant_kernels import pack_for_cpu, unpack_cpu, wna16_gemm_ref, wna16_linear_cpu
from part14_quant.quant_utils import QuantizedWeight, dequantize, gptq_pack

REPO = Path(__file__).resolve().parents[1]


def gamma(k: int, u: float = 2.0 ** -24) -> float:
    return k * u / (1 - k * u)


def random_weight(n: int, k: int, bits: int, group: int | None, seed: int) -> QuantizedWeight:
    """Every level in use, including the -2^(bits-1) that GPTQ's grid has and ours does not."""
    g = torch.Generator().manual_seed(seed)
    top = 2 ** (bits - 1)
    q = torch.randint(-top, top, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // (group or k), generator=g) + 0.05
    return QuantizedWeight(q, scales, bits)


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64), (4, None)])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_cpu_path_matches_the_reference(bits, group, m):
    k, n = 128, 48
    qw = random_weight(n, k, bits, group, seed=bits * 100 + m)
    data, scales = pack_for_cpu(qw)
    assert data.dtype == torch.int8 and data.numel() == n * k * bits // 8  # 4 bits: two per byte
    assert torch.equal(unpack_cpu(data, bits).transpose(0, 1).reshape(n, k), qw.q)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    w = dequantize(qw.q, qw.scales)
    got, want = wna16_linear_cpu(x, data, scales, bits), F.linear(x, w)
    bound = 2 * gamma(k + 2) * F.linear(x.abs(), w.abs())
    assert got.shape == (m, n) and ((got - want).abs() <= bound).all()
    # A leading batch dim passes through.
    assert torch.equal(wna16_linear_cpu(x[None], data, scales, bits)[0], got)


def test_the_reference_reads_gptq_layout():
    qw = random_weight(16, 64, 4, 32, seed=7)
    packed = gptq_pack(qw)
    x = torch.randn(3, 64)
    want = F.linear(x.double(), dequantize(qw.q, qw.scales.double()))
    got = wna16_gemm_ref(x, packed["qweight"], packed["scales"], 4)
    assert ((got.double() - want).abs() <= 2 * gamma(64) * F.linear(x.abs().double(), dequantize(
        qw.q, qw.scales.double()).abs()) + 1e-12).all()


CASES = [(4, 32, 3, 40, 64), (4, 64, 17, 72, 128), (8, None, 1, 24, 40), (8, 32, 33, 64, 96), (4, None, 2, 16, 40)]


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(REPO)!r}]
        import torch, torch.nn.functional as F
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_part14_quant_kernels import CASES, gamma, random_weight
        from part14_quant.quant_kernels import wna16_gemm_ref
        from part14_quant.quant_triton import wna16_gemm_triton
        from part14_quant.quant_utils import dequantize, gptq_pack
        worst = {{}}
        for bits, group, m, n, k in CASES:
            qw = random_weight(n, k, bits, group, seed=m * n)
            packed = gptq_pack(qw)
            for dtype, u in ((torch.float32, 0.0), (torch.float16, 2.0 ** -11)):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
                scales = packed["scales"].to(dtype)
                got = wna16_gemm_triton(x, packed["qweight"], scales, bits).float()
                want = wna16_gemm_ref(x, packed["qweight"], scales, bits).float()
                mass = F.linear(x.float().abs(), dequantize(qw.q, scales.float().t()).abs())
                bound = (2 * gamma(k) + u) * mass + 2 * u * want.abs()
                worst[f"{{bits}}b g{{group}} {{m}}x{{n}}x{{k}} {{dtype}}"] = ((got - want).abs() / bound).max().item()
        # The path a layer takes on CUDA: its weight put in GPTQ's layout, then the kernel.
        from part14_quant.quant_kernels import apply_wna16, use_quantized_weight
        from part14_quant.quant_utils import quantize_symmetric
        layer, w = torch.nn.Module(), torch.randn(24, 64)
        qw = quantize_symmetric(w, 4, 32)
        use_quantized_weight(layer, qw, layout="gptq")
        x = torch.randn(5, 64)
        got, want = apply_wna16(layer, x, torch.ones(24)), F.linear(x, dequantize(qw.q, qw.scales)) + 1
        mass = F.linear(x.abs(), dequantize(qw.q, qw.scales).abs()) + 1
        worst["layer, gptq layout"] = ((got - want).abs() / (2 * gamma(66) * mass)).max().item()
        print(json.dumps(worst))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    worst = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(worst) == 2 * len(CASES) + 1 and all(v <= 1 for v in worst.values()), worst
