"""Building blocks of the decoder. The model builds its projections, embedding and head through a
`LayerFactory` (model.py), so tensor-parallel, expert and quantized layers (later parts) can
replace them without touching the model definition."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import envs
from .rotary_embedding import RotaryEmbedding  # noqa: F401 (the model's layers, from one module)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Tell the loaders how a parameter lies: `output_dim` / `input_dim` (which of its dims runs
    along the layer's output and input features, or None), `packed_dim` and `packed_factor` (a dim
    that stores `packed_factor` values per element, e.g. eight 4-bit weights per int32), and its
    `weight_loader`. Tensor-parallel layers shard any parameter by these, whatever its format."""
    for key, value in attrs.items():
        setattr(param, key, value)


def packed_factor(param: nn.Parameter, dim: int) -> int:
    """How many logical values one element of `param` holds along `dim` (1 unless packed there)."""
    return getattr(param, "packed_factor", 1) if getattr(param, "packed_dim", None) == dim else 1


class QuantizeMethodBase:
    """How a layer creates, prepares and uses its weights. The layer owns the parameters; the method
    decides their format. Part 14 swaps in quantized formats; everything else sees one interface."""

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded (quantize, repack for a kernel, ...)."""


class LinearMethodBase(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable) -> None:
        """Register the layer's weight parameters for its share of the features (all of them
        without tensor parallelism), each with its attributes (set_weight_attrs)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


# CPU GEMMs on weights prepacked for oneDNN (the off-switch: VLLM_COURSE_CPU_PREPACK=0, shared/envs.py). A plain
# F.linear re-lays-out the weight for the GEMM kernel on every call; at decode, a few rows against
# a large weight, that costs as much as the multiply. Measured on a 2-core AVX2 EPYC (SmolLM2-135M's
# shapes): the 30 layers' projections 1.8-2.1x faster at 2-8 rows, 1.24x at 32, even from 64 on
# (0.85x at one row); the 49152-wide LM head 1.8-4.4x. In bf16 on a 2-core AVX512-BF16 EPYC: the
# projections 1.4-2.0x at 1-8 rows, 0.9-1.2x from 32 on, the LM head 1.2-1.9x. Every row count
# takes the packed path: its result for a row does not depend on how many rows come with it, where
# F.linear's single-row kernel rounds differently from its batched one, so the same request would
# sample differently alone and in a batch. (Not in bf16 on a CPU with AMX: there oneDNN's packed and
# unpacked bf16 kernels alike change with the row count, and a few sums' last bits with them;
# part 15's own AMX kernel, cpu_gemm_amx.py, keeps a row's result whatever its batch.)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX. (oneDNN's own check, `_is_mkldnn_bf16_supported`, also says yes on plain
    AVX-512, where it emulates bf16; there, on a Cascade Lake Xeon, its packed bf16 GEMM gave a row
    a different result alone than beside another row.)"""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_prepack_supported(weight: torch.Tensor) -> bool:
    """fp32; bf16 only where the CPU multiplies bf16 natively: elsewhere oneDNN emulates it, and
    the packed path has not been measured to pay nor kept a row's result batch-invariant."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_has_native_bf16())


class UnquantizedLinearMethod(LinearMethodBase):
    """The default: one dense weight [out, in] in the model's dtype; on a CPU also a copy of it
    prepacked for oneDNN's GEMM (`layer.packed_weight`, built once after loading), which every call
    uses. The dense weight stays the parameter (loaders, tied embeddings and tests read it): a
    change to it after loading must call process_weights_after_loading again."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader) -> None:
        weight = _param(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = None
        if envs.VLLM_COURSE_CPU_PREPACK and cpu_prepack_supported(layer.weight):
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)

    def apply(self, layer, x, bias=None):
        packed = getattr(layer, "packed_weight", None)
        # torch.compile traces F.linear (Inductor packs weights itself); an opaque packed tensor
        # cannot be traced.
        if packed is not None and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, layer.weight, bias)


class QuantizationConfig:
    """Which quantize method each layer gets, by the layer's kind and its `prefix` (its dotted name,
    e.g. "model.layers.3.mlp.down_proj"), so a checkpoint can leave some layers unquantized."""

    def get_name(self) -> str:
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """None: the layer keeps its unquantized default."""
        raise NotImplementedError


class Linear(nn.Module):
    """y = x W^T + b, computed by the layer's quantize method (dense by default). The base of every
    projection: subclasses change how many features this process holds and how weights load."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 input_size_per_partition: int | None = None, output_partition_sizes: list[int] | None = None):
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.input_size_per_partition = input_size if input_size_per_partition is None else input_size_per_partition
        self.output_partition_sizes = output_partition_sizes or [output_size]
        self.quant_method = (quant_config.get_quant_method(self, prefix) if quant_config else None) \
            or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes,
                                         input_size, output_size, torch.get_default_dtype(), self.weight_loader)
        self.bias = None
        if bias:
            self.bias = _param(sum(self.output_partition_sizes))
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked into one matmul (gate+up, or q+k+v).
    Checkpoints store them apart; `shard_id` says which slice a loaded tensor fills."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 shard_names: list[Any] | None = None, **partition: Any):
        names = shard_names or list(range(len(output_sizes)))
        local = partition.get("output_partition_sizes") or output_sizes
        offsets = [0]
        for size in local:
            offsets.append(offsets[-1] + size)
        # Where each projection's rows lie in this process's parameters (logical output units).
        self.shards = {n: (offsets[i], local[i]) for i, n in enumerate(names)}
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix,
                         output_partition_sizes=list(local), **{k: v for k, v in partition.items()
                                                                if k != "output_partition_sizes"})

    def shard_of(self, param: nn.Parameter, shard_id: Any) -> torch.Tensor:
        """The slice of `param` that holds projection `shard_id` (its whole self for a parameter
        without an output dim, such as a group index shared by the projections)."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            return param.data
        start, size = self.shards[shard_id]
        factor = packed_factor(param, dim)
        return param.data.narrow(dim, start // factor, size // factor)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        default_weight_loader(self.shard_of(param, shard_id), loaded)


class QKVLinear(MergedLinear):
    """q, k and v of every head in one matmul. `local_heads` (query, KV): the heads this process
    holds, when tensor parallelism gives it a share of them (default: all)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 local_heads: tuple[int, int] | None = None, **partition: Any):
        self.num_heads, self.num_kv_heads = local_heads or (num_heads, num_kv_heads)
        self.output_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, quant_config, prefix, shard_names=["q", "k", "v"],
                         output_partition_sizes=self.output_sizes, **partition)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "lm_head", **partition: Any):
        super().__init__(hidden_size, vocab_size, False, quant_config, prefix, **partition)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like the reference; with `residual` it first adds it (fused
    add+norm, as vLLM does) and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = _param(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up, with the tanh approximation when the config names
    gelu_pytorch_tanh."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
