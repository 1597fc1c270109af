"""The KV cache sized from the GPU's memory instead of a fixed budget.

Why. The KV pool is where a GPU's spare memory pays: every block more is more sequences in a batch
or more prefix cache. A fixed `--kv-cache-memory-mb` either wastes an H200's 141 GB or runs a
small GPU out of memory. vLLM takes a fraction of the device (`--gpu-memory-utilization`, 0.9 by
default) and gives the KV cache what is left of it once everything else is counted.

How. After the weights load and before the KV pool exists, `profile_kv_budget` runs one forward of
the largest step the engine can schedule (`max_num_batched_tokens` tokens, attention's output
zeros, since there is no cache yet) and the LM head over `max_num_seqs` rows, so the allocator's
peak holds the weights and the worst step's activations. The budget is then
`total x utilization - torch's peak - memory outside torch` (the CUDA context, NCCL, cuBLAS's
workspace), `kv_cache_budget_bytes`. The CUDA graphs captured afterwards take a little of the
remaining tenth; the log at capture says how much.

In vLLM v0.33.0: vllm/v1/worker/gpu_worker.py (Worker.determine_available_memory, profile_run)
and vllm/utils/mem_utils.py (memory_profiling)."""
from __future__ import annotations

import logging

import torch

from shared.forward_context import AttentionBackend, set_forward_context

logger = logging.getLogger(__name__)


def kv_cache_budget_bytes(total: int, utilization: float, torch_peak: int, non_torch: int) -> int:
    """What the KV cache may take: the engine's share of the device less what the profile used."""
    budget = int(total * utilization) - torch_peak - non_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:g} of {total / 2**30:.1f} GiB is "
            f"{total * utilization / 2**30:.1f} GiB, and the weights and a profiling step's activations peak at "
            f"{torch_peak / 2**30:.1f} GiB, with {non_torch / 2**30:.1f} GiB outside torch; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, or give --kv-cache-memory-mb")
    return budget


class _NoCache(AttentionBackend):
    """Attention during the profile: zeros (there is no KV cache yet), as vLLM's profile run."""

    def forward(self, layer_idx, q, k, v, metadata):
        return torch.zeros_like(q)


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, device: torch.device, max_tokens: int, max_seqs: int,
                      max_model_len: int, utilization: float) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
    positions = torch.arange(max_tokens, device=device) % max_model_len
    with set_forward_context(_NoCache(), None):
        hidden = model(ids, positions)
    model.compute_logits(hidden[:min(max_tokens, max_seqs)])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    del hidden
    torch.cuda.empty_cache()
    budget = kv_cache_budget_bytes(total, utilization, peak, max(non_torch, 0))
    logger.info("memory profile: %.2f GiB peak in torch (weights and a %d-token step), %.2f GiB outside torch; "
                "KV cache %.2f GiB (--gpu-memory-utilization %g of %.1f GiB)", peak / 2**30, max_tokens,
                non_torch / 2**30, budget / 2**30, utilization, total / 2**30)
    return budget


def min_over_ranks(budget: int, device: torch.device) -> int:
    """The smallest budget of the tensor-parallel group: every rank's pool holds the same blocks."""
    import torch.distributed as dist

    t = torch.tensor([budget], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
