"""The API server's side of engine-core processes: AsyncMPClient (one engine core in a process of
its own) and DPAsyncMPClient (N of them, each a whole engine with its own KV cache, a router in
front). Both validate requests here, send each to one engine, and stream that engine's outputs
back to the request's handler.

    handler ── process_inputs (400s) ── generate ──route──▶ send queue ──▶ ROUTER ──▶ engine i (DEALER)
    handler ◀── its asyncio queue ◀── output thread ◀── PULL ◀── engine i (PUSH): deltas + stats

* Nothing on the event loop blocks: `generate` routes and enqueues; a sender thread owns the ROUTER
  socket (a send that waits at the high-water mark waits there), an output thread owns the PULL
  socket and hands each delta to its handler's queue with call_soon_threadsafe.
* Routing (router.py, DP only) sees the coordinator's loads; the cache-aware policy also sees the
  prompt's block hashes, computed here with the engines' hash seed (sent to them at the handshake).
* Aborts go to the engine that holds the request.
* An engine that dies (its process ends, it reports a fatal error, it falls silent after saying
  ready, or it cannot be sent to) is logged and forgotten by the router; its requests in flight end
  with EngineDeadError (a 503 for the client), and the others keep serving. If the output path
  itself fails, the whole client is dead: every request in flight ends with that error and /health
  answers 503. No request waits forever.
* Engines may run on other hosts: `--headless` starts a host's engines, which connect to the API
  server's address (run_headless_engines), and exit when it is gone.
* Metrics (with a `stat_logger`, metrics.py): each engine's SchedulerStats ride on its outputs; the
  output thread times every request from the outputs as they arrive (TTFT, inter-token latency,
  phases, finish reason), labelled with the engine that ran it, and records both before handing the
  outputs on. A request whose client left counts as finished with "abort".

In vLLM: vllm/v1/engine/core_client.py (AsyncMPClient, DPAsyncMPClient, DPLBAsyncMPClient) and
vllm/v1/engine/output_processor.py (the front end's view of each request)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import AsyncIterator

import zmq

from shared.errors import InvalidRequestError
from shared.outputs import CompletionOutput, Logprob
from shared.tokenizer import Tokenizer
from shared.weights import resolve_model_path

from .config import EngineConfig
from .coordinator import Coordinator
from .engine_client import EngineClient, EngineDeadError
from .engine_core import engine_core_main
from .input_processor import InputProcessor
from .kv_cache_utils import BlockHasher, make_none_hash
from .messages import (EngineCoreEventType as Event, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                       EngineCoreRequestType as Kind, Dead, Handshake, Ready, Rejected, decode, encode)
from .metrics import PrometheusStatLogger
from .process_utils import join_all, threads_per_process
from .outputs import RequestOutput  # with prompt logprobs (part 15)
from .router import make_router
from .stats import IterationStats, RequestTimer

log = logging.getLogger("vllm_course.core_client")


@dataclass
class _Job:
    """A request in flight, as the API server sees it."""
    request: EngineCoreRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    engine: int = -1
    unfinished: set[int] = field(default_factory=set)  # completion indexes still running
    timers: list[RequestTimer] = field(default_factory=list)  # one per completion, for /metrics


def start_engines(config: EngineConfig, ranks: range, input_addr: str, output_addr: str) -> dict[int, mp.Process]:
    """Spawn engine cores; the node's cores are shared among all of them and their TP workers."""
    ctx = mp.get_context("spawn")
    threads = threads_per_process(config.num_threads, os.cpu_count() or 1,
                                  len(ranks) * config.tensor_parallel_size * config.pipeline_parallel_size)
    # Each engine validates its configuration again (LLMEngine): it is told which engines this host
    # runs, which a --headless host's flags may leave to their defaults.
    config = dataclasses.replace(config, num_threads=threads, data_parallel_size_local=len(ranks),
                                 data_parallel_start_rank=ranks.start)
    procs = {}
    for rank in ranks:
        procs[rank] = ctx.Process(target=engine_core_main, args=(config, rank, input_addr, output_addr),
                                  name=f"engine-core-{rank}")  # not daemonic: it may start TP workers
        procs[rank].start()
    return procs


class MPClient(EngineClient):
    """Engine cores in processes of their own; subclasses choose the engine of each request. The
    subclasses validate the configuration before anything here runs."""

    def __init__(self, config: EngineConfig, size: int):
        local = size if config.data_parallel_size_local is None else config.data_parallel_size_local
        self.config, self.engine_indexes = config, list(range(size))
        self.stat_logger: PrometheusStatLogger | None = None  # set by metrics.attach_stat_logger
        self.hash_seed = config.prefix_caching_hash_seed or secrets.token_hex(16)
        self.ctx = zmq.Context()
        self.inp, self.out = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an engine that is gone raises
        for s in (self.inp, self.out):
            s.setsockopt(zmq.LINGER, 0)
        addr = config.data_parallel_address
        if config.data_parallel_rpc_port:
            self.inp.bind(f"tcp://{addr}:{config.data_parallel_rpc_port}")
            self.out.bind(f"tcp://{addr}:{config.data_parallel_rpc_port + 1}")
            ports = (config.data_parallel_rpc_port, config.data_parallel_rpc_port + 1)
        else:
            ports = (self.inp.bind_to_random_port(f"tcp://{addr}"), self.out.bind_to_random_port(f"tcp://{addr}"))
        self.procs = start_engines(config, range(local), f"tcp://{addr}:{ports[0]}", f"tcp://{addr}:{ports[1]}")
        self.lock = threading.Lock()  # jobs, dead, router and coordinator; never held across I/O
        self.jobs: dict[str, _Job] = {}
        self.dead: dict[int, str] = {}
        self.fatal: EngineDeadError | None = None
        self.num_unfinished = self.num_aborted = 0
        self.coordinator = Coordinator(size, config.engine_heartbeat_timeout_s)
        self._stopping = threading.Event()
        self._sends: queue.SimpleQueue = queue.SimpleQueue()  # (engine, kind, payload); None: stop
        try:
            info = self._handshake(size, config.engine_ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = Tokenizer(resolve_model_path(config.model))
        self.max_model_len = info[0].max_model_len
        self.processor = InputProcessor(self.tokenizer, info[0].model_config, self.max_model_len,
                                        min(i.num_blocks for i in info.values()), config.block_size,
                                        structured_outputs_backend=config.structured_outputs_backend,
                                        speculative_method=config.speculative_method,
                                        scheduling_policy=config.scheduling_policy)
        self._threads = [threading.Thread(target=self._send_loop, name="engine-sender", daemon=True),
                         threading.Thread(target=self._output_loop, name="engine-outputs", daemon=True)]
        for t in self._threads:
            t.start()

    def _handshake(self, size: int, timeout: float) -> dict[int, Ready]:
        """Answer every engine's hello with the shared settings; wait until all are ready (the
        silence limit starts counting for each engine from its ready)."""
        ready: dict[int, Ready] = {}
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        poller.register(self.out, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        hello = encode(Handshake(self.hash_seed))
        while len(ready) < size:
            events = dict(poller.poll(500))
            if self.inp in events:  # an engine connected: its identity is now routable
                identity, *_ = self.inp.recv_multipart()
                self.inp.send_multipart([identity, Kind.HANDSHAKE.value, hello])
            if self.out in events:
                kind, payload = self.out.recv_multipart()
                if kind == Event.READY.value:
                    r = decode(payload, Ready)
                    ready[r.engine_index] = r
                    self.coordinator.heard(r.engine_index)
                elif kind == Event.ALIVE.value:  # a ready engine waiting for the others is not silent
                    self.coordinator.heard(decode(payload, int))
                elif kind == Event.DEAD.value:
                    d = decode(payload, Dead)
                    raise RuntimeError(f"engine {d.engine_index} failed to start:\n{d.traceback}")
            gone = [r for r, p in self.procs.items() if not p.is_alive() and r not in ready]
            if gone:
                raise RuntimeError(f"engine {gone[0]} exited while starting (exit code {self.procs[gone[0]].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only engines {sorted(ready)} of {size} became ready within {timeout} s "
                                   f"(engine_ready_timeout_s)")
        return ready

    # ---- what the server calls ------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        if self.fatal is not None:
            return self.fatal
        if len(self.dead) == len(self.coordinator.stats):
            return EngineDeadError("every engine has died: " + "; ".join(self.dead.values()))
        return None

    def _routing_hint(self, request: EngineCoreRequest):
        """What routing needs, computed outside the lock (DP's cache-aware policy: block hashes)."""
        return None

    def _choose_engine(self, hint) -> int:
        raise NotImplementedError

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        hint = self._routing_hint(request)
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(),
                   unfinished=set(range(request.sampling_params.n)), timers=RequestTimer.for_request(request))
        with self.lock:
            if self.dead_error is not None:
                raise self.dead_error
            job.engine = self._choose_engine(hint)
            self.coordinator.routed(job.engine)
            self.jobs[request.request_id] = job
        self._sends.put((job.engine, Kind.ADD, encode(request)))
        self.num_unfinished += 1
        finished = False
        try:
            while not finished:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                with self.lock:
                    ours = self.jobs.pop(request.request_id, None) is not None and job.engine not in self.dead
                    if ours and self.stat_logger is not None:
                        it = IterationStats(job.engine)
                        for timer in job.timers:
                            timer.on_abort(time.time(), it)
                        self.stat_logger.record(iteration_stats=it)
                if ours:
                    self._sends.put((job.engine, Kind.ABORT, encode([request.request_id])))
                    self.num_aborted += 1
            self.num_unfinished -= 1

    # ---- the sender and output threads ------------------------------------------------------

    def _send_loop(self) -> None:
        while (item := self._sends.get()) is not None:
            engine, kind, payload = item
            try:
                self.inp.send_multipart([f"engine-{engine}".encode(), kind.value, payload])
            except zmq.ZMQError as e:  # its socket is gone (ROUTER_MANDATORY), or the context is
                if self._stopping.is_set():
                    return
                with self.lock:
                    self._engine_died(engine, f"engine {engine} cannot be reached: {e}")

    def _output_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if self.out.poll(100):
                    kind, payload = self.out.recv_multipart()
                    with self.lock:
                        self._on_event(kind, payload)
                with self.lock:
                    self._check_engines()
        except Exception as e:  # noqa: BLE001: whatever broke, nobody may wait forever
            if not self._stopping.is_set():
                log.exception("the engine output path failed; the server cannot serve")
                with self.lock:
                    self.fatal = EngineDeadError(f"the engine output path failed: {e!r}")
                    for request_id in list(self.jobs):
                        self._deliver(request_id, self.fatal, done=True)

    def _on_event(self, kind: bytes, payload: bytes) -> None:
        if kind == Event.OUTPUTS.value:
            outs = decode(payload, EngineCoreOutputs)
            if outs.stats is not None:
                self.coordinator.report(outs.engine_index, outs.stats)
            by_request: dict[str, list[EngineCoreOutput]] = {}
            for o in outs.outputs:
                by_request.setdefault(o.request_id, []).append(o)
            if self.stat_logger is not None:  # before the outputs go out: their clients may scrape next
                self._record(outs, by_request)
            for request_id, group in by_request.items():
                job = self.jobs.get(request_id)
                if job is not None:  # None: its handler left already (the abort is on its way)
                    delta = _delta(job, group)
                    self._deliver(request_id, delta, done=delta.finished)
        elif kind == Event.ALIVE.value:
            self.coordinator.heard(decode(payload, int))
        elif kind == Event.REJECTED.value:
            r = decode(payload, Rejected)
            self._deliver(r.request_id, InvalidRequestError(r.message, r.param), done=True)
        elif kind == Event.DEAD.value:
            d = decode(payload, Dead)
            if d.engine_index not in self.dead:
                self._engine_died(d.engine_index, f"engine {d.engine_index} failed:\n{d.traceback}")

    def _record(self, outs: EngineCoreOutputs, by_request: dict[str, list[EngineCoreOutput]]) -> None:
        """One engine step's outputs into its requests' timers, and the step into the metrics."""
        now = time.time()
        it = IterationStats(outs.engine_index)
        for request_id, group in by_request.items():
            job = self.jobs.get(request_id)
            for o in group if job is not None else ():  # None: its handler left (counted as an abort)
                timer = job.timers[o.index]
                if o.scheduled_time is not None:  # the engine's clock, mapped onto ours
                    timer.on_scheduled(now - (outs.timestamp - o.scheduled_time))
                timer.on_output(now, len(o.new_token_ids), o.finish_reason, it)
        self.stat_logger.record(outs.scheduler_stats, it if outs.outputs else None)

    def _check_engines(self) -> None:
        for engine, p in self.procs.items():
            if not p.is_alive() and engine not in self.dead:
                self._engine_died(engine, f"engine {engine} died (exit code {p.exitcode})")
        for engine in self.coordinator.silent_engines():
            if engine not in self.dead:
                self._engine_died(engine, f"engine {engine} has not been heard from for "
                                          f"{self.coordinator.silence_limit_s:.0f} s")

    def _deliver(self, request_id: str, item, done: bool) -> None:
        job = self.jobs.pop(request_id, None) if done else self.jobs.get(request_id)
        if job is not None:
            job.loop.call_soon_threadsafe(job.outputs.put_nowait, item)

    def _engine_died(self, engine: int, reason: str) -> None:
        log.error("%s; its requests in flight fail with 503", reason)
        self.dead[engine] = reason
        self._forget(engine)
        if engine in self.procs and self.procs[engine].is_alive():
            self.procs[engine].kill()
        for request_id in [r for r, j in self.jobs.items() if j.engine == engine]:
            self._deliver(request_id, EngineDeadError(reason), done=True)

    def _forget(self, engine: int) -> None:
        """Routing stops considering a dead engine."""

    # ---- lifecycle -------------------------------------------------------------------------

    def run_engine_loop(self) -> None:
        """The server's main thread waits here until shutdown (the engines are elsewhere)."""
        self._stopping.wait()

    def shutdown(self) -> None:
        if self.inp.closed:
            return
        for engine in range(len(self.coordinator.stats)):
            if engine not in self.dead:
                self._sends.put((engine, Kind.SHUTDOWN, b""))
        self._sends.put(None)
        threads = getattr(self, "_threads", [])
        if threads:
            threads[0].join(timeout=5)  # the sender: the shutdowns are out
        else:  # failed during the handshake: nothing reads the queue
            for engine in range(len(self.coordinator.stats)):
                try:
                    self.inp.send_multipart([f"engine-{engine}".encode(), Kind.SHUTDOWN.value, b""])
                except zmq.ZMQError:
                    pass
        self._stopping.set()
        for t in threads[1:]:
            t.join(timeout=5)
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.inp.close()
        self.out.close()
        self.ctx.term()


def _delta(job: _Job, outputs: list[EngineCoreOutput]) -> RequestOutput:
    """The engine's per-completion outputs for one request, as one RequestOutput delta."""
    completions = []
    for o in outputs:
        lps = None if o.new_logprobs is None else [
            {e.token_id: Logprob(e.logprob, e.rank, e.decoded_token) for e in entry} for entry in o.new_logprobs]
        completions.append(CompletionOutput(o.index, o.new_text, o.new_token_ids, None, lps, o.finish_reason,
                                            o.stop_reason))
        if o.finish_reason is not None:
            job.unfinished.discard(o.index)
    r = job.request
    kv = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params is not None), None)
    prompt = next(([None] + [{e.token_id: Logprob(e.logprob, e.rank, e.decoded_token) for e in entry}
                             for entry in o.prompt_logprobs] for o in outputs if o.prompt_logprobs is not None), None)
    return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, completions, not job.unfinished, kv, prompt)


class AsyncMPClient(MPClient):
    """One engine core in a process of its own (vLLM V1's default layout)."""

    def __init__(self, config: EngineConfig):
        config.validate()  # every invalid setting at once (config.py), before the engine's process starts
        super().__init__(config, 1)

    def _choose_engine(self, hint) -> int:
        return 0


class DPAsyncMPClient(MPClient):
    """N engine cores; each request goes to the one the router picks."""

    def __init__(self, config: EngineConfig):
        config.validate()  # every invalid setting at once (config.py), before the router or an engine starts
        self.router = make_router(config.routing_policy, config.data_parallel_size)  # refuses unknown ones
        self.policy = config.routing_policy
        super().__init__(config, config.data_parallel_size)
        self.hasher = BlockHasher(config.block_size, make_none_hash(self.hash_seed))

    def _routing_hint(self, request: EngineCoreRequest) -> list[bytes]:
        if self.policy != "cache_aware":
            return []
        seq = SimpleNamespace(block_hashes=[], token_ids=request.prompt_token_ids,
                              request=SimpleNamespace(cache_salt=request.cache_salt))
        self.hasher.hash_new_full_blocks(seq)  # exactly the engines' hashes (part 07)
        return seq.block_hashes

    def _choose_engine(self, hint: list[bytes]) -> int:
        return self.router.route(hint, self.coordinator.loads())

    def _forget(self, engine: int) -> None:
        self.router.forget(engine)


def run_headless_engines(config: EngineConfig) -> int:
    """Another host's engines: ranks start..start+local-1, connecting to the API server. The server's
    main validated the configuration with headless=True (its --data-parallel-rpc-port among it)."""
    local = config.data_parallel_size_local or 1
    addr, port = config.data_parallel_address, config.data_parallel_rpc_port
    start = config.data_parallel_start_rank
    return join_all(start_engines(config, range(start, start + local), f"tcp://{addr}:{port}",
                                  f"tcp://{addr}:{port + 1}"))

