"""GPTQ checkpoints: a tiny Llama written here in GPTQ's published layout (by this file's own packer,
not the engine's) loads through the shared loaders and computes the same logits as the dense model
with the dequantized weights; part 09's tensor-parallel loaders shard it; dummy loading fills it;
the formats vLLM refuses are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import save_tiny
from part09_tp.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from part14_quant.gptq import GPTQConfig
from part14_quant.quantization import get_quant_config
from shared.layers import LMHead
from shared.model import LayerFactory
from shared.weights import load_config, load_model

CPU = torch.device("cpu")


def gptq_tensors(w: torch.Tensor, bits: int, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One [N, K] weight as AutoGPTQ writes it (symmetric, v1): scales fp16 [K/g, N]; stored
    values u = round(w / scale) + 2^(bits-1) in 0..2^bits-1; qweight [K*bits/32, N] with input
    (32/bits) * j + i of column n in bits [bits*i, bits*(i+1)) of word j; qzeros [K/g, N*bits/32]
    all holding zero - 1; g_idx = i // g. Returns them and the weight they stand for."""
    n, k = w.shape
    g, per, zero = (k if group == -1 else group), 32 // bits, 2 ** (bits - 1)
    scale = (w.double().reshape(n, k // g, g).abs().amax(-1) / (zero - 1)).half()  # [N, K/g]
    s = scale.double().repeat_interleave(g, dim=1)
    u = (torch.round(w.double() / s) + zero).clamp(0, 2 * zero - 1).to(torch.int64)
    ut = u.t().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((k // per, n), dtype=np.uint32)
    for i in range(per):
        qweight |= ut[i::per] << np.uint32(bits * i)
    zword = sum((zero - 1) << (bits * i) for i in range(per))
    qzeros = np.full((k // g, n // per), zword, dtype=np.uint32)
    tensors = {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
               "scales": scale.t().contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // g}
    return tensors, ((u - zero).double() * s).float()  # exact: an fp16 scale times a small integer


def write_gptq(src, dst, bits: int, group: int, lm_head: bool = False):
    """The float checkpoint `src` as a GPTQ checkpoint `dst`, and its dequantized twin `dst`-dense."""
    from safetensors.torch import load_file, save_file

    state = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    gptq, dense = {}, {}
    for name, w in state.items():
        quantized = name.endswith("proj.weight") or (lm_head and name == "lm_head.weight")
        if not quantized:
            gptq[name] = dense[name] = w
            continue
        tensors, dense[name] = gptq_tensors(w, bits, group)
        gptq.update({name.removesuffix("weight") + key: t for key, t in tensors.items()})
    config = json.loads((src / "config.json").read_text())
    for path, tensors, extra in ((dst, gptq, {"quantization_config": {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": True,
            "lm_head": lm_head}}), (dst.with_name(dst.name + "-dense"), dense, {})):
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**config, **extra}))
    return dst, dst.with_name(dst.name + "-dense")


def tiny(path, tied: bool = False):
    from transformers import LlamaConfig

    return save_tiny(path, LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=tied))


def logits(model, ids):
    from shared.attention import NoCacheAttention
    from shared.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def load_gptq(path, **kw):
    quant = get_quant_config(None, path, load_config(path))
    assert isinstance(quant, GPTQConfig)
    return load_model(path, CPU, torch.float32, layers=LayerFactory(quant), **kw)


@pytest.mark.parametrize("bits, group, lm_head", [(4, 16, False), (8, -1, False), (4, 32, True)])
def test_a_gptq_checkpoint_computes_its_dequantized_model(tmp_path, bits, group, lm_head):
    path, dense_path = write_gptq(tiny(tmp_path / "float"), tmp_path / "gptq", bits, group, lm_head)
    model, dense = load_gptq(path), load_model(dense_path, CPU, torch.float32)
    linears = [m for m in model.modules() if hasattr(m, "wna16_layout")]
    assert len(linears) == 2 * 4 + lm_head and all(m.qweight.dtype == torch.int8 for m in linears)
    assert hasattr(model.lm_head, "weight") == (not lm_head)
    ids = torch.tensor([1, 5, 9, 33, 2, 63, 0])
    got, want = logits(model, ids), logits(dense, ids)
    # The same weights exactly (fp16 scale x small integer is exact in fp32); only the order of
    # the fp32 sums differs (scale after each group's partial sum), a few ulps per matmul on
    # logits of size ~1: 1e-5 is ~100 ulps. A wrong nibble moves a logit by ~1e-2.
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_quantize_config_json_is_found_and_dummy_weights_are_seeded(tmp_path):
    path, _ = write_gptq(tiny(tmp_path / "float"), tmp_path / "gptq", 4, 16)
    config = json.loads((path / "config.json").read_text())
    (path / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (path / "config.json").write_text(json.dumps(config))
    assert get_quant_config(None, path, load_config(path)).group_size == 16
    a, b = load_gptq(path, load_format="dummy"), load_gptq(path, load_format="dummy")
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert torch.isfinite(logits(a, ids)).all() and torch.equal(logits(a, ids), logits(b, ids))
    q0, q1 = (a.layers[i].self_attn.o_proj.qweight for i in (0, 1))
    assert not torch.equal(q0, q1)  # seeded per layer, not one pattern everywhere
    with pytest.raises(ValueError, match="already quantized"):
        get_quant_config("int4", path, load_config(path))


def test_refusals():
    with pytest.raises(ValueError, match=r"desc_act=True\) is no longer supported"):
        GPTQConfig.from_config({"bits": 4, "group_size": 128, "desc_act": True})
    GPTQConfig.from_config({"bits": 4, "group_size": -1, "desc_act": True})  # no groups: order is moot
    with pytest.raises(ValueError, match="asymmetric"):
        GPTQConfig.from_config({"bits": 4, "group_size": 128, "sym": False})
    with pytest.raises(ValueError, match="3 bits"):
        GPTQConfig.from_config({"bits": 3, "group_size": 128})
    tied = GPTQConfig.from_config({"bits": 4, "group_size": 32, "lm_head": True}, tie_word_embeddings=True)
    assert tied.get_quant_method(LMHead(32, 64), "lm_head") is None


def test_tensor_parallel_loaders_shard_gptq_tensors(tmp_path):
    """Each rank of two loads its slices of q/k/v, gate/up and down through part 09's loaders; the
    ranks' outputs put together are the whole layer's (columns concatenated, rows summed)."""
    g = torch.Generator().manual_seed(0)
    config = GPTQConfig(4, 16)
    w = {name: torch.randn(n, k, generator=g) for name, n, k in
         (("q", 32, 32), ("k", 16, 32), ("v", 16, 32), ("gate", 64, 32), ("up", 64, 32), ("down", 32, 64))}
    packed = {name: gptq_tensors(t, 4, 16) for name, t in w.items()}
    x, h = torch.randn(3, 32, generator=g), torch.randn(3, 64, generator=g)
    outs = {"qkv": [], "gate_up": [], "down": []}
    for rank in range(2):
        layers = {"qkv": (QKVParallelLinear(32, 8, 4, 2, False, rank, 2, config, "qkv"), ["q", "k", "v"]),
                  "gate_up": (MergedColumnParallelLinear(32, [64, 64], False, rank, 2, config, "gate_up"),
                              ["gate", "up"]),
                  "down": (RowParallelLinear(64, 32, False, rank, 2, config, "down"), [None])}
        for key, (layer, shards) in layers.items():
            for shard in shards:
                tensors = packed[shard or "down"][0]
                ids = {"gate": 0, "up": 1}.get(shard, shard)
                for pname, t in tensors.items():
                    param = getattr(layer, pname)
                    param.weight_loader(param, t, *([] if shard is None else [ids]))
            layer.quant_method.process_weights_after_loading(layer)
            inp = x if key != "down" else h[:, rank * 32:(rank + 1) * 32]
            outs[key].append(layer.quant_method.apply(layer, inp))
    deq = {name: p[1] for name, p in packed.items()}
    q, k, v = (torch.cat([o.split([16, 8, 8], -1)[i] for o in outs["qkv"]], -1) for i in range(3))
    gate, up = (torch.cat([o.chunk(2, -1)[i] for o in outs["gate_up"]], -1) for i in range(2))
    for got, name, inp in ((q, "q", x), (k, "k", x), (v, "v", x), (gate, "gate", x), (up, "up", x),
                           (sum(outs["down"]), "down", h)):
        torch.testing.assert_close(got, F.linear(inp, deq[name]), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="tensor-parallel shard boundary must fall on a group boundary"):
        RowParallelLinear(64, 32, False, 0, 4, GPTQConfig(4, 32), "model.layers.0.mlp.down_proj")
