"""Loading GPTQ checkpoints (AutoGPTQ / GPTQModel), 4- or 8-bit symmetric.

GPTQ quantizes a trained model one layer at a time, choosing each weight's rounding so as to
minimise the error of that layer's *outputs* on a little calibration text (second-order
information, the inverse Hessian of the layer's inputs), instead of rounding every weight to its
nearest level as online quantization does. What it stores, though, is a plain grid: for a
symmetric checkpoint, w = (stored - 2^(bits-1)) * scale per group, in the int32 layout described in
quant_utils.py (qweight packed along K, scales, qzeros, g_idx). So serving it needs only the same
dequantizing matmul as online int4/int8 (quant_kernels.py).

`GPTQLinearMethod.create_weights` registers the checkpoint's four tensors with their layout
attributes, so the shared loaders fill them unchanged: q/k/v and gate/up slices land in the merged
parameters by `output_dim` (qzeros, packed along N, slice by `packed_factor`), and part 09's
tensor-parallel loaders shard them by `output_dim` / `input_dim` with no class of their own. A
row-parallel shard must hold whole groups, and a packed int32 word must not straddle two shards;
both are checked when the layer is built. After loading, the weight moves into the layout of the
device's kernel. Refused: `desc_act=True` with groups, asymmetric zeros, per-module overrides.

In vLLM: vllm/model_executor/layers/quantization/auto_gptq.py (AutoGPTQConfig, v0.33),
gptq.py (GPTQConfig, GPTQLinearMethod, v0.11), utils/gptq_utils.py (the desc_act refusal)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fused_moe import FusedMoE
from shared.layers import LinearMethodBase, LMHead, Linear, QuantizationConfig, set_weight_attrs
from shared.weights import DUMMY_SEED

from .quant_kernels import apply_wna16, use_quantized_weight
from .quant_utils import gptq_unpack

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero minus one, v2 the zero itself


@dataclass
class GPTQConfig(QuantizationConfig):
    weight_bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool = False
    lm_head_quantized: bool = False
    checkpoint_format: str = "gptq"
    tie_word_embeddings: bool = False  # a tied head is the embedding: never quantized

    def __post_init__(self) -> None:
        if self.weight_bits not in (4, 8):
            raise ValueError(f"GPTQ with {self.weight_bits} bits is not supported (4 or 8)")
        if self.desc_act and self.group_size != -1:
            # vLLM's words (v0.33 utils/gptq_utils.py): act-order permutes the inputs, so a group's
            # rows are scattered over K and need g_idx gathers that its kernels no longer do.
            raise ValueError("GPTQ group activation ordering (desc_act=True) is no longer supported: "
                             "with groups, act-order scatters each group's inputs over K (g_idx)")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not one of {CHECKPOINT_FORMATS}")

    def get_name(self) -> str:
        return "gptq"

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any], tie_word_embeddings: bool = False) -> GPTQConfig:
        """From config.json's `quantization_config` or quantize_config.json."""
        if not config.get("sym", True):
            raise ValueError("asymmetric GPTQ (sym=false) is not supported: its per-group zero points "
                             "need a kernel that subtracts them; only symmetric 4/8-bit checkpoints load")
        if config.get("dynamic"):
            raise ValueError("GPTQModel per-module overrides (`dynamic`) are not supported")
        return cls(int(config["bits"]), int(config.get("group_size", -1)), bool(config.get("desc_act", False)),
                   bool(config.get("lm_head", False)), config.get("checkpoint_format", "gptq"),
                   tie_word_embeddings)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if isinstance(layer, LMHead) or prefix.endswith("lm_head"):
            return GPTQLinearMethod(self) if self.lm_head_quantized and not self.tie_word_embeddings else None
        if isinstance(layer, Linear):
            return GPTQLinearMethod(self)
        if isinstance(layer, FusedMoE):
            raise ValueError(f"{prefix}: GPTQ-quantized MoE experts are not supported (online int8/int4 are)")
        return None


def _tracking(loader):
    """The layer's weight loader, noting on the parameter that the checkpoint filled it (no call at
    all means `--load-format dummy`)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
        param.gptq_loaded = True
        loader(param, loaded, *shard)
    return load


class GPTQLinearMethod(LinearMethodBase):
    def __init__(self, config: GPTQConfig):
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader) -> None:
        bits, k = self.config.weight_bits, input_size_per_partition
        pack, where = 32 // bits, getattr(layer, "prefix", "") or "a GPTQ layer"
        grouped = self.config.group_size != -1
        group = self.config.group_size if grouped else input_size
        if input_size % group:
            raise ValueError(f"{where}: input size {input_size} is not a multiple of the group size {group}")
        if grouped and k % group:
            raise ValueError(f"{where}: this process holds {k} of the {input_size} inputs, which splits a "
                             f"quantization group of {group}: a tensor-parallel shard boundary must fall "
                             f"on a group boundary (use a smaller tensor-parallel size)")
        if k % pack or any(n % pack for n in output_partition_sizes):
            raise ValueError(f"{where}: {k} inputs / outputs {output_partition_sizes} do not fill whole int32 "
                             f"words of {pack} {bits}-bit values")
        n, groups = sum(output_partition_sizes), (k // group if grouped else 1)
        scale_input_dim = 0 if grouped else None  # one per-channel scale covers every rank's inputs
        loader = _tracking(weight_loader)
        for name, shape, dtype, attrs in (
                ("qweight", (k // pack, n), torch.int32, {"input_dim": 0, "output_dim": 1, "packed_dim": 0,
                                                          "packed_factor": pack}),
                ("g_idx", (k,), torch.int32, {"input_dim": 0}),
                ("qzeros", (groups, n // pack), torch.int32, {"input_dim": scale_input_dim, "output_dim": 1,
                                                              "packed_dim": 1, "packed_factor": pack}),
                ("scales", (groups, n), params_dtype, {"input_dim": scale_input_dim, "output_dim": 1})):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {**attrs, "weight_loader": loader})
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        if not getattr(layer.qweight, "gptq_loaded", False):
            self._fill_dummy(layer)
        k, groups = layer.g_idx.shape[0], layer.scales.shape[0]
        expect = layer.g_idx[:1] + torch.arange(k, device=layer.g_idx.device) // (k // groups)
        if not torch.equal(layer.g_idx, expect.to(layer.g_idx.dtype)):
            raise ValueError(f"{layer.prefix}: g_idx is not in input order (an act-order checkpoint?)")
        qw = gptq_unpack(layer.qweight.data, layer.qzeros.data, layer.scales.data, cfg.weight_bits,
                         cfg.checkpoint_format)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        use_quantized_weight(layer, qw)

    def _fill_dummy(self, layer: nn.Module) -> None:
        """`--load-format dummy`: random packed weights from a generator seeded by the layer's name
        (the scales are already random floats), the symmetric zero, groups in input order."""
        bits, fmt = self.config.weight_bits, self.config.checkpoint_format
        gen = torch.Generator().manual_seed(DUMMY_SEED + zlib.crc32(layer.prefix.encode()))
        layer.qweight.data.copy_(torch.randint(-2 ** 31, 2 ** 31, layer.qweight.shape, generator=gen,
                                               dtype=torch.int64).to(torch.int32))
        zero = 2 ** (bits - 1) - (1 if fmt == "gptq" else 0)
        word = sum(zero << (bits * i) for i in range(32 // bits))
        layer.qzeros.data.fill_(word - 2 ** 32 if word >= 2 ** 31 else word)
        k, groups = layer.g_idx.shape[0], layer.scales.shape[0]
        layer.g_idx.data.copy_(torch.arange(k, dtype=torch.int32) // (k // groups))

    def apply(self, layer, x, bias=None):
        return apply_wna16(layer, x, bias)
