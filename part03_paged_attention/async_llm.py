"""AsyncLLM: the engine on a background thread, its outputs streamed into asyncio.

The event loop only parses requests and writes bytes; the engine thread does the maths and
hands each new token to the loop with `call_soon_threadsafe`. (PyTorch releases the GIL inside
its kernels, so the loop stays responsive while the thread computes.) Requests that queue up
while a batch runs form the next static batch: a request arriving mid-batch waits for the whole
batch to finish, which is what part 04's continuous batching removes."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from shared.outputs import RequestOutput

from .engine import LLMEngine
from .request import Request


@dataclass
class _Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    done: bool = False


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self.num_unfinished = 0  # requests accepted and not yet done (queued or running)
        self.num_aborted = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine loop on a background thread (tests, notebooks). `python -m ...server`
        instead calls run_engine_loop() on the main thread: on CPU, PyTorch runs about 2x slower
        on a second thread once the main thread has used its OpenMP pool (as loading does)."""
        self._thread = threading.Thread(target=self.run_engine_loop, name="engine", daemon=True)
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield a delta after every new token, until the request finishes. If the consumer
        stops early (client disconnect: the task is cancelled), the request is aborted."""
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        self.num_unfinished += 1
        self._jobs.put(job)
        try:
            while True:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not request.finished:
                request.aborted = True  # the engine thread sees it before its next token
            self.num_unfinished -= 1

    def run_engine_loop(self) -> None:
        """Serve jobs until shutdown()."""
        waiting: list[_Job] = []
        while True:
            # Idle: sleep until a job comes. Then take every job queued meanwhile: they are the
            # candidates for the next static batch.
            incoming = [self._jobs.get()] if not waiting else []
            while not self._jobs.empty():
                incoming.append(self._jobs.get_nowait())
            if None in incoming:
                return
            waiting += incoming
            for job in [j for j in waiting if j.request.aborted]:  # clients that left while queued
                waiting.remove(job)
                self.num_aborted += 1
            if not waiting:
                continue
            requests = [j.request for j in waiting]
            batch = self.engine.take_batch(requests)
            jobs, waiting = waiting[:len(batch)], waiting[len(batch):]
            try:
                for _ in self.engine.run_batch(batch):
                    for job in jobs:
                        if not job.done:
                            job.done = job.request.finished
                            job.loop.call_soon_threadsafe(job.outputs.put_nowait, job.request.output(delta=True))
                self.num_aborted += sum(j.request.aborted for j in jobs)
            except Exception as e:  # surface engine errors to the waiting handlers
                for job in jobs:
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, e)

    def shutdown(self) -> None:
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
