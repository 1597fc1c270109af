"""Part 15: data-parallel engines on one host's GPUs. Each engine takes GPUs of its own, from its
local rank times its tensor-parallel ranks on the host (vLLM's local DP rank x TP size), and each of
its ranks the next ones; a CPU, or a device named without CUDA, is left as configured. Pure
functions: the assignment is checked here without a GPU."""
from __future__ import annotations

import torch

from part15_full.parallel_state import engine_device, rank_device


def assignment(dp: int, tp: int, base: str | None = None) -> list[list[str]]:
    """Every (engine, rank) device of `dp` engines with `tp` ranks each on one host."""
    out = []
    for local in range(dp):
        device = engine_device(base, local, tp, cuda=True)
        out.append([str(rank_device(device, r, tp, cuda=True)) for r in range(tp)])
    return out


def test_each_engine_and_its_ranks_get_their_own_gpus():
    assert assignment(2, 1) == [["cuda:0"], ["cuda:1"]]
    assert assignment(2, 2) == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert assignment(4, 2) == [[f"cuda:{2 * e}", f"cuda:{2 * e + 1}"] for e in range(4)]
    flat = [d for engine in assignment(3, 2) for d in engine]
    assert len(set(flat)) == len(flat)  # no GPU shared


def test_a_configured_device_index_is_the_first_gpu():
    assert assignment(2, 2, "cuda:4") == [["cuda:4", "cuda:5"], ["cuda:6", "cuda:7"]]


def test_cpu_and_explicit_non_cuda_devices_are_left_as_they_are():
    assert engine_device(None, 1, 2, cuda=False) is None
    assert engine_device("cpu", 3, 2, cuda=True) == "cpu"
    assert rank_device("cpu", 1, 2, cuda=True) == torch.device("cpu")
    assert rank_device(None, 1, 2, cuda=False) == torch.device("cpu")
