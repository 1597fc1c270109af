"""`--quantization int8|int4`: quantize a float checkpoint's weights as it loads ("online"), and
find the GPTQ checkpoints that come quantized.

Which layers: every linear projection of the decoder (q/k/v, o, gate/up, down, an MoE layer's
experts and its shared expert). They hold nearly all the weights and their matmuls dominate a
decode step. Not: the embedding (a row lookup, no matmul to speed up), the norms (tiny, and
sensitive), the MoE router (small; its top-k choice flips on small errors), and by default the LM
head, whose error lands directly on the logits (`quantize_lm_head=True` quantizes it). A tied head
*is* the embedding's matrix and is never quantized.

Online methods create the same float weight as the unquantized method, so any checkpoint (and
part 09's sharded loaders) fill it unchanged; `process_weights_after_loading` rounds it (symmetric,
per output channel for int8, per group of `group_size` inputs for int4, quant_utils.py) and
replaces it with the packed weight in the layout of the device's kernel (quant_kernels.py). With
`--load-format dummy` they quantize the random float weights. The float weights exist until then:
loading peaks at the float model's size, serving holds the quantized one.

In vLLM: vllm/model_executor/layers/quantization/base_config.py (QuantizationConfig,
QuantizeMethodBase), quantization/__init__.py (the method names), config/quantization.py (its
online int8 shorthand is for MoE experts only; this course quantizes the linear layers too),
compressed_tensors/schemes/compressed_tensors_wNa16.py (the same int4/int8 weight-only scheme
loaded from a checkpoint), model_loader/weight_utils.py (get_quant_config)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fused_moe import FusedMoE, FusedMoEMethodBase, UnquantizedFusedMoEMethod
from shared.config import ModelConfig
from shared.layers import LMHead, Linear, LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod

from .config import QUANTIZATION_METHODS
from .gptq import GPTQConfig
from .quant_kernels import apply_wna16, use_quantized_weight
from .quant_utils import dequantize, pack_int4, quantize_symmetric, unpack_int4

DEFAULT_GROUP_SIZE = 128
_ROUTERS = (".mlp.gate", ".shared_expert_gate")  # MoE routing layers stay in the model's dtype


class WeightOnlyConfig(QuantizationConfig):
    """Online symmetric weight-only quantization; `group_size` None: per output channel."""
    bits: int

    def __init__(self, group_size: int | None, quantize_lm_head: bool = False, tie_word_embeddings: bool = False):
        self.group_size, self.quantize_lm_head = group_size, quantize_lm_head
        self.tie_word_embeddings = tie_word_embeddings

    def get_name(self) -> str:
        return f"int{self.bits}"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LMHead) or prefix.endswith("lm_head"):
            if not self.quantize_lm_head or self.tie_word_embeddings:
                return None
        if prefix.endswith(_ROUTERS):
            return None
        if isinstance(layer, Linear):
            return OnlineWNA16LinearMethod(self)
        if isinstance(layer, FusedMoE):
            return OnlineWNA16MoEMethod(self)
        return None

    def check_inputs(self, where: str, input_size: int, input_size_per_partition: int) -> None:
        """Refuse, when the layer is built, a tensor-parallel shard boundary inside a group: the ranks'
        groups would not be the single process's. (Inputs that end inside a group are fine: the last
        group is padded with zero weights, `padding`.)"""
        g = self.group_size
        if g is None or input_size_per_partition == input_size:
            return
        if input_size_per_partition % g:
            raise ValueError(f"{where}: this process holds {input_size_per_partition} of the {input_size} "
                             f"inputs, which splits a quantization group of {g}: a tensor-parallel shard "
                             f"boundary must fall on a group boundary")


def padding(k: int, group_size: int | None) -> int:
    """Zero inputs that fill the last group of k inputs (SmolLM2's 576 is 4.5 groups of 128)."""
    return (-k) % group_size if group_size else 0


class Int8WeightOnlyConfig(WeightOnlyConfig):
    bits = 8

    def __init__(self, quantize_lm_head: bool = False, tie_word_embeddings: bool = False):
        super().__init__(None, quantize_lm_head, tie_word_embeddings)


class Int4WeightOnlyConfig(WeightOnlyConfig):
    bits = 4

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, quantize_lm_head: bool = False,
                 tie_word_embeddings: bool = False):
        super().__init__(group_size, quantize_lm_head, tie_word_embeddings)


class OnlineWNA16LinearMethod(LinearMethodBase):
    def __init__(self, config: WeightOnlyConfig):
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader) -> None:
        self.config.check_inputs(getattr(layer, "prefix", "") or "a linear layer", input_size,
                                 input_size_per_partition)
        UnquantizedLinearMethod().create_weights(layer, input_size_per_partition, output_partition_sizes,
                                                 input_size, output_size, params_dtype, weight_loader)
        layer.float_weight_id = id(layer.weight)  # to notice a head tied after creation

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if id(layer.weight) != layer.float_weight_id:
            raise RuntimeError(f"{layer.prefix}: its weight was replaced after creation (a tied LM head?); "
                               f"build the config with tie_word_embeddings=True so it stays unquantized")
        w = layer.weight.data
        pad = padding(w.shape[1], self.config.group_size)
        qw = quantize_symmetric(F.pad(w, (0, pad)), self.config.bits, self.config.group_size, scale_dtype=w.dtype)
        delattr(layer, "weight")
        use_quantized_weight(layer, qw, pad=pad)

    def apply(self, layer, x, bias=None):
        return apply_wna16(layer, x, bias)


class OnlineWNA16MoEMethod(FusedMoEMethodBase):
    """Stacked experts quantized per expert row (per channel, or per group along each input),
    held as int8 values or int4 nibble pairs; `apply` dequantizes the experts a batch uses."""

    def __init__(self, config: WeightOnlyConfig):
        self.config = config

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader) -> None:
        where = getattr(layer, "prefix", "") or "an MoE layer"
        self.config.check_inputs(f"{where} (gate/up)", hidden_size, hidden_size)
        # Under tensor parallelism (not expert parallelism) each rank holds a slice of I: down's inputs.
        slices = 1 if getattr(layer, "expert_parallel", False) else getattr(layer, "size", 1)
        self.config.check_inputs(f"{where} (down)", intermediate_size_per_partition * slices,
                                 intermediate_size_per_partition)
        UnquantizedFusedMoEMethod().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                                   params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data  # [E, out, in]
            e, n, k = w.shape
            pad = padding(k, self.config.group_size)
            setattr(layer, f"{name}_pad", pad)
            qw = quantize_symmetric(F.pad(w.reshape(e * n, k), (0, pad)), self.config.bits, self.config.group_size,
                                    w.dtype)
            q = qw.q.reshape(e, n, k + pad)
            delattr(layer, f"{name}_weight")
            for suffix, value in (("qweight", pack_int4(q) if self.config.bits == 4 else q),
                                  ("scales", qw.scales.reshape(e, n, -1))):
                layer.register_parameter(f"{name}_{suffix}", nn.Parameter(value, requires_grad=False))

    def expert_weight(self, layer: nn.Module, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        q = getattr(layer, f"{name}_qweight")[e]
        w = dequantize(unpack_int4(q) if self.config.bits == 4 else q, getattr(layer, f"{name}_scales")[e], dtype)
        pad = getattr(layer, f"{name}_pad")
        return w[:, :w.shape[1] - pad] if pad else w

    def apply(self, layer, x, ids, weights):
        if ids.dim() == 1:
            ids, weights = ids[:, None], None if weights is None else weights[:, None]
        out = torch.zeros(x.shape[0], layer.w2_scales.shape[1], dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.expert_weight(layer, "w13", e, x.dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.expert_weight(layer, "w2", e, x.dtype)).float()
            if weights is not None:
                y = y * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out.to(x.dtype)


def checkpoint_quant_config(path: Path) -> dict[str, Any] | None:
    """The checkpoint's own quantization: config.json's `quantization_config`, or a GPTQ
    quantize_config.json beside it; None for a float checkpoint."""
    config = path / "config.json"
    if config.exists():
        found = json.loads(config.read_text()).get("quantization_config")
        if found:
            return found
    for name in GPTQConfig.get_config_filenames():
        if (path / name).exists():
            return {"quant_method": "gptq", **json.loads((path / name).read_text())}
    return None


def get_quant_config(quantization: str | None, path: Path | None, cfg: ModelConfig,
                     group_size: int = DEFAULT_GROUP_SIZE, quantize_lm_head: bool = False) -> QuantizationConfig | None:
    """The config for `--quantization` (None, int8, int4, gptq) and the checkpoint at `path`: a
    GPTQ checkpoint loads as GPTQ whatever is asked (except another method: refused)."""
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    found = checkpoint_quant_config(path) if path is not None else None
    tied = cfg.tie_word_embeddings
    if found is not None:
        method = found.get("quant_method", "gptq")
        if method != "gptq":
            raise ValueError(f"checkpoint {path} is quantized with {method!r}; only GPTQ checkpoints load")
        if quantization not in (None, "gptq"):
            raise ValueError(f"checkpoint {path} is already quantized (GPTQ); --quantization {quantization} "
                             f"quantizes a float checkpoint")
        return GPTQConfig.from_config(found, tie_word_embeddings=tied)
    if quantization == "gptq":
        raise ValueError(f"--quantization gptq: {path} has no GPTQ quantization_config")
    if quantization == "int8":
        return Int8WeightOnlyConfig(quantize_lm_head, tied)
    if quantization == "int4":
        return Int4WeightOnlyConfig(group_size, quantize_lm_head, tied)
    return None
