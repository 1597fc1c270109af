"""AsyncLLM: the engine on a background thread, its outputs streamed into asyncio.

The event loop only parses requests and writes bytes; the engine thread does the maths and
hands each new token to the loop with `call_soon_threadsafe`. (PyTorch releases the GIL inside
its kernels, so the loop stays responsive while the thread computes.) With continuous batching
a request that arrives mid-generation joins the very next engine step. With async scheduling
the engine is two threads: the worker runs the model, the engine core does everything else
(taking requests, scheduling, detokenizing, handing out deltas) meanwhile.

From part 10 on it is one of the EngineClients a server can run on (engine_client.py): the one with
no process hop, the default on a CPU.

With a `stat_logger` (part 15, metrics.py) the engine thread also times every request from the
deltas it hands out (one RequestTimer per completion, stats.py) and records each step, the
scheduler's state included, before the deltas leave: a client that has its answer finds it counted.
A request whose consumer left counts as finished with "abort"."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from shared.outputs import RequestOutput

from .engine import LLMEngine, run_overlapped
from .engine_client import EngineClient
from .messages import EngineCoreRequest
from .metrics import PrometheusStatLogger
from .stats import IterationStats, RequestTimer, make_scheduler_stats, sequences_not_started


@dataclass
class _Job:
    request: EngineCoreRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    aborted: bool = False  # its consumer left: the engine thread aborts it before its next step
    timers: list[RequestTimer] = field(default_factory=list)  # one per completion, for /metrics


class AsyncLLM(EngineClient):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer, self.max_model_len, self.processor = engine.tokenizer, engine.max_model_len, engine.processor
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self.num_unfinished = 0  # requests accepted and not yet done (queued or running)
        self.num_aborted = 0
        self._thread: threading.Thread | None = None
        self.config, self.engine_indexes = engine.config, [0]
        self.stat_logger: PrometheusStatLogger | None = None  # set by metrics.attach_stat_logger

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
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(), timers=RequestTimer.for_request(request))
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
            it = IterationStats(0)
            for job in [j for j in jobs.values() if j.aborted]:  # their clients left
                self.engine.abort_request(job.request.request_id)
                del jobs[job.request.request_id]
                self.num_aborted += 1
                for timer in job.timers:
                    timer.on_abort(time.time(), it)
            try:
                start = time.time()  # a step schedules before it runs the model
                stepped = [(jobs[r.request_id], r, r.output(delta=True)) for r in self.engine.step()]
                if self.stat_logger is not None:  # before the deltas go out: their clients may scrape next
                    self._record(jobs, stepped, start, it)
                for job, request, delta in stepped:
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, delta)
                    if request.finished:
                        del jobs[request.request_id]
            except Exception as e:  # surface engine errors to every waiting handler
                for job in jobs.values():
                    self.engine.abort_request(job.request.request_id)
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, e)
                jobs.clear()

    def _record(self, jobs: dict[str, _Job], stepped: list, start: float, it: IterationStats) -> None:
        """A step's deltas into their requests' timers, and the step into the metrics."""
        now = time.time()
        for seq in sequences_not_started(self.engine):  # first scheduled in this step, maybe
            job = jobs.get(seq.request.request_id)
            if job is not None:
                job.timers[seq.state.index].on_scheduled(start)
        for job, _, delta in stepped:
            for c in delta.outputs:
                if c.token_ids or c.finish_reason:
                    timer = job.timers[c.index]
                    timer.on_scheduled(start)  # scheduled and done within this very step call
                    timer.on_output(now, len(c.token_ids), c.finish_reason, it)
        self.stat_logger.record(make_scheduler_stats(self.engine, 0), it if stepped or it.finished else None)

    def shutdown(self) -> None:
        """Stop the engine loop, then the engine (its worker processes, with tensor parallelism)."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.shutdown()
