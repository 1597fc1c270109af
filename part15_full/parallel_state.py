"""Who is who among the model's processes, and how they find each other.

The processes form a grid of `pipeline_parallel_size` stages of `tensor_parallel_size` ranks: global
rank r is tensor-parallel rank r % TP of stage r // TP (TP fastest, as vLLM orders them). Each stage's
ranks form a TP group, which carries its all-reduces and all-gathers; consecutive stages pass their
activations point to point (pipeline.py). The world of TP x PP ranks may span `nnodes` machines,
each running an equal share: node k holds ranks k * per_node ... (k + 1) * per_node - 1. Rank 0 lives on node 0,
next to the engine. Every rank joins the process group at the rendezvous address (node 0's
address and a free port), so the same code runs on one host or several. The values come from
flags, or else from the environment names that torchrun and cluster launchers set (MASTER_ADDR,
MASTER_PORT, NNODES, NODE_RANK or torchrun's GROUP_RANK).

Two process groups: the device group carries the model's all-reduces and all-gathers (gloo on CPU,
NCCL on GPUs); a gloo group on the CPU carries the start-up's control messages (Python objects, not
tensors). The steps themselves do not travel through torch.distributed: the driver publishes each
one on a ZeroMQ socket every rank subscribes to (worker.py), so an idle server leaves no collective
waiting, and every collective can have a short timeout: a hung or vanished rank surfaces as an
error within `execute_model_timeout_s` instead of a hang.

In vLLM: vllm/distributed/parallel_state.py (GroupCoordinator: device_group and cpu_group;
get_tp_group, get_pp_group; ranks laid out by initialize_model_parallel)."""
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
    # The driver's ZeroMQ ports: steps out to every rank, results (and errors) back. Several nodes:
    # the two ports after master_port; one node: free ones.
    broadcast_port: int = 0
    result_port: int = 0
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"the world of TP x PP ranks ({self.world_size}) must divide evenly "
                             f"over nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank) of global `rank`."""
        return divmod(rank, self.tensor_parallel_size)

    @property
    def output_rank(self) -> int:
        """The rank that sends each step's result: the last stage's first TP rank (it samples)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks that run on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def broadcast_addr(self) -> str:
        return f"tcp://{self.master_addr}:{self.broadcast_port}"

    @property
    def result_addr(self) -> str:
        return f"tcp://{self.master_addr}:{self.result_port}"

    @classmethod
    def resolve(cls, tensor_parallel_size: int, nnodes: int | None = None, node_rank: int | None = None,
                master_addr: str | None = None, master_port: int | None = None,
                pipeline_parallel_size: int = 1) -> "ParallelConfig":
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
            return cls(tensor_parallel_size, nnodes, node_rank, master_addr, free_port(), free_port(), free_port(),
                       pipeline_parallel_size)
        return cls(tensor_parallel_size, nnodes, node_rank, master_addr, master_port, master_port + 1, master_port + 2,
                   pipeline_parallel_size)


def engine_device(device: str | None, local_dp_rank: int, ranks_per_node: int, cuda: bool) -> str | None:
    """The device of a data-parallel engine (part 15): on CUDA the engines of one host take disjoint
    GPUs, engine `local_dp_rank` (its rank among this host's engines) from GPU
    `local_dp_rank * ranks_per_node` on (its tensor-parallel ranks' first), counted from the
    configured device's index. Elsewhere the configured device, unchanged.
    In vLLM: vllm/v1/worker/gpu_worker.py, Worker.init_device (local_rank += dp_local_rank * tp_pp_size)."""
    dev = torch.device(device) if device else torch.device("cuda" if cuda else "cpu")
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + local_dp_rank * ranks_per_node}"


def rank_device(device: str | None, rank: int, ranks_per_node: int, cuda: bool) -> torch.device:
    """The device of tensor-parallel `rank`: on CUDA, GPU (the configured index) + its place on its node."""
    dev = torch.device(device) if device else torch.device("cuda" if cuda else "cpu")
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank % ranks_per_node)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TP_GROUP: dist.ProcessGroup | None = None


def get_tp_group() -> dist.ProcessGroup | None:
    """This process's tensor-parallel group: every collective of the model's layers names it (with a
    single stage it is the whole world)."""
    return _TP_GROUP


def init_distributed(parallel: ParallelConfig, rank: int, device: torch.device, config) -> dist.ProcessGroup:
    """Join the world as `rank` (the device group becomes the default one, its collectives and
    point-to-point transfers bounded by the step timeout) and this stage's TP group; returns the CPU
    group for start-up messages (bounded by the start-up timeout: the other ranks may still be
    loading their shards)."""
    global _TP_GROUP
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=parallel.init_method,
                            rank=rank, world_size=parallel.world_size,
                            timeout=timedelta(seconds=config.execute_model_timeout_s))
    tp = parallel.tensor_parallel_size
    _TP_GROUP = dist.group.WORLD
    if parallel.pipeline_parallel_size > 1:  # every rank creates every group, in the same order
        for stage in range(parallel.pipeline_parallel_size):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                _TP_GROUP = group
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=config.engine_ready_timeout_s))
