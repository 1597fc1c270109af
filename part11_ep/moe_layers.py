"""The MoE block that replaces the dense MLP, handed to the shared model through its LayerFactory.

    x ─▶ gate (router, H → E) ─▶ softmax, top-k ─▶ FusedMoE: the chosen experts, weighted sum ─┐
    └─▶ shared expert (Qwen2-MoE) × sigmoid(shared_expert_gate(x)) ─────────────────────────────┴─▶ +

The router is replicated on every rank (it is small: E x H). The shared expert is an ordinary
MLP, built by the factory underneath (dense, or part 09's tensor-parallel layers)."""
from __future__ import annotations

import torch
from torch import nn

from shared.config import ModelConfig
from shared.layers import Linear
from shared.model import LayerFactory, LlamaMLP

from .fused_moe import FusedMoE
from .moe_config import MoEConfig


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, base: LayerFactory, rank: int, size: int,
                 expert_parallel: bool, use_triton: bool):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.moe_intermediate_size,
                                moe.renormalize, rank, size, expert_parallel, use_triton)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared_cfg = _with_intermediate(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared_cfg, base)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _with_intermediate(cfg: ModelConfig, size: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, intermediate_size=size)


class MoELayers(LayerFactory):
    """`base`'s layers (dense, or tensor-parallel), with an MoE block in every sparse layer."""

    def __init__(self, moe: MoEConfig, base: LayerFactory | None = None, rank: int = 0, size: int = 1,
                 expert_parallel: bool = False, use_triton: bool = False):
        self.moe, self.base = moe, base or LayerFactory()
        self.rank, self.size, self.expert_parallel, self.use_triton = rank, size, expert_parallel, use_triton

    def qkv_proj(self, cfg):
        return self.base.qkv_proj(cfg)

    def o_proj(self, cfg):
        return self.base.o_proj(cfg)

    def gate_up_proj(self, cfg):
        return self.base.gate_up_proj(cfg)

    def down_proj(self, cfg):
        return self.base.down_proj(cfg)

    def embed_tokens(self, cfg):
        return self.base.embed_tokens(cfg)

    def lm_head(self, cfg):
        return self.base.lm_head(cfg)

    def mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if not self.moe.is_sparse(layer_idx):
            return self.base.mlp(cfg, layer_idx)
        return SparseMoeBlock(cfg, self.moe, self.base, self.rank, self.size, self.expert_parallel, self.use_triton)
