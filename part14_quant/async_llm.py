"""AsyncLLM: the engine on a background thread, its outputs streamed into asyncio.

The event loop only parses requests and writes bytes; the engine thread does the maths and
hands each new token to the loop with `call_soon_threadsafe`. (PyTorch releases the GIL inside
its kernels, so the loop stays responsive while the thread computes.) With continuous batching
a request that arrives mid-generation joins the very next engine step. With async scheduling
the engine is two threads: the worker runs the model, the engine core does everything else
(taking requests, scheduling, detokenizing, handing out deltas) meanwhile.

From part 10 on it is one of the EngineClients a server can run on (engine_client.py): the one with
no process hop, the default on a CPU."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from shared.outputs import RequestOutput

from .engine import LLMEngine, run_overlapped
from .engine_client import EngineClient
from .messages import EngineCoreRequest


@dataclass
class _Job:
    request: EngineCoreRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    aborted: bool = False  # its consumer left: the engine thread aborts it before its next step


class AsyncLLM(EngineClient):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer, self.max_model_len, self.processor = engine.tokenizer, engine.max_model_len, engine.processor
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self.num_unfinished = 0  # requests accepted and not yet done (queued or running)
        self.num_aborted = 0
        self._thread: threading.Thread | None = None

    @property
    def dead_error(self) -> Exception | None:
        """Set once the engine cannot serve (a tensor-parallel worker died)."""
        return self.engine.executor.error

    def start(self) -> None:
        """Run the engine loop on a background thread (tests, notebooks). `python -m ...server`
        instead calls run_engine_loop() on the main thread: on CPU, PyTorch runs about 2x slower
        on a second thread once the main thread has used its OpenMP pool (as loading does)."""
        self._thread = threading.Thread(target=self.run_engine_loop, name="engine", daemon=True)
        self._thread.start()

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        """Yield a delta after every new token, until the request finishes. If the consumer
        stops early (client disconnect: the task is cancelled), the request is aborted."""
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        self.num_unfinished += 1
        self._jobs.put(job)
        finished = False
        try:
            while not finished:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            job.aborted = not finished  # the engine thread sees it before its next token
            self.num_unfinished -= 1

    def run_engine_loop(self) -> None:
        """Serve jobs until shutdown(). With async scheduling this thread runs the model (the
        executor's worker loop) and the engine core gets a thread of its own."""
        if self.engine.max_steps_in_flight > 1:
            run_overlapped(self.engine.executor, self._serve_jobs)
        else:
            self._serve_jobs()

    def _serve_jobs(self) -> None:
        jobs: dict[str, _Job] = {}
        while True:
            # Sleep only when there is nothing to run; otherwise take what arrived and step on.
            incoming = [] if self.engine.has_unfinished_requests() else [self._jobs.get()]
            while not self._jobs.empty():
                incoming.append(self._jobs.get_nowait())
            if None in incoming:
                return
            for job in incoming:  # new requests join the very next step
                jobs[job.request.request_id] = job
                self.engine.add_request(job.request)
            for job in [j for j in jobs.values() if j.aborted]:  # their clients left
                self.engine.abort_request(job.request.request_id)
                del jobs[job.request.request_id]
                self.num_aborted += 1
            try:
                for request in self.engine.step():
                    job = jobs[request.request_id]
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, request.output(delta=True))
                    if request.finished:
                        del jobs[request.request_id]
            except Exception as e:  # surface engine errors to every waiting handler
                for job in jobs.values():
                    self.engine.abort_request(job.request.request_id)
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, e)
                jobs.clear()

    def shutdown(self) -> None:
        """Stop the engine loop, then the engine (its worker processes, with tensor parallelism)."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.shutdown()
