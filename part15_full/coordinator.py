"""The coordinator: what the API server knows about each engine's load and cache.

Every engine core reports its stats with its outputs, and at least every HEARTBEAT_S when idle:
its queue lengths (waiting, running), its prefix-cache counters and how many aborts it handled.
Reports lag: requests the server routed since an engine's last report are not in it yet, so the
coordinator adds them to that engine's waiting count until the next report arrives (otherwise a
burst would see the same stale loads and pile onto one engine). An engine that has not been heard
from for the silence limit (`engine_heartbeat_timeout_s`; each engine has a heartbeat thread, so a
long step does not count) is presumed dead. Silence counts only from an engine's "ready": loading a
large checkpoint takes minutes, and start-up has a limit of its own (`engine_ready_timeout_s`). The
server also watches its local engines' processes.

In vLLM: vllm/v1/engine/coordinator.py (DPCoordinator, a process of its own that gathers the
engines' request counts and publishes them to the API servers); here it is an object in the one
API server process."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .router import EngineLoad

HEARTBEAT_S = 0.5


@dataclass
class EngineStats:
    """One engine's report."""
    waiting: int = 0
    running: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # ...found there
    num_aborted: int = 0
    num_finished: int = 0


class Coordinator:
    def __init__(self, num_engines: int, silence_limit_s: float = 30.0):
        self.stats = [EngineStats() for _ in range(num_engines)]
        self.routed_since_report = [0] * num_engines
        self.silence_limit_s = silence_limit_s
        self.last_heard: list[float | None] = [None] * num_engines  # None: not ready yet

    def report(self, engine: int, stats: EngineStats) -> None:
        self.stats[engine] = stats
        self.routed_since_report[engine] = 0
        self.heard(engine)

    def heard(self, engine: int) -> None:
        """The engine is ready, or still alive."""
        self.last_heard[engine] = time.monotonic()

    def routed(self, engine: int) -> None:
        self.routed_since_report[engine] += 1

    def loads(self) -> list[EngineLoad]:
        return [EngineLoad(s.waiting + extra, s.running) for s, extra in zip(self.stats, self.routed_since_report)]

    def silent_engines(self) -> list[int]:
        """Ready engines that have said nothing for longer than the silence limit."""
        now = time.monotonic()
        return [e for e, t in enumerate(self.last_heard) if t is not None and now - t > self.silence_limit_s]

    @property
    def prefix_hit_rate(self) -> float:
        queries = sum(s.prefix_queries for s in self.stats)
        return sum(s.prefix_hits for s in self.stats) / queries if queries else 0.0
