"""The MoE block that replaces the dense MLP, handed to the shared model through its LayerFactory.

    x ─▶ gate (router, H → E) ─▶ softmax, top-k ─▶ FusedMoE: the chosen experts, weighted sum ─┐
    └─▶ shared expert (Qwen2-MoE) × sigmoid(shared_expert_gate(x)) ─────────────────────────────┴─▶ +

The router is replicated on every rank (it is small: E x H). The shared expert is an ordinary
MLP, built by the factory underneath (dense, or part 09's tensor-parallel layers)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shared.config import ModelConfig
from shared.layers import Linear
from shared.model import LayerFactory, LlamaMLP, WrappedLayers

from .fused_moe import FusedMoE
from .moe_config import MoEConfig


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, base: LayerFactory, expert_parallel: bool,
                 use_triton: bool, prefix: str):
        super().__init__()
        # The router stays in the model's dtype (it is small, and its top-k is sensitive).
        self.gate = Linear(cfg.hidden_size, moe.num_experts, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.moe_intermediate_size,
                                moe.renormalize, base.tp_rank, base.tp_size, expert_parallel, use_triton,
                                base.quant_config, f"{prefix}.experts")
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared_cfg = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared_cfg, base, f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoELayers(WrappedLayers):
    """`base`'s layers (dense, or tensor-parallel), with an MoE block in every sparse layer."""

    def __init__(self, moe: MoEConfig, base: LayerFactory, expert_parallel: bool = False, use_triton: bool = False):
        super().__init__(base)
        self.moe, self.expert_parallel, self.use_triton = moe, expert_parallel, use_triton

    def mlp(self, cfg: ModelConfig, layer_idx: int, prefix: str) -> nn.Module:
        if not self.moe.is_sparse(layer_idx):
            return super().mlp(cfg, layer_idx, prefix)
        return SparseMoeBlock(cfg, self.moe, self.base, self.expert_parallel, self.use_triton, prefix)
