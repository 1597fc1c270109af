"""The experts of one MoE layer, stacked (vLLM's FusedMoE shape), and the three ways to run them.

Every expert is a SwiGLU MLP. Its weights are stacked into two tensors, so one layer's experts are
two parameters, not 3 x E modules:

    w13 [E, 2 * I, H]   each expert's gate and up projections, one above the other
    w2  [E, H, I]       each expert's down projection

A token goes to the top-k experts of its router; its output is the router-weighted sum of theirs:

    out[t] = sum_j  weight[t, j] * expert_{id[t, j]}(x[t])

* One process (`ep_size == 1`): for each expert, gather the tokens routed to it, run the expert
  on them as one matrix product, scatter the weighted results back (`experts_reference`; on CUDA the
  Triton grouped kernel in moe_kernels.py does the same in two launches).
* Tensor parallel (part 09's ranks, no `--enable-expert-parallel`): every rank holds every expert,
  each sliced along I (column-parallel w13, row-parallel w2), so each rank computes a partial sum
  for every token and one all-reduce completes it.
* Expert parallel: rank r holds whole experts, a contiguous range of them (the expert map). The
  tokens are replicated on every rank after the attention's all-reduce, so each rank takes a slice
  of them, and: counts how many (token, expert) pairs go to each rank, exchanges the counts,
  sends each pair's activation to the expert's rank (`all_to_all_single` with those uneven splits:
  the **dispatch**), computes its experts on what it received, sends the results back the same way
  (the **combine**), weights and sums them per token, and an all-gather returns every token's output
  to every rank. A rank with no token, or no pair for some rank, still joins every collective with
  empty splits: a collective that one rank skips waits forever.

The experts' parameters are created by the layer's quantize method (dense: UnquantizedFusedMoEMethod),
as the linear layers' are, so part 14 can store experts in fewer bits without a new layer.

In vLLM: vllm/model_executor/layers/fused_moe/layer.py (FusedMoE, expert_map, weight_loader),
fused_moe.py (the Triton path), and the all2all managers in vllm/distributed/device_communicators/."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shared.layers import (QuantizationConfig, QuantizeMethodBase, default_weight_loader,
                           set_weight_attrs)

from .parallel_state import get_tp_group


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): softmax over the experts in fp32, then the top k
    (torch.topk, as the HF models do, so a tie between experts resolves the same way), renormalised
    to sum to 1 when the checkpoint says so."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """The expert map: rank r holds experts [first, first + count), contiguous, as even as can be."""
    first, last = rank * num_experts // size, (rank + 1) * num_experts // size
    return first, last - first


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor | None) -> torch.Tensor:
    """Rows x [N, H] each for expert ids[n] (a local index, one per row, or [N, k] of them): for
    each expert, its rows in one matmul. Returns [N, H], weighted by `weights` when given."""
    if ids.dim() == 1:
        ids, weights = ids[:, None], None if weights is None else weights[:, None]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]).float()
        if weights is not None:
            y = y * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    return out.to(x.dtype)


class FusedMoEMethodBase(QuantizeMethodBase):
    """How one MoE layer's stacked experts are held and run (dense here; part 14 quantizes them
    through the same two calls)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, weight_loader) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor | None) -> torch.Tensor:
        """Rows x [N, H] through this rank's experts `ids` (local indices, [N] or [N, k]), weighted."""
        raise NotImplementedError


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader) -> None:
        i = intermediate_size_per_partition
        for name, shape in (("w13_weight", (num_experts, 2 * i, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, i))):
            param = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": weight_loader})
            layer.register_parameter(name, param)

    def apply(self, layer, x, ids, weights):
        if layer.use_triton and x.is_cuda:
            from .moe_kernels import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, ids if ids.dim() == 2 else ids[:, None],
                                 weights if weights is None or weights.dim() == 2 else weights[:, None])
        return experts_reference(x, layer.w13_weight, layer.w2_weight, ids, weights)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 rank: int = 0, size: int = 1, expert_parallel: bool = False, use_triton: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.rank, self.size, self.use_triton, self.prefix = rank, size, use_triton, prefix
        self.expert_parallel = expert_parallel and size > 1
        if self.expert_parallel:
            if num_experts < size:
                raise ValueError(f"expert parallelism over {size} ranks needs at least {size} experts")
            self.first_expert, local = expert_range(num_experts, rank, size)
            self.i_start, i_local = 0, intermediate
        else:  # every expert, sliced along its intermediate size (size 1: whole)
            if intermediate % size:
                raise ValueError(f"the experts' intermediate size ({intermediate}) must divide by {size}")
            self.first_expert, local = 0, num_experts
            self.i_start, i_local = rank * intermediate // size, intermediate // size
        self.num_local_experts, self.intermediate_per_partition = local, i_local
        self.quant_method = (quant_config.get_quant_method(self, prefix) if quant_config else None) \
            or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, local, hidden, i_local, torch.get_default_dtype(), self.weight_loader)
        # Counters since the last reset: (token, expert) pairs this rank's experts computed, per
        # local expert, and the bytes this rank sent in all-to-alls.
        self.register_buffer("tokens_per_expert", torch.zeros(local, dtype=torch.long), persistent=False)
        self.all_to_all_bytes = 0
        # Each rank's first expert: bucketize maps a pair's expert to the rank holding it.
        starts = [expert_range(num_experts, r, size)[0] for r in range(size)]
        self.register_buffer("rank_starts", torch.tensor(starts), persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """shard_id = (expert, "w1" | "w3" | "w2"): one expert's gate (w1), up (w3) or down (w2)
        projection, as checkpoints store them. Experts of other ranks are skipped."""
        expert, which = shard_id
        e = expert - self.first_expert
        if not 0 <= e < self.num_local_experts:
            return
        i_local = self.intermediate_per_partition
        if which == "w2":
            default_weight_loader(param.data[e], loaded.narrow(1, self.i_start, i_local))
        else:
            half = 0 if which == "w1" else i_local
            default_weight_loader(param.data[e, half:half + i_local], loaded.narrow(0, self.i_start, i_local))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.expert_parallel:
            return self._expert_parallel(x, weights, ids)
        out = self._local(x, ids, weights)
        if self.size > 1:  # partial sums over each rank's slice of every expert
            dist.all_reduce(out, group=get_tp_group())
        return out

    def _local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """Run this rank's experts on rows x, ids being local expert indices."""
        # A scatter, not bincount: bincount reads the largest id on the host to size its result. (Under
        # a CUDA graph the count includes the padding rows' pairs.)
        flat = ids.flatten()
        self.tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        return self.quant_method.apply(self, x, ids, weights)

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, size = x.shape[0], self.size
        per_rank = -(-t // size)  # this rank's slice of the (replicated) tokens
        lo, hi = min(self.rank * per_rank, t), min((self.rank + 1) * per_rank, t)
        # The (token, slot) pairs of the slice, grouped by the rank that holds their expert.
        pair_ids = ids[lo:hi].flatten()
        owner = torch.bucketize(pair_ids, self.rank_starts, right=True) - 1
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=get_tp_group())
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = torch.div(order, self.top_k, rounding_mode="floor") + lo
        # Dispatch: each pair's activation and its expert id travel to the expert's rank.
        x_in = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(x_in, x[rows].contiguous(), recv, send, group=get_tp_group())
        e_in = pair_ids.new_empty(sum(recv))
        dist.all_to_all_single(e_in, pair_ids[order].contiguous(), recv, send, group=get_tp_group())
        y = self._local(x_in, e_in - self.first_expert, None)
        # Combine: the results go back where they came from, in the order they were sent.
        y_back = y.new_empty(sum(send), y.shape[1])
        dist.all_to_all_single(y_back, y.contiguous(), send, recv, group=get_tp_group())
        self.all_to_all_bytes += (sum(send) * x.shape[1] + sum(recv) * y.shape[1]) * x.element_size()
        out = torch.zeros(per_rank, x.shape[1], dtype=torch.float32, device=x.device)
        w = weights[lo:hi].flatten()[order]
        out.index_add_(0, rows - lo, y_back.float() * w[:, None])
        gathered = [torch.empty_like(out) for _ in range(size)]
        dist.all_gather(gathered, out, group=get_tp_group())
        return torch.cat(gathered)[:t].to(x.dtype)
