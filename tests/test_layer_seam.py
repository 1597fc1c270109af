"""The seam in shared/model.py: every layer a later part replaces (projections, MLP block,
embedding, head) is built through the LayerFactory handed to the model. A factory of its own
reaches every layer of every decoder layer, its layers load the checkpoint through their own
weight loaders, and a factory that changes a layer changes the output (so the seam is really
used); the default factory is what every part so far runs (tests/test_parity.py)."""
from __future__ import annotations

import torch
from conftest import save_tiny
from shared.layers import Linear, QKVLinear
from shared.model import LayerFactory
from shared.weights import load_config, load_model

CPU = torch.device("cpu")


def tiny_checkpoint(path):
    from transformers import LlamaConfig

    return save_tiny(path, LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False))


class Recording(LayerFactory):
    """Builds subclasses of the dense layers and remembers every call."""

    def __init__(self):
        self.calls: list[str] = []

    def _made(self, name, layer):
        self.calls.append(name)
        layer.made_by = "recording"
        return layer

    def qkv_proj(self, cfg):
        return self._made("qkv_proj", type("MyQKV", (QKVLinear,), {})(cfg.hidden_size, cfg.head_dim,
                          cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.qkv_bias))

    def o_proj(self, cfg):
        return self._made("o_proj", super().o_proj(cfg))

    def gate_up_proj(self, cfg):
        return self._made("gate_up_proj", super().gate_up_proj(cfg))

    def down_proj(self, cfg):
        return self._made("down_proj", super().down_proj(cfg))

    def mlp(self, cfg, layer_idx):
        return self._made("mlp", super().mlp(cfg, layer_idx))

    def embed_tokens(self, cfg):
        return self._made("embed_tokens", super().embed_tokens(cfg))

    def lm_head(self, cfg):
        return self._made("lm_head", super().lm_head(cfg))


class DoubledDown(LayerFactory):
    """A factory that changes one layer: the MLP's down projection returns twice its output."""

    def down_proj(self, cfg):
        class Doubled(Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        return Doubled(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


def logits(model, ids):
    from shared.attention import NoCacheAttention
    from shared.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def test_a_factory_builds_every_replaceable_layer(tmp_path):
    path = tiny_checkpoint(tmp_path)
    factory = Recording()
    model = load_model(path, CPU, torch.float32, layers=factory)
    n = load_config(path).num_hidden_layers
    assert sorted(factory.calls) == sorted(["embed_tokens", "lm_head"] + ["qkv_proj", "o_proj", "mlp",
                                           "gate_up_proj", "down_proj"] * n)
    made = [m for m in model.modules() if getattr(m, "made_by", None) == "recording"]
    assert len(made) == len(factory.calls)
    assert all(type(layer.self_attn.qkv_proj).__name__ == "MyQKV" for layer in model.layers)
    ids = torch.tensor([1, 5, 9, 33, 2])
    assert torch.equal(logits(model, ids), logits(load_model(path, CPU, torch.float32), ids))


def test_the_model_really_uses_the_factory(tmp_path):
    path = tiny_checkpoint(tmp_path)
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert not torch.allclose(logits(load_model(path, CPU, torch.float32, layers=DoubledDown()), ids),
                              logits(load_model(path, CPU, torch.float32), ids))
