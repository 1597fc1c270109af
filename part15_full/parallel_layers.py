"""Megatron-style tensor-parallel layers, handed to the model through shared.model.LayerFactory.

Each of N ranks holds 1/N of every large weight and computes 1/N of every large matmul:

* Column-parallel (q/k/v, gate/up): the *output* features are split. Rank r computes its own
  attention heads and its own slice of the MLP's intermediate features, with no communication.
* Row-parallel (o_proj, down_proj): the *input* features are split, matching the column split
  before it, so each rank multiplies the slice it already holds and an all-reduce sums the N
  partial results. One attention block and one MLP block cost one all-reduce each.
* Vocabulary-parallel embedding and LM head: each rank holds a range of the vocabulary. The
  embedding looks up the ids in its range (zeros elsewhere) and an all-reduce combines them; the
  head computes its range of the logits and an all-gather assembles the row where sampling happens.

GQA: the query heads are split across ranks; the KV heads too, or, when N exceeds their number,
each KV head is replicated on the N / num_kv_heads ranks whose query heads read it.

Each rank loads only its own slices: the weight loaders narrow the checkpoint's tensors along each
parameter's output or input dim (its attributes, see shared/layers.py), whatever its format.

In vLLM: vllm/model_executor/layers/linear.py (ColumnParallelLinear, MergedColumnParallelLinear,
QKVParallelLinear, RowParallelLinear) and vocab_parallel_embedding.py."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared.config import ModelConfig
from shared.layers import (LMHead, Linear, MergedLinear, QKVLinear, QuantizationConfig, VocabEmbedding,
                           default_weight_loader, packed_factor)
from shared.model import LayerFactory

from .parallel_state import get_tp_group


def shard(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(first index, count) of rank's equal share of n."""
    if n % size:
        raise ValueError(f"{what} ({n}) must divide by the tensor-parallel size ({size})")
    part = n // size
    return rank * part, part


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse, before any process starts, a TP size the model's shapes cannot be split by."""
    shard(cfg.num_attention_heads, 0, size, "query heads")
    shard(cfg.intermediate_size, 0, size, "the MLP's intermediate size")
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"the tensor-parallel size ({size}) must divide or be a multiple of the "
                         f"number of KV heads ({kv})")


def _narrow_to_rank(param, loaded: torch.Tensor, dim_attr: str, rank: int, dst: torch.Tensor | None = None):
    """This rank's slice of a checkpoint tensor along the parameter's output or input dim: as many
    elements as the parameter (or its slice `dst`) holds there, starting at rank times that. The
    sizes are the parameter's own, packed or not (eight int4 values per int32, one scale per group),
    so one rule shards every format."""
    dim = getattr(param, dim_attr, None)
    if dim is None:  # whole on every rank (a row-parallel bias, a shared group index)
        return loaded
    n = (param if dst is None else dst).shape[dim]
    return loaded.narrow(dim, rank * n, n)


class ColumnParallelLinear(Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool, rank: int, size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        self.rank = rank
        part = shard(output_size, rank, size, "output features")[1]
        super().__init__(input_size, output_size, bias, quant_config, prefix, output_partition_sizes=[part])

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, _narrow_to_rank(param, loaded, "output_dim", self.rank))


class MergedColumnParallelLinear(MergedLinear):
    """gate and up, each split: a rank holds [its slice of gate; its slice of up]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, rank: int, size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        self.rank = rank
        local = [shard(n, rank, size, "output features")[1] for n in output_sizes]
        super().__init__(input_size, output_sizes, bias, quant_config, prefix, output_partition_sizes=local)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dst = self.shard_of(param, shard_id)
        default_weight_loader(dst, _narrow_to_rank(param, loaded, "output_dim", self.rank, dst))


class QKVParallelLinear(QKVLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 rank: int, size: int, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        self.q_first, q_local = shard(num_heads, rank, size, "query heads")
        if num_kv_heads >= size:
            self.kv_first, kv_local = shard(num_kv_heads, rank, size, "KV heads")
        elif size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size ({size}) must divide or be a multiple of the "
                             f"number of KV heads ({num_kv_heads})")
        else:  # replicated: ranks r with the same r // (size / kv) share KV head r // (size / kv)
            self.kv_first, kv_local = rank // (size // num_kv_heads), 1
        self.head_dim = head_dim
        super().__init__(hidden, head_dim, num_heads, num_kv_heads, bias, quant_config, prefix,
                         local_heads=(q_local, kv_local))

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dst = self.shard_of(param, shard_id)
        dim = getattr(param, "output_dim", None)
        if dim is not None:  # this rank's first head of the projection, in the parameter's units
            first = (self.q_first if shard_id == "q" else self.kv_first) * self.head_dim
            loaded = loaded.narrow(dim, first // packed_factor(param, dim), dst.shape[dim])
        default_weight_loader(dst, loaded)


class RowParallelLinear(Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool, rank: int, size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        self.rank = rank
        part = shard(input_size, rank, size, "input features")[1]
        super().__init__(input_size, output_size, bias, quant_config, prefix, input_size_per_partition=part)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        # The bias has no input dim: it is whole on every rank and added once, after the sum.
        default_weight_loader(param, _narrow_to_rank(param, loaded, "input_dim", self.rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        dist.all_reduce(out, group=get_tp_group())
        return out if self.bias is None else out + self.bias


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's range of the vocabulary: equal shares, the last one padded when `size` does not
    divide `vocab` (its padding rows stay zero and their logits are cut off)."""
    part = -(-vocab // size)
    return rank * part, part


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, vocab: int, hidden: int, rank: int, size: int):
        self.start, self.part = vocab_range(vocab, rank, size)
        super().__init__(self.part, hidden)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        rows = loaded[self.start:self.start + self.part]
        param.data.zero_()
        default_weight_loader(param.data[:len(rows)], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.part)
        out = F.embedding(local.clamp(0, self.part - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        dist.all_reduce(out, group=get_tp_group())
        return out


class ParallelLMHead(LMHead):
    def __init__(self, hidden: int, vocab: int, rank: int, size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = "lm_head"):
        self.vocab, self.size = vocab, size
        self.start, part = vocab_range(vocab, rank, size)
        super().__init__(hidden, vocab, quant_config, prefix, output_partition_sizes=[part])

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dim = param.output_dim
        rows = loaded.narrow(dim, self.start, max(0, min(param.shape[dim], loaded.shape[dim] - self.start)))
        param.data.zero_()
        default_weight_loader(param.data.narrow(dim, 0, rows.shape[dim]), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.quant_method.apply(self, x)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=get_tp_group())
        return torch.cat(parts, dim=-1)[..., :self.vocab]


class TensorParallelLayers(LayerFactory):
    """The model's layers as rank `rank` of `size` holds them. The attention and MLP code is
    shared/model.py's, unchanged: a sharded qkv layer simply carries fewer heads. The loaders shard
    every parameter by its attributes (output_dim, input_dim), so a quantized format (part 14) needs
    no class of its own here."""

    def __init__(self, rank: int, size: int, quant_config: QuantizationConfig | None = None):
        super().__init__(quant_config)
        self.tp_rank, self.tp_size = rank, size

    def qkv_proj(self, cfg: ModelConfig, prefix: str) -> QKVParallelLinear:
        return QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                 cfg.qkv_bias, self.tp_rank, self.tp_size, self.quant_config, prefix)

    def o_proj(self, cfg: ModelConfig, prefix: str) -> RowParallelLinear:
        return RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias,
                                 self.tp_rank, self.tp_size, self.quant_config, prefix)

    def gate_up_proj(self, cfg: ModelConfig, prefix: str) -> MergedColumnParallelLinear:
        return MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias,
                                          self.tp_rank, self.tp_size, self.quant_config, prefix)

    def down_proj(self, cfg: ModelConfig, prefix: str) -> RowParallelLinear:
        return RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, self.tp_rank, self.tp_size,
                                 self.quant_config, prefix)

    def embed_tokens(self, cfg: ModelConfig, prefix: str) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp_rank, self.tp_size)

    def lm_head(self, cfg: ModelConfig, prefix: str) -> ParallelLMHead:
        return ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.tp_rank, self.tp_size, self.quant_config, prefix)
