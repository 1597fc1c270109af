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
workspace) - the CUDA graphs' pool, `kv_cache_budget_bytes`. The graphs are captured after the KV
pool exists (a FULL graph reads its address), into a pool of their own that the allocator's cache
cannot lend them: it holds the activations of the largest captured step (smaller ones reuse them,
graph outputs being weak references, cuda_graph.py), so the profile runs a forward of that size
too and sets its activations aside. The log at capture says what the graphs took.

In vLLM v0.33.0: vllm/v1/worker/gpu_worker.py (Worker.determine_available_memory, profile_run)
and vllm/utils/mem_utils.py (memory_profiling)."""
from __future__ import annotations

import logging

import torch

from shared.forward_context import AttentionBackend, set_forward_context

logger = logging.getLogger(__name__)


def kv_cache_budget_bytes(total: int, utilization: float, torch_peak: int, non_torch: int,
                          graph_pool: int = 0) -> int:
    """What the KV cache may take: the engine's share of the device less what the profile used and
    what the CUDA graphs' pool will hold."""
    budget = int(total * utilization) - torch_peak - non_torch - graph_pool
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:g} of {total / 2**30:.1f} GiB is "
            f"{total * utilization / 2**30:.1f} GiB, and the weights and a profiling step's activations peak at "
            f"{torch_peak / 2**30:.1f} GiB, with {non_torch / 2**30:.1f} GiB outside torch and "
            f"{graph_pool / 2**30:.1f} GiB for CUDA graphs; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, or give --kv-cache-memory-mb")
    return budget


class _NoCache(AttentionBackend):
    """Attention during the profile: zeros (there is no KV cache yet), as vLLM's profile run."""

    def forward(self, layer_idx, q, k, v, metadata):
        return torch.zeros_like(q)


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, device: torch.device, max_tokens: int, max_seqs: int,
                      max_model_len: int, utilization: float, graph_tokens: int = 0) -> int:
    """`graph_tokens`: the largest CUDA graph's size (0: no graphs)."""
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
    graph_pool = 0
    if graph_tokens:  # the largest graph's activations, which its pool will hold apart
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with set_forward_context(_NoCache(), None):
            hidden = model(ids[:graph_tokens], positions[:graph_tokens])
        torch.cuda.synchronize(device)
        graph_pool = torch.cuda.max_memory_allocated(device) - before
        del hidden
        torch.cuda.empty_cache()
    budget = kv_cache_budget_bytes(total, utilization, peak, max(non_torch, 0), graph_pool)
    logger.info("memory profile: %.2f GiB peak in torch (weights and a %d-token step), %.2f GiB outside torch, "
                "%.2f GiB for CUDA graphs; KV cache %.2f GiB (--gpu-memory-utilization %g of %.1f GiB)",
                peak / 2**30, max_tokens, non_torch / 2**30, graph_pool / 2**30, budget / 2**30, utilization,
                total / 2**30)
    return budget


def min_over_ranks(budget: int, device: torch.device) -> int:
    """The smallest budget of every rank (all stages' TP groups): every rank's pool holds the same blocks."""
    import torch.distributed as dist

    t = torch.tensor([budget], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
    return int(t.item())
