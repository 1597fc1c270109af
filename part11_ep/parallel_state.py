"""Who is who in a tensor-parallel group, and how its processes find each other.

A group of `tensor_parallel_size` ranks may span `nnodes` machines, each running an equal share of
the ranks: node k holds ranks k * per_node ... (k + 1) * per_node - 1. Rank 0 lives on node 0,
next to the engine. Every rank joins the process group at the rendezvous address (node 0's
address and a free port), so the same code runs on one host or several. The values come from
flags, or else from the environment names that torchrun and cluster launchers set (MASTER_ADDR,
MASTER_PORT, NNODES, NODE_RANK or torchrun's GROUP_RANK).

Two process groups: the device group carries the model's all-reduces and all-gathers (gloo on CPU,
NCCL on GPUs); a gloo group on the CPU carries the engine's control messages (each step's
scheduling data, broadcast by rank 0), which are Python objects, not tensors.

In vLLM: vllm/distributed/parallel_state.py (GroupCoordinator: device_group and cpu_group)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must divide evenly "
                             f"over nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks that run on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @classmethod
    def resolve(cls, tensor_parallel_size: int, nnodes: int | None = None, node_rank: int | None = None,
                master_addr: str | None = None, master_port: int | None = None) -> "ParallelConfig":
        """Flags first, then the launcher's environment, then single-node defaults (a free port)."""
        env = os.environ
        nnodes = nnodes or int(env.get("NNODES", 1))
        if node_rank is None:
            node_rank = int(env.get("NODE_RANK", env.get("GROUP_RANK", 0)))
        master_addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
        master_port = master_port or int(env.get("MASTER_PORT", 0))
        if not master_port:
            if nnodes > 1:
                raise ValueError("a group over several nodes needs --master-port (or MASTER_PORT)")
            master_port = free_port()
        return cls(tensor_parallel_size, nnodes, node_rank, master_addr, master_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks other than 0 wait in a broadcast for the next step, however long the server stays idle.
CONTROL_TIMEOUT = timedelta(days=30)


def init_distributed(config: ParallelConfig, rank: int, device: torch.device) -> dist.ProcessGroup:
    """Join the group as `rank` (the device group becomes the default one); returns the CPU group
    for control messages."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=config.init_method,
                            rank=rank, world_size=config.tensor_parallel_size)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
