"""A worker process: one tensor-parallel rank, with its shard of the model and of the KV cache.

Rank 0 talks to the engine over a pipe: it receives each step's plain scheduling data (the
batch entries), broadcasts it to the other ranks over the CPU group, and after the step sends
the sampled tokens back. Every rank then prepares the same inputs, runs its shard of the same
forward pass (the all-reduces meet in the middle) and samples the same tokens from the same
all-gathered logits, so every rank also keeps the same placeholder tokens for the next step (part
05) without asking anyone. For that, their random streams must agree too: unseeded rows draw from
each process's global generator, seeded from one value rank 0 broadcasts; a seeded sequence
gets its own generator, made here from the seed on first sight and dropped when it finishes.

The only process that touches the network API is the engine's; workers never see a request.

In vLLM: vllm/v1/executor/multiproc_executor.py (WorkerProc) and vllm/v1/worker/gpu_worker.py."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

from shared.sampler import SampledBatch, make_generator

from .config import EngineConfig
from .model_runner import ModelRunner, SequenceBatchEntry
from .parallel_layers import TensorParallelLayers
from .parallel_state import ParallelConfig, init_distributed


@dataclasses.dataclass
class StepMessage:
    """One step, as the engine sends it to rank 0 and rank 0 to everyone."""
    batch: list[SequenceBatchEntry]  # sampling rows without their generators
    seeds: dict[str, int]  # seq_id -> seed, for the sequences with a seeded generator
    finished_seq_ids: list[str]


def worker_main(config: EngineConfig, parallel: ParallelConfig, rank: int, conn, num_threads: int) -> None:
    """The body of a worker process (started with multiprocessing's spawn)."""
    follow_parent()
    torch.set_num_threads(num_threads)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", rank % parallel.ranks_per_node)
        torch.cuda.set_device(device)
    try:
        cpu_group = init_distributed(parallel, rank, device)
        size = parallel.tensor_parallel_size
        # A group of one needs no sharding and no collectives (each would still cost a call into gloo).
        runner = ModelRunner(config, TensorParallelLayers(rank, size) if size > 1 else None, str(device))
        seed = [int.from_bytes(os.urandom(4), "little")]
        dist.broadcast_object_list(seed, src=0, group=cpu_group)
        torch.manual_seed(seed[0])  # the same stream on every rank, for unseeded sampling
        if rank == 0:
            conn.send(("ready", {"model_path": runner.model_path, "model_config": runner.model_config,
                                 "max_model_len": runner.max_model_len, "num_blocks": runner.num_blocks,
                                 "block_size": runner.block_size, "device": str(device)}))
        generators: dict[str, torch.Generator] = {}
        while True:
            box = [conn.recv() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=cpu_group)
            msg: StepMessage | None = box[0]
            if msg is None:  # shutdown
                break
            for seq_id in msg.finished_seq_ids:
                generators.pop(seq_id, None)
            for seq_id, s in msg.seeds.items():
                if seq_id not in generators:
                    generators[seq_id] = make_generator(s, runner.device)
            batch = [e if e.sampling is None or e.seq_id not in generators else
                     dataclasses.replace(e, sampling=dataclasses.replace(e.sampling, generator=generators[e.seq_id]))
                     for e in msg.batch]
            out = runner.execute_model(runner.prepare_inputs(batch))
            if rank == 0:
                conn.send(("ok", _to_host(out)))
    except EOFError:  # the engine went away
        pass
    except BaseException:
        if rank == 0:
            try:
                conn.send(("error", traceback.format_exc()))
            except OSError:
                pass
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_host(out):
    """The step's result, picklable: tensors moved to the CPU."""
    if isinstance(out, SampledBatch):
        return SampledBatch(**{f.name: v.cpu() if isinstance(v, torch.Tensor) else v
                               for f in dataclasses.fields(out) for v in [getattr(out, f.name)]})
    return out  # a RejectionOutput is host data already


def follow_parent() -> None:
    """A child process lives and ends with its parent: Ctrl-C in a terminal reaches the whole process
    group, but only the parent decides when to stop its children (it tells them); and a child whose
    parent died (even by SIGKILL) must not linger, so a thread watches the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
