"""Time torch.distributed collectives between local processes (notebook 09's communication costs).

    time_all_reduce([4608, 294912], world_size=2)  ->  {numel: seconds per all-reduce}

Each rank runs one thread; the timing is rank 0's mean over repeated fp32 all-reduces after a
warm-up, gloo on the CPU (NCCL when `device="cuda"`, one GPU per rank)."""
from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, size: int, port: int, numels: list[int], device: str, out: str) -> None:
    torch.set_num_threads(1)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    try:
        res = {}
        for n in numels:
            x = torch.ones(n, device=dev)
            for _ in range(10):
                dist.all_reduce(x)
            reps = 50 if n < 1_000_000 else 10
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            if device == "cuda":
                torch.cuda.synchronize(dev)
            res[n] = (time.perf_counter() - start) / reps
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def time_all_reduce(numels: list[int], world_size: int = 2, device: str = "cpu") -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(tempfile.mkdtemp()) / "allreduce.pt")
    mp.spawn(_rank, args=(world_size, port, list(numels), device, out), nprocs=world_size, join=True)
    return torch.load(out)
