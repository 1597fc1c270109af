"""Online int8/int4 (`--quantization`): which layers are quantized, the quantized model against the
dense model with the same rounded weights (tight) and against fp32 (a bound per layer derived from
the rounding, and the whole model's measured error), the refusals, dummy weights, MoE experts."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from part14_quant.fused_moe import FusedMoE, experts_reference
from part14_quant.gptq import GPTQConfig
from part14_quant.quant_utils import dequantize, quantize_symmetric
from part14_quant.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, get_quant_config
from shared.layers import Linear
from shared.model import LayerFactory
from shared.weights import load_config, load_model
from test_part14_gptq import logits, tiny

CPU = torch.device("cpu")
U = 2.0 ** -24
IDS = torch.tensor([1, 5, 9, 33, 2, 63, 0])


def fake_quantized(src, dst, bits: int, group: int | None):
    """`src` with every projection weight replaced by its rounded value (quantize, dequantize)."""
    state = load_file(str(next(src.glob("*.safetensors"))))
    for name, w in state.items():
        if name.endswith("proj.weight"):
            qw = quantize_symmetric(w, bits, group)
            state[name] = dequantize(qw.q, qw.scales)
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def load(path, quant=None, **kw):
    return load_model(path, CPU, torch.float32, layers=LayerFactory(quant), **kw)


@pytest.mark.parametrize("config, bits, group", [(Int8WeightOnlyConfig(), 8, None),
                                                 (Int4WeightOnlyConfig(16), 4, 16)])
def test_online_model_computes_its_rounded_weights(tmp_path, config, bits, group):
    path = tiny(tmp_path / "float")
    model, flt = load(path, config), load(path)
    quantized = [m for m in model.modules() if hasattr(m, "wna16_layout")]
    assert sorted(m.prefix for m in quantized) == sorted(
        f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                            "mlp.gate_up_proj", "mlp.down_proj"))
    for m in quantized:
        assert not hasattr(m, "weight") and m.qweight.dtype == torch.int8
        assert m.qweight.numel() == m.input_size * sum(m.output_partition_sizes) * bits // 8
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.float32  # kept dense
    # Tight: the dense model with the same rounded weights (only the order of fp32 sums differs).
    dense = load(fake_quantized(path, tmp_path / "rounded", bits, group))
    torch.testing.assert_close(logits(model, IDS), logits(dense, IDS), rtol=0, atol=1e-5)
    # Per layer, derived: |x W_q^T - x W^T| <= sum_k |x_k| scale/2 (plus fp32 rounding of both).
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    floats = dict(flt.named_modules())
    for m in quantized:
        w = floats[m.prefix.removeprefix("model.")].weight
        qw = quantize_symmetric(w, bits, group)
        half_step = qw.scales.repeat_interleave(w.shape[1] // qw.scales.shape[1], dim=1) / 2
        xi = x[:, :w.shape[1]]
        err = (m(xi) - F.linear(xi, w)).abs()
        mass = F.linear(xi.abs(), w.abs() + half_step)
        k, top = w.shape[1], 2 ** (bits - 1) - 1  # slack: w / scale's rounding, and the fp32 sums
        assert (err <= F.linear(xi.abs(), half_step) * (1 + (2 * top + 2 * k + 4) * U)
                + 2 * (k + 2) * U * mass).all()


def test_whole_model_error_against_fp32(tmp_path):
    """Measured on this seeded tiny model (weights std 0.1, K = 32 or 64, logits up to 1.52): int8
    moved the logits by at most 0.027, int4 in groups of 16 by 0.53 (int4 with 16 levels on so
    few, so random weights is crude). The bounds leave ~3x room. First order, the error scales
    with the rounding step, and int4's is ~18x int8's (max/7 per group vs max/127 per row; the
    measured ratio is 19.6): int4 must cost at least 5x more."""
    path = tiny(tmp_path / "float")
    want = logits(load(path), IDS)
    err8 = (logits(load(path, Int8WeightOnlyConfig()), IDS) - want).abs().max().item()
    err4 = (logits(load(path, Int4WeightOnlyConfig(16)), IDS) - want).abs().max().item()
    assert 0 < err8 < 0.08 and 5 * err8 < err4 < 1.6, (err8, err4)


def test_lm_head_option_and_tied_heads(tmp_path):
    path = tiny(tmp_path / "float")
    model = load(path, Int8WeightOnlyConfig(quantize_lm_head=True))
    assert model.lm_head.qweight.dtype == torch.int8 and model.embed_tokens.weight.dtype == torch.float32
    tied = tiny(tmp_path / "tied", tied=True)
    quant = get_quant_config("int8", tied, load_config(tied), quantize_lm_head=True)
    model = load(tied, quant)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: never quantized
    with pytest.raises(RuntimeError, match="tied"):  # a config not told about the tie notices it
        load(tied, Int8WeightOnlyConfig(quantize_lm_head=True))


def test_refusals_and_choices(tmp_path):
    path = tiny(tmp_path / "float")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        get_quant_config("int3", path, load_config(path))
    with pytest.raises(ValueError, match="no GPTQ quantization_config"):
        get_quant_config("gptq", path, load_config(path))
    assert get_quant_config(None, path, load_config(path)) is None
    assert get_quant_config("int4", path, load_config(path), group_size=32).group_size == 32
    from part09_tp.parallel_layers import RowParallelLinear
    with pytest.raises(ValueError, match="splits a quantization group of 32"):
        RowParallelLinear(64, 32, False, 0, 4, Int4WeightOnlyConfig(32), "model.layers.0.mlp.down_proj")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        get_quant_config(None, path, load_config(path))


def test_inputs_that_end_inside_a_group_pad_it_with_zero_weights(tmp_path):
    """Group 128 on 32 inputs (SmolLM2's 576 is 4.5 groups of 128): the last group is padded with zero
    weights, and the model computes exactly the dense model with the weights rounded that way."""
    path = tiny(tmp_path / "float")
    model = load(path, get_quant_config("int4", path, load_config(path)))  # the default group, 128
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.wna16_pad == 96 and qkv.scales.shape[0] == 1
    state = load_file(str(next(path.glob("*.safetensors"))))
    for name, w in state.items():
        if name.endswith("proj.weight"):
            pad = (-w.shape[1]) % 128
            qw = quantize_symmetric(F.pad(w, (0, pad)), 4, 128)
            state[name] = dequantize(qw.q, qw.scales)[:, :w.shape[1]].contiguous()
    dst = tmp_path / "rounded"
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((path / "config.json").read_text())
    torch.testing.assert_close(logits(model, IDS), logits(load(dst), IDS), rtol=0, atol=1e-5)


def test_dummy_weights_are_quantized(tmp_path):
    path = tiny(tmp_path / "float")
    a = load(path, Int4WeightOnlyConfig(16), load_format="dummy")
    b = load(path, Int4WeightOnlyConfig(16), load_format="dummy")
    assert torch.isfinite(logits(a, IDS)).all() and torch.equal(logits(a, IDS), logits(b, IDS))
    assert a.layers[0].mlp.down_proj.qweight.any()  # random floats rounded to nonzero levels


def test_moe_experts_quantized_online():
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 32, 32
    w1, w3, w2 = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    moe = FusedMoE(e, 2, h, i, True, quant_config=Int4WeightOnlyConfig(16), prefix="model.layers.0.mlp.experts")
    for ex in range(e):
        for which, t in (("w1", w1[ex]), ("w3", w3[ex]), ("w2", w2[ex])):
            param = moe.w2_weight if which == "w2" else moe.w13_weight
            moe.weight_loader(param, t, (ex, which))
    moe.quant_method.process_weights_after_loading(moe)
    assert moe.w13_qweight.dtype == torch.uint8 and moe.w13_qweight.shape == (e, 2 * i, h // 2)
    x, router = torch.randn(9, h, generator=g), torch.randn(9, e, generator=g)
    rounded = []
    for w in (torch.cat((w1, w3), dim=1), w2):
        qw = quantize_symmetric(w.reshape(-1, w.shape[-1]), 4, 16)
        rounded.append(dequantize(qw.q, qw.scales).reshape(w.shape))
    from part14_quant.fused_moe import select_experts
    weights, ids = select_experts(router, 2, True)
    torch.testing.assert_close(moe(x, router), experts_reference(x, *rounded, ids, weights), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="GPTQ-quantized MoE experts are not supported"):
        FusedMoE(e, 2, h, i, True, quant_config=GPTQConfig(4, 16), prefix="experts")
    assert Int8WeightOnlyConfig().get_quant_method(Linear(32, 4), "model.layers.0.mlp.gate") is None  # router
