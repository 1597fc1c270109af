"""MultiprocExecutor: the model runs in one worker process per tensor-parallel rank; the engine
(scheduler, KV block manager, detokenizer) stays in the driver process and holds no weights.

Each step, the driver publishes the batch's plain scheduling data once on a ZeroMQ socket that
every rank subscribes to (worker.py), and rank 0 answers with the sampled tokens on a second
socket. `execute_batch` returns a Future at once, so async scheduling (part 05) still launches
step N+1 before step N's tokens are read: the workers take the steps in order, and each prepares
the next step's inputs while it runs the current one.

Lifecycle: a worker that dies (a crash, the OOM killer, `kill -9`) is seen while the driver waits
for an answer, because it waits on every local worker's process sentinel as well as on the socket;
a rank that fails (on any node) sends its traceback; and an answer that takes longer than
`execute_model_timeout_s` (a hung rank, a vanished node) fails too. The executor then kills its
workers and fails every step in flight, and every later one, with WorkerDied: the engine answers
its requests with that error instead of hanging. `shutdown()` ends every worker; workers also exit
on their own when the driver dies (their parent, or for another node the driver's socket).

Several nodes: node 0 runs the engine and its share of the ranks; every other node runs
headless.py's `run_headless` (the server's `--headless`), which starts that node's ranks and waits for them. The
ranks meet at the rendezvous address and subscribe to the driver's steps there.

In vLLM: vllm/v1/executor/multiproc_executor.py (MultiprocExecutor) and
vllm/distributed/device_communicators/shm_broadcast.py (MessageQueue: the step broadcast)."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import threading
import time
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout

import torch
import zmq

from .config import EngineConfig
from .parallel_state import ParallelConfig
from .process_utils import WorkerDied, threads_per_process
from .runner_messages import SequenceBatchEntry, StepMessage
from .worker import worker_main


def start_workers(config: EngineConfig, parallel: ParallelConfig) -> dict[int, mp.Process]:
    """Spawn this node's ranks."""
    import os

    ctx = mp.get_context("spawn")  # a fresh interpreter: no copied threads, no CUDA state
    threads = threads_per_process(config.num_threads, os.cpu_count() or 1, parallel.ranks_per_node)
    procs = {}
    for rank in parallel.local_ranks:
        procs[rank] = ctx.Process(target=worker_main, args=(config, parallel, rank, threads),
                                  name=f"tp-worker-{rank}", daemon=True)
        procs[rank].start()
    return procs


class _StepFuture(Future):
    """Resolved when the driver reads its answer, which it does when the engine asks for it."""

    def __init__(self, executor: "MultiprocExecutor"):
        super().__init__()
        self._executor = executor

    def result(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise FutureTimeout(f"no answer within {timeout} s")
            self._executor._receive_one(left)
        return super().result()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, parallel: ParallelConfig):
        self.step_timeout = config.execute_model_timeout_s
        self.pending: deque[_StepFuture] = deque()
        self.error: WorkerDied | None = None
        self._stopped = threading.Event()
        self.ctx = zmq.Context()
        # XPUB: like PUB, but it hears each subscription, so the driver knows when every rank listens.
        self.steps = self.ctx.socket(zmq.XPUB)
        self.steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first of a topic
        self.steps.setsockopt(zmq.LINGER, 0)
        self.steps.bind(f"tcp://{parallel.master_addr}:{parallel.broadcast_port}")
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(f"tcp://{parallel.master_addr}:{parallel.result_port}")
        self.procs = start_workers(config, parallel)
        try:
            info = self._wait_ready(parallel.world_size, config.engine_ready_timeout_s)
        except BaseException:
            self._end_workers(graceful=False)
            raise
        self.model_path, self.model_config = info["model_path"], info["model_config"]
        self.max_model_len, self.num_blocks = info["max_model_len"], info["num_blocks"]
        self.block_size, self.kv_connector_info = info["block_size"], info["kv_connector_info"]
        self.cudagraph_mode = info["cudagraph_mode"]  # what the ranks replay (they resolve it alike)
        self.device = torch.device("cpu")  # of the engine's generators: here they only carry seeds

    def _wait_ready(self, size: int, timeout: float) -> dict:
        """Until every rank subscribed to the steps and rank 0 (after all ranks loaded) says ready."""
        subscribed, deadline = 0, time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.steps, zmq.POLLIN)
        while subscribed < size:
            if not poller.poll(max(0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"only {subscribed} of {size} ranks connected within {timeout} s")
            subscribed += self.steps.recv()[:1] == b"\x01"
        kind, info = self._receive(max(0.0, deadline - time.monotonic()), "start")
        return info

    def execute_batch(self, batch: list[SequenceBatchEntry], finished_seq_ids: list[str],
                      kv_connector_metadata=None, grammar_output=None, preempted_seq_ids: list[str] = ()) -> Future:
        if self.error is not None:
            raise self.error
        # Generators stay with the workers: send each seeded sequence's seed instead.
        seeds = {e.seq_id: e.sampling.generator.initial_seed() for e in batch
                 if e.sampling is not None and e.sampling.generator is not None}
        plain = [e if e.sampling is None or e.sampling.generator is None else
                 dataclasses.replace(e, sampling=dataclasses.replace(e.sampling, generator=None)) for e in batch]
        future = _StepFuture(self)
        self.steps.send(pickle.dumps(StepMessage(plain, seeds, finished_seq_ids, kv_connector_metadata, grammar_output,
                                                    list(preempted_seq_ids))))
        self.pending.append(future)
        return future

    runs_elsewhere = False  # the workers need a step's whole input (a bitmask too) when it is sent

    def _receive_one(self, timeout: float | None = None) -> None:
        """Resolve the oldest pending step; a `timeout` shorter than the step limit only returns
        early (the step may still come), the step limit fails the executor."""
        wait = self.step_timeout if timeout is None else min(timeout, self.step_timeout)
        try:
            _, out = self._receive(wait, "step", fail_on_timeout=wait >= self.step_timeout)
        except WorkerDied as e:
            while self.pending:
                self.pending.popleft().set_exception(e)
            return
        if out is not None:
            self.pending.popleft().set_result(out)

    def _receive(self, timeout: float, what: str, fail_on_timeout: bool = True):
        """Rank 0's next answer; raises WorkerDied when a local worker dies first (its sentinel
        becomes ready), a rank reports an error, or nothing comes within the limit."""
        if self.error is not None:
            raise self.error
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll(timeout * 1000))
        if not events:
            if not fail_on_timeout:
                return None, None
            self._fail(f"the workers did not answer within {timeout:.0f} s "
                       f"(execute_model_timeout_s / engine_ready_timeout_s); the engine cannot continue")
        detail = ""
        if self.results in events:
            kind, payload = pickle.loads(self.results.recv())
            if kind in ("ok", "ready"):
                return kind, payload
            detail = f"\n{payload}"  # a rank's traceback
        deadline = time.monotonic() + 2  # let the ranks that saw the failure finish exiting
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in self.procs.items() if not p.is_alive()]
        self._fail(f"worker died during {what}: {', '.join(dead) or 'a rank reported an error'}; "
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
        """End every worker: tell them all to stop, then make sure."""
        if self.error is None:
            self.error = WorkerDied("the executor was shut down")
            self._end_workers(graceful=True)

    def _end_workers(self, graceful: bool) -> None:
        if graceful:
            try:
                self.steps.send(pickle.dumps(None))
            except zmq.ZMQError:
                pass
            for p in self.procs.values():
                p.join(timeout=10)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)

