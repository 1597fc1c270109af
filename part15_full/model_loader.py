"""The model registry: a checkpoint's `architectures` entry picks how its model is built and how its
tensors' names map onto our modules.

Dense models are shared/models/registry.py's (Llama, Mistral, Qwen2 and 3, Gemma 2 and 3, Phi-3,
SmolLM3), as in every part before. Mixtral, Qwen2-MoE and Qwen3-MoE are the dense model of their
attention family with an MoE block in place of the MLP (moe_layers.py), and their expert tensors,
stored one per expert and projection, are stacked into FusedMoE's two parameters.

In vLLM: vllm/model_executor/models/registry.py (architecture -> class), mixtral.py, qwen2_moe.py
and qwen3_moe.py (their `load_weights` and expert_params_mapping)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from shared.model import LayerFactory, LlamaForCausalLM
from shared.models.registry import MODEL_REGISTRY, get_model_class
from shared.weights import load_model

from .moe_config import MoEConfig, load_configs
from .moe_layers import MoELayers


@dataclass(frozen=True)
class MoEFormat:
    block: str  # the checkpoint's name of the MoE block ("block_sparse_moe" or "mlp")
    projections: dict[str, str]  # the checkpoint's name of an expert projection -> w1 (gate), w3 (up), w2 (down)
    attention: str  # the dense architecture whose model (attention, norms) it is


_QWEN_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": MoEFormat("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}, "MistralForCausalLM"),
    "Qwen2MoeForCausalLM": MoEFormat("mlp", _QWEN_EXPERTS, "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": MoEFormat("mlp", _QWEN_EXPERTS, "Qwen3ForCausalLM"),
}


def architecture(path: Path) -> str:
    archs = json.loads((path / "config.json").read_text()).get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in MOE_ARCHITECTURES:
        get_model_class(archs[0], extra=tuple(MOE_ARCHITECTURES))  # or a ValueError naming what is supported
    return archs[0]


def get_model(path: Path, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
              load_format: str = "auto", layers: LayerFactory | None = None, expert_parallel: bool = False,
              use_triton: bool = False) -> LlamaForCausalLM:
    """The checkpoint's model, built through `layers` (dense by default, or a rank's tensor-parallel
    layers); an MoE family gets MoE blocks over them."""
    arch = architecture(path)
    cfg, moe = load_configs(path)
    if arch in MODEL_REGISTRY:
        return load_model(path, device, dtype, max_positions, load_format, layers, cfg)
    fmt = MOE_ARCHITECTURES[arch]
    return load_model(path, device, dtype, max_positions, load_format,
                      MoELayers(moe, layers or LayerFactory(), expert_parallel, use_triton), cfg,
                      lambda model, weights: load_moe_weights(model, weights, fmt, moe),
                      model_class=get_model_class(fmt.attention))


def load_moe_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], fmt: MoEFormat,
                     moe: MoEConfig) -> set[str]:
    """Expert tensors into the stacked parameters; the router under our name `mlp.gate`; the rest
    (attention, norms, dense MLPs, the shared expert) through the shared model's own loader."""
    params = dict(model.named_parameters())
    expert = re.compile(rf"layers\.(\d+)\.{fmt.block}\.experts\.(\d+)\.(\w+)\.weight$")
    got: dict[str, int] = {}

    def rest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = expert.search(name)
            if m:
                layer, e, which = int(m[1]), int(m[2]), fmt.projections[m[3]]
                if not model.start_layer <= layer < model.end_layer:
                    continue  # another pipeline stage's (part 15)
                key = f"layers.{layer}.mlp.experts.{'w2' if which == 'w2' else 'w13'}_weight"
                param = params[key]
                param.weight_loader(param, tensor, (e, which))
                got[key] = got.get(key, 0) + 1
                continue
            yield name.replace(f".{fmt.block}.gate.", ".mlp.gate."), tensor

    loaded = model.load_weights(rest())
    # A stacked parameter is loaded when every expert's every projection was seen.
    loaded |= {k for k, n in got.items() if n == moe.num_experts * (1 if k.endswith("w2_weight") else 2)}
    return loaded
