"""Part 14's arithmetic: nibble and int32 packing (every pattern), the symmetric rounding's error
bound, and GPTQ's / compressed-tensors' layouts read back against words packed by hand here."""
from __future__ import annotations

import pytest
import torch

from part14_quant.quant_utils import (QuantizedWeight, ct_pack, ct_unpack, dequantize, gptq_pack, gptq_unpack,
                               pack_int32, pack_int4, qmax, quantize_symmetric, unpack_int32, unpack_int4)

U = 2.0 ** -24  # fp32 unit roundoff


def signed(word: int) -> int:
    """A 32-bit pattern written in hex, as the int32 that holds it."""
    return word - 2 ** 32 if word >= 2 ** 31 else word


def test_every_byte_and_every_nibble_pair_round_trips():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)
    a, b = torch.meshgrid(torch.arange(-8, 8), torch.arange(-8, 8), indexing="ij")
    pairs = torch.stack((a.flatten(), b.flatten()), dim=-1).to(torch.int8)  # all 256 (low, high)
    assert torch.equal(unpack_int4(pack_int4(pairs)), pairs)
    # value + 8, first element in the low nibble: (-7, -6) -> 0x21; (7, -8) -> 0x0F
    assert pack_int4(torch.tensor([[-7, -6], [7, -8]])).flatten().tolist() == [0x21, 0x0F]


def test_nibble_packing_refuses_odd_shapes_and_out_of_range_values():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(torch.tensor([8, 0]))


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_words_hold_every_value_in_every_position(bits):
    per = 32 // bits
    r, i = torch.meshgrid(torch.arange(2 ** bits), torch.arange(per), indexing="ij")
    values = (r + i) % 2 ** bits  # every value in every slot of a word
    for dim in (0, 1):
        v = values if dim == 1 else values.t().contiguous()
        assert torch.equal(unpack_int32(pack_int32(v, bits, dim), bits, dim), v.to(torch.int32))
    if bits == 8:  # every int8 value through GPTQ's +128 offset and back
        q = torch.arange(-128, 128, dtype=torch.int32).reshape(-1, 4)
        assert torch.equal(unpack_int32(pack_int32(q + 128, 8, 1), 8, 1) - 128, q)


def test_int32_word_order_is_low_bits_first():
    assert pack_int32(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4, 1).item() == signed(0x87654321)
    assert pack_int32(torch.tensor([[0x10], [0x32], [0x54], [0xF6]]), 8, 0).item() == signed(0xF6543210)
    with pytest.raises(ValueError, match="int32 words"):
        pack_int32(torch.zeros(3, 12, dtype=torch.int32), 4, 1)
    with pytest.raises(ValueError, match="0..15"):
        pack_int32(torch.full((1, 8), 16), 4, 1)


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_error_is_at_most_half_a_step(bits, group, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + (group or 0))
    w = torch.randn(24, 256, generator=g) * torch.rand(24, 1, generator=g)
    w[3, 17] = 40.0  # an outlier: its group's step is coarse, the other groups' are not
    w[5, :] = 0.0  # an all-zero row: q = 0
    w = w.to(dtype)
    qw = quantize_symmetric(w, bits, group)
    top, gs = qmax(bits), group or 256
    assert qw.q.dtype == torch.int8 and qw.scales.dtype == dtype and qw.scales.shape == (24, 256 // gs)
    assert qw.q.abs().max() <= top and not qw.q[5].any()
    # The largest |w| of each group lands on the top level (the scale is max / qmax) ...
    big = w.float().reshape(24, -1, gs).abs().argmax(-1, keepdim=True)
    q_at_max = qw.q.reshape(24, -1, gs).gather(-1, big).abs()
    assert (q_at_max[w.float().reshape(24, -1, gs).abs().amax(-1) > 0] == top).all()
    # ... and every weight is within half a step of its level, plus fp32's rounding of w / scale.
    s = qw.scales.double().repeat_interleave(gs, dim=1)
    err = (w.double() - qw.q.double() * s).abs()
    assert (err <= s * (0.5 + top * U)).all(), (err / s).max()
    if group is not None:  # the outlier spoils only its own group's step
        row = qw.scales.float()[3]
        assert row[17 // gs] == row.max() and (row[torch.arange(len(row)) != 17 // gs] < row.max() / 4).all()


def test_a_group_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ValueError, match="input size 576 is not a multiple of the quantization group size 128"):
        quantize_symmetric(torch.randn(4, 576), 4, 128)
    with pytest.raises(ValueError, match="4-bit|3-bit"):
        quantize_symmetric(torch.randn(4, 64), 3, 32)


def hand_example() -> tuple[QuantizedWeight, QuantizedWeight]:
    """4-bit: W[n, i] = ((n + i) % 16) - 8 for 8 outputs x 8 inputs (one group); 8-bit: 4 x 4."""
    n, i = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    q4 = ((n + i) % 16 - 8).to(torch.int8)
    q8 = torch.tensor([[-128, -1, 0, 127], [5, 6, 7, 8], [0, 0, 0, 0], [-2, 100, -100, 1]], dtype=torch.int8)
    return (QuantizedWeight(q4, torch.linspace(0.5, 1.2, 8)[:, None], 4),
            QuantizedWeight(q8, torch.tensor([[0.25], [1.0], [2.0], [0.5]]), 8))


def test_gptq_layout_matches_words_packed_by_hand():
    q4, q8 = hand_example()
    t = gptq_pack(q4)
    # Column n of qweight holds inputs 0..7 of output n, input i at bits 4i, stored value + 8.
    words = [0x76543210, 0x87654321, 0x98765432, 0xA9876543, 0xBA987654, 0xCBA98765, 0xDCBA9876, 0xEDCBA987]
    assert t["qweight"].dtype == torch.int32 and t["qweight"].tolist() == [[signed(w) for w in words]]
    assert t["qzeros"].tolist() == [[0x77777777]]  # v1: each zero stored minus one (8 - 1)
    assert t["scales"].shape == (1, 8) and torch.equal(t["scales"][0], q4.scales[:, 0])
    assert t["g_idx"].tolist() == [0] * 8
    assert gptq_pack(q4, "gptq_v2")["qzeros"].tolist() == [[signed(0x88888888)]]
    t8 = gptq_pack(q8)
    # Output 0's inputs (-128, -1, 0, 127) + 128 = (0x00, 0x7F, 0x80, 0xFF), low byte first.
    assert t8["qweight"].tolist() == [[signed(0xFF807F00), signed(0x88878685), signed(0x80808080),
                                       signed(0x811CE47E)]]
    assert t8["qzeros"].tolist() == [[0x7F7F7F7F]]
    for qw in (q4, q8):
        packed = gptq_pack(qw)
        back = gptq_unpack(packed["qweight"], packed["qzeros"], packed["scales"], qw.bits)
        assert torch.equal(back.q, qw.q) and torch.equal(back.scales, qw.scales)


def test_gptq_refuses_asymmetric_zeros_and_odd_shapes():
    q4, _ = hand_example()
    t = gptq_pack(q4)
    with pytest.raises(ValueError, match="asymmetric"):
        gptq_unpack(t["qweight"], torch.tensor([[signed(0x77777776)]]), t["scales"], 4)
    with pytest.raises(ValueError, match="int32 words"):  # 6 outputs: qzeros cannot pack along N
        gptq_pack(QuantizedWeight(q4.q[:6], q4.scales[:6], 4))
    with pytest.raises(ValueError, match="int32 words"):  # 4 inputs: qweight cannot pack along K
        gptq_pack(QuantizedWeight(q4.q[:, :4], q4.scales, 4))


def test_compressed_tensors_layout_matches_words_packed_by_hand():
    q4, q8 = hand_example()
    t = ct_pack(q4)
    # Row n of weight_packed: inputs 0..7 of output n, +8, low bits first: the GPTQ words above.
    assert t["weight_packed"].shape == (8, 1) and t["weight_packed"][1, 0].item() == signed(0x87654321)
    assert t["weight_shape"].tolist() == [8, 8] and torch.equal(t["weight_scale"], q4.scales)
    assert ct_pack(q8)["weight_packed"][0, 0].item() == signed(0xFF807F00)  # (-128,-1,0,127) + 128
    for qw in (q4, q8):
        packed = ct_pack(qw)
        back = ct_unpack(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"], qw.bits)
        assert torch.equal(back.q, qw.q) and torch.equal(dequantize(back.q, back.scales), dequantize(qw.q, qw.scales))
    with pytest.raises(ValueError, match="does not hold"):
        ct_unpack(t["weight_packed"], t["weight_scale"], torch.tensor([8, 16]), 4)
