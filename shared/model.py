"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM, TinyLlama), and the base every
other family of shared/models/ subclasses, overriding only what it changes: the attention
(`attention_cls`), the decoder layer (`decoder_layer_cls`), each layer's rotary embedding
(`rotary_for`), the embedding (`embed_input_ids`), the logits and the weight names.

Inputs are flattened: `input_ids` and `positions` are 1-D over every token of the step, with no
batch dimension and no padding. Attention is delegated to the backend in the forward context.
Every layer that a later part replaces is built through one `LayerFactory` (the default builds
them dense, as part 01 needs)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .config import ModelConfig
from .forward_context import get_forward_context
from .layers import (GeluAndMul, LMHead, Linear, MergedLinear, QKVLinear, QuantizationConfig, RMSNorm,
                     RotaryEmbedding, SiluAndMul, VocabEmbedding, default_weight_loader)


class LayerFactory:
    """The one seam through which the model builds the layers that later parts replace: its
    projections, its MLP block, its embedding and its head (and its norms, rotary embedding and
    activation, whose fused CPU kernels part 15 brings). This default builds them dense. A part
    that shards them across processes (09, tensor parallelism) or routes tokens to experts (11) hands
    the model a factory of its own folder, and this file stays as it is. Every linear layer is built
    with its `prefix` (its dotted name) and asks the factory's `quant_config` for its quantize method,
    so weight formats (14) change without a new factory. (vLLM reaches the same end with
    parallel-aware layer classes and a `quant_method` on every linear layer.)"""
    tp_rank, tp_size = 0, 1  # this process's place in a tensor-parallel group
    layer_range: tuple[int, int] | None = None  # a pipeline stage's layers [start, end) (part 15); None: all

    def __init__(self, quant_config: QuantizationConfig | None = None):
        self.quant_config = quant_config

    def qkv_proj(self, cfg: ModelConfig, prefix: str) -> QKVLinear:
        return QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.qkv_bias, self.quant_config, prefix)

    def o_proj(self, cfg: ModelConfig, prefix: str) -> Linear:
        return Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias,
                      self.quant_config, prefix)

    def gate_up_proj(self, cfg: ModelConfig, prefix: str) -> MergedLinear:
        return MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, self.quant_config, prefix)

    def down_proj(self, cfg: ModelConfig, prefix: str) -> Linear:
        return Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, self.quant_config, prefix)

    def mlp(self, cfg: ModelConfig, layer_idx: int, prefix: str) -> nn.Module:
        return LlamaMLP(cfg, self, prefix)

    def embed_tokens(self, cfg: ModelConfig, prefix: str) -> VocabEmbedding:
        return VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    def lm_head(self, cfg: ModelConfig, prefix: str) -> LMHead:
        return LMHead(cfg.hidden_size, cfg.vocab_size, self.quant_config, prefix)

    # The elementwise layers, in torch here; part 15 hands in fused CPU kernels for them.
    def rms_norm(self, cfg: ModelConfig) -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rotary_embedding(self, cfg: ModelConfig, max_positions: int,
                         layer_type: str = "full_attention") -> RotaryEmbedding:
        """layer_type "sliding_attention" on a model with a local RoPE base (Gemma 3): that base, unscaled."""
        if layer_type == "sliding_attention" and cfg.rope_local_theta is not None:
            return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None, cfg.rotary_dim)
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)

    def silu_and_mul(self) -> SiluAndMul:
        return SiluAndMul()


class WrappedLayers:
    """A factory that changes some of another factory's layers: what a subclass does not override
    (and every attribute, such as tp_rank) is the base's. Part 11 puts MoE blocks over dense or
    tensor-parallel layers this way."""

    def __init__(self, base: LayerFactory):
        self.base = base

    def mlp(self, cfg: ModelConfig, layer_idx: int, prefix: str) -> nn.Module:
        # The base's recipe for the block, built from this factory's projections (so an override
        # of gate_up_proj or down_proj here reaches the MLPs too).
        return type(self.base).mlp(self, cfg, layer_idx, prefix)

    def __getattr__(self, name: str):
        if name == "base":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding | None, layers: LayerFactory,
                 prefix: str):
        super().__init__()
        # Its index in the KV cache, which holds this pipeline stage's layers only (part 15).
        self.layer_idx = layer_idx - (layers.layer_range or (0, 0))[0]
        self.qkv_proj = layers.qkv_proj(cfg, f"{prefix}.qkv_proj")
        # The heads this module computes: all of them, or a shard's (part 09).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.o_proj = layers.o_proj(cfg, f"{prefix}.o_proj")
        self.rotary = rotary
        # Per-head RMSNorms of q and k before RoPE: none in Llama (Qwen3 and Gemma 3 set them).
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # None: a layer without position embedding (SmolLM3's NoPE layers)
            q, k = self.rotary(positions, q, k)
        ctx = get_forward_context()
        out = ctx.backend.forward(self.layer_idx, q, k, v, ctx.metadata)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: LayerFactory, prefix: str):
        super().__init__()
        self.gate_up_proj = layers.gate_up_proj(cfg, f"{prefix}.gate_up_proj")
        # SwiGLU, or GeGLU (Gemma: gelu_pytorch_tanh is gelu's tanh approximation).
        self.act = layers.silu_and_mul() if cfg.hidden_act == "silu" else \
            GeluAndMul("tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none")
        self.down_proj = layers.down_proj(cfg, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding | None, layers: LayerFactory,
                 prefix: str):
        super().__init__()
        self.input_layernorm = layers.rms_norm(cfg)
        self.self_attn = self.attention_cls(cfg, layer_idx, rotary, layers, f"{prefix}.self_attn")
        self.post_attention_layernorm = layers.rms_norm(cfg)
        self.mlp = layers.mlp(cfg, layer_idx, f"{prefix}.mlp")

    def forward(self, positions, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights here (part 15)."""


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that land in a slice of one of our merged projections.
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                      ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                      ("gate_up_proj", "up_proj", 1)]

    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, layers: LayerFactory | None = None):
        super().__init__()
        self.config = cfg
        layers = layers or LayerFactory()
        max_positions = max_positions or cfg.max_position_embeddings
        rotaries: dict[str, RotaryEmbedding] = {}  # one table per kind of layer, shared by those layers
        # A pipeline stage (part 15) builds its own layers only; the first embeds, the last normalises
        # and projects (and holds the embedding too when the head is tied to it).
        self.start_layer, self.end_layer = layers.layer_range or (0, cfg.num_hidden_layers)
        first, last = self.start_layer == 0, self.end_layer == cfg.num_hidden_layers
        self.embed_tokens = layers.embed_tokens(cfg, "model.embed_tokens") \
            if first or (last and cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, i, self.rotary_for(i, layers, max_positions, rotaries), layers,
                                   f"model.layers.{i}") if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = layers.rms_norm(cfg) if last else None
        self.lm_head = layers.lm_head(cfg, "lm_head") if last else None
        if cfg.tie_word_embeddings and last:
            self.lm_head.weight = self.embed_tokens.weight

    def rotary_for(self, layer_idx: int, layers: LayerFactory, max_positions: int,
                   rotaries: dict[str, RotaryEmbedding]) -> RotaryEmbedding | None:
        """The rotary embedding of one layer: in Llama every layer shares one."""
        if "full_attention" not in rotaries:
            rotaries["full_attention"] = layers.rotary_embedding(self.config, max_positions)
        return rotaries["full_attention"]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns the final hidden states [T, hidden] for every token; a pipeline stage before the last
        (part 15) starts from the previous stage's `intermediate` (hidden states, residual) unless it is
        the first, and returns its own."""
        x, residual = (self.embed_input_ids(input_ids), None) if intermediate is None else intermediate
        for i in range(self.start_layer, self.end_layer):  # (a slice would build a ModuleList each step)
            x, residual = self.layers[i](positions, x, residual)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the rows that will sample (usually the last token of a sequence)."""
        return self.lm_head(hidden).float()

    def is_pp_missing(self, name: str) -> bool:
        """A checkpoint tensor of a part another pipeline stage holds (name without "model.")."""
        if name.startswith("layers."):
            return not self.start_layer <= int(name.split(".")[1]) < self.end_layer
        held = {"embed_tokens": self.embed_tokens, "norm": self.norm, "lm_head": self.lm_head}
        return name.split(".")[0] in held and held[name.split(".")[0]] is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        all_shards: dict[str, set] = {}
        for packed, _, shard in self.stacked_params:
            all_shards.setdefault(packed, set()).add(shard)
        got_shards: dict[str, set] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.") if not name.startswith("lm_head") else name
            if "rotary_emb.inv_freq" in name or self.is_pp_missing(name):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            for packed, original, shard in self.stacked_params:
                if f".{original}." in name:
                    name = name.replace(original, packed)
                    param = params[name]
                    param.weight_loader(param, tensor, shard)
                    got_shards.setdefault(name, set()).add(shard)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        # A merged parameter is loaded only once every one of its slices is (q, k and v; gate and up).
        loaded |= {n for n, got in got_shards.items() if got == all_shards[n.split(".")[-2]]}
        return loaded
