"""What a mixture-of-experts checkpoint adds to a dense one, read from its HF config.

The attention of Mixtral is Mistral's, that of Qwen2-MoE Qwen2's and that of Qwen3-MoE Qwen3's, so
the shared ModelConfig describes them unchanged; MoEConfig holds the rest: how many experts, how many each token uses,
their size, whether the top-k weights are renormalised, the shared expert, which layers are
sparse."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelConfig
from shared.weights import generation_eos_token_ids, read_hf_config

# A MoE model's attention family: the dense model_type whose attention it has.
ATTENTION_OF = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


@dataclass(frozen=True)
class MoEConfig:
    model_type: str
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool  # divide the top-k weights by their sum (Mixtral always; Qwen2-MoE: norm_topk_prob)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Mixtral)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def check_divisible(self, size: int, expert_parallel: bool) -> None:
        """Refuse, before any process starts, a group size the experts cannot be spread over."""
        if expert_parallel and self.num_experts < size:
            raise ValueError(f"expert parallelism over {size} ranks needs at least as many experts "
                             f"({self.num_experts})")
        if not expert_parallel and self.moe_intermediate_size % size:
            raise ValueError(f"the experts' intermediate size ({self.moe_intermediate_size}) must divide by the "
                             f"tensor-parallel size ({size}), or use --enable-expert-parallel")
        if self.shared_expert_intermediate_size % size:
            raise ValueError(f"the shared expert's intermediate size ({self.shared_expert_intermediate_size}) "
                             f"must divide by the tensor-parallel size ({size})")

    @classmethod
    def from_hf(cls, hf) -> "MoEConfig":
        if hf.model_type == "mixtral":
            return cls("mixtral", hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, True)
        # Qwen2-MoE and Qwen3-MoE; Qwen3-MoE has no shared expert.
        return cls(hf.model_type, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                   bool(hf.norm_topk_prob), getattr(hf, "shared_expert_intermediate_size", 0) or 0,
                   hf.decoder_sparse_step, tuple(hf.mlp_only_layers or ()))


def load_configs(path: Path) -> tuple[ModelConfig, MoEConfig | None]:
    """(ModelConfig, MoEConfig or None for a dense model)."""
    eos = generation_eos_token_ids(path)

    def build(hf) -> tuple[ModelConfig, MoEConfig | None]:
        if hf.model_type not in ATTENTION_OF:
            return ModelConfig.from_hf(hf, eos_token_ids=eos), None
        dense = copy.copy(hf)
        dense.model_type = ATTENTION_OF[hf.model_type]
        return ModelConfig.from_hf(dense, eos_token_ids=eos), MoEConfig.from_hf(hf)

    return read_hf_config(path, build)
