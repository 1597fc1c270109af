"""What every process of the engine shares about processes: how many CPU threads each compute
process takes, a child that lives and ends with its parent, a node waiting for its children, and
the error a step meets when a worker dies.

The front end (the server, its engine-core clients) starts and watches processes too, so these live
apart from the executor and the worker: the API server's process never imports the worker's code.

In vLLM v0.33.0: vllm/v1/utils.py (shutdown of child processes), vllm/v1/executor/multiproc_executor.py
(a worker's death watch) and vllm/v1/engine/exceptions.py (EngineDeadError)."""
from __future__ import annotations

import os
import signal
import threading
import time


class WorkerDied(RuntimeError):
    """A worker process died: every step in flight, and every later one, fails with it (a 503)."""


def threads_per_process(num_threads: int | None, cores: int, num_processes: int) -> int:
    """CPU threads for each of `num_processes` compute processes sharing `cores`: given, or an even
    share (DP engines times TP ranks on one node must not each take every core)."""
    return num_threads or max(1, cores // max(1, num_processes))


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


def join_all(procs: dict) -> int:
    """Wait for a headless node's processes (workers, or part 10's engines) to end; kill what is
    left if this process is interrupted. Returns the worst exit code."""
    try:
        for p in procs.values():
            p.join()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
    return max((abs(p.exitcode or 0) for p in procs.values()), default=0)
