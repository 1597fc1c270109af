"""MultiprocExecutor: the model runs in one worker process per tensor-parallel rank; the engine
(scheduler, KV block manager, detokenizer) stays in the driver process and holds no weights.

Each step, the driver sends the batch's plain scheduling data to rank 0, which broadcasts it to
the other ranks (worker.py), and rank 0 answers with the sampled tokens. `execute_batch` returns a
Future at once, so async scheduling (part 05) still launches step N+1 before step N's tokens are
read: the workers take the steps in order.

Lifecycle: a worker that dies (a crash, the OOM killer, `kill -9`) is seen while the driver waits
for an answer, because it waits on every worker's process sentinel as well as on the pipe. The
executor then kills the other workers and fails every step in flight, and every later one, with
WorkerDied naming the rank: the engine answers its requests with that error instead of hanging.
`shutdown()` ends every worker; workers also exit on their own when the driver dies.

Several nodes: node 0 runs the engine and its share of the ranks; every other node runs
`run_headless` (the server's `--headless`), which starts that node's ranks and waits for them. The
ranks meet at the rendezvous address, and rank 0 relays each step to all of them.

In vLLM: vllm/v1/executor/multiproc_executor.py (MultiprocExecutor)."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait

import torch

from .config import EngineConfig
from .model_runner import SequenceBatchEntry
from .parallel_state import ParallelConfig
from .worker import StepMessage, worker_main

STARTUP_TIMEOUT_S = 600  # loading a large checkpoint takes a while


class WorkerDied(RuntimeError):
    pass


def start_workers(config: EngineConfig, parallel: ParallelConfig, with_pipe: bool):
    """Spawn this node's ranks; rank 0 (on node 0) gets a pipe to the driver."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no copied threads, no CUDA state
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // parallel.ranks_per_node)
    procs, conn = {}, None
    for rank in parallel.local_ranks:
        child = None
        if rank == 0 and with_pipe:
            conn, child = ctx.Pipe()
        procs[rank] = ctx.Process(target=worker_main, args=(config, parallel, rank, child, threads),
                                  name=f"tp-worker-{rank}", daemon=True)
        procs[rank].start()
        if child is not None:
            child.close()  # the driver keeps one end only, so a dead worker shows as EOF
    return procs, conn


class _StepFuture(Future):
    """Resolved when the driver reads its answer, which it does when the engine asks for it."""

    def __init__(self, executor: "MultiprocExecutor"):
        super().__init__()
        self._executor = executor

    def result(self, timeout=None):
        while not self.done():
            self._executor._receive_one()
        return super().result()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, parallel: ParallelConfig):
        self.procs, self.conn = start_workers(config, parallel, with_pipe=True)
        self.pending: deque[_StepFuture] = deque()
        self.error: WorkerDied | None = None
        self._stopped = threading.Event()
        _, info = self._receive(STARTUP_TIMEOUT_S)
        self.model_path, self.model_config = info["model_path"], info["model_config"]
        self.max_model_len, self.num_blocks = info["max_model_len"], info["num_blocks"]
        self.block_size = info["block_size"]
        self.device = torch.device("cpu")  # of the engine's generators: here they only carry seeds

    def execute_batch(self, batch: list[SequenceBatchEntry], finished_seq_ids: list[str]) -> Future:
        if self.error is not None:
            raise self.error
        # Generators stay with the workers: send each seeded sequence's seed instead.
        seeds = {e.seq_id: e.sampling.generator.initial_seed() for e in batch
                 if e.sampling is not None and e.sampling.generator is not None}
        plain = [e if e.sampling is None or e.sampling.generator is None else
                 dataclasses.replace(e, sampling=dataclasses.replace(e.sampling, generator=None)) for e in batch]
        future = _StepFuture(self)
        try:
            self.conn.send(StepMessage(plain, seeds, finished_seq_ids))
        except OSError:  # the pipe is gone: find out who died
            self.pending.append(future)
            self._receive_one()
            raise self.error from None
        self.pending.append(future)
        return future

    def _receive_one(self) -> None:
        future = self.pending.popleft()
        try:
            _, out = self._receive(None)
            future.set_result(out)
        except WorkerDied as e:
            future.set_exception(e)
            while self.pending:
                self.pending.popleft().set_exception(e)

    def _receive(self, timeout: float | None):
        """Rank 0's next answer, unless a worker dies first (its sentinel becomes ready)."""
        if self.error is not None:
            raise self.error
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        ready = wait([self.conn, *sentinels], timeout=timeout)
        if not ready:
            self._fail(f"the workers did not answer within {timeout} s")
        detail = ""
        if self.conn in ready:
            try:
                kind, payload = self.conn.recv()
            except EOFError:  # the pipe closed: rank 0 is on its way out
                kind, payload = None, None
            if kind in ("ok", "ready"):
                return kind, payload
            if kind == "error":
                detail = f"\nrank 0's error:\n{payload}"
        deadline = time.monotonic() + 2  # let the ranks that saw the failure finish exiting
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in self.procs.items() if not p.is_alive()]
        self._fail(f"tensor-parallel worker died: {', '.join(dead) or 'rank 0 reported an error'}; "
                   f"the engine cannot continue{detail}")

    def _fail(self, message: str) -> None:
        self.error = WorkerDied(message)
        self._end_workers(graceful=False)  # the others may wait forever on the dead one
        raise self.error

    # The engine's worker-loop protocol (executor.py): nothing runs in the driver, so the loop
    # only waits for stop().
    def start_serving(self) -> None:
        self._stopped.clear()

    def run_worker_loop(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    def shutdown(self) -> None:
        """End every worker: ask rank 0 to stop them all, then make sure."""
        if self.error is None:
            self.error = WorkerDied("the executor was shut down")
            self._end_workers(graceful=True)

    def _end_workers(self, graceful: bool) -> None:
        if graceful:
            try:
                self.conn.send(None)
            except OSError:
                pass
            for p in self.procs.values():
                p.join(timeout=10)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def run_headless(config: EngineConfig, parallel: ParallelConfig) -> int:
    """A node other than 0: run this node's ranks until they end (the engine's node stops them)."""
    procs, _ = start_workers(config, parallel, with_pipe=False)
    try:
        for p in procs.values():
            p.join()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
    return max((abs(p.exitcode or 0) for p in procs.values()), default=0)
