"""DPAsyncLLM: the API server's side of data parallelism. N engine-core processes (engine_core.py),
each a whole engine with its own KV cache, behind one API server that validates requests, routes
each to one engine, and streams that engine's outputs back to the request's handler.

    handler ── make_request (validate) ── generate ──route──▶ ROUTER ──▶ engine i (DEALER)
    handler ◀── its queue ◀── output thread ◀── PULL ◀── engine i (PUSH): deltas + stats

* Routing (router.py) sees the coordinator's loads; the cache-aware policy also sees the prompt's
  block hashes, computed here with the engines' hash seed (sent to them at the handshake).
* Aborts go to the engine that holds the request.
* An engine that dies (its process ends, it reports a fatal error, or it falls silent) is forgotten
  by the router; its requests in flight end with EngineDeadError (a 503 for the client), and the
  others keep serving. No request waits forever.
* Engines may run on other hosts: `--headless` starts a host's engines, which connect to the API
  server's address (run_headless_engines).

In vLLM: vllm/v1/engine/core_client.py (DPAsyncMPClient, DPLBAsyncMPClient) and
vllm/v1/engine/output_processor.py (the front-end's view of each request)."""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import pickle
import secrets
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import AsyncIterator

import torch
import zmq

from shared.errors import InvalidRequestError
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from shared.weights import resolve_model_path

from .config import EngineConfig
from .coordinator import Coordinator
from .engine_core import engine_core_main
from .input_processor import InputProcessor
from .kv_cache_utils import BlockHasher, make_none_hash
from .router import make_router

STARTUP_TIMEOUT_S = 600


class EngineDeadError(RuntimeError):
    pass


@dataclass
class RemoteRequest:
    """A request as the API server sees it: what was asked, and the outputs received so far."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    aborted: bool = False
    finished: bool = False
    completions: list[CompletionOutput] = field(default_factory=list)

    def absorb(self, delta: RequestOutput) -> None:
        """Add an engine's delta to the whole output (text and tokens appended, reasons replaced)."""
        if not self.completions:
            self.completions = [CompletionOutput(i, "", [], None, None) for i in range(self.params.n)]
        for d in delta.outputs:
            c = self.completions[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + sum(
                    lp[t].logprob for t, lp in zip(d.token_ids, d.logprobs))
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        self.finished = delta.finished

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [dataclasses.replace(c, token_ids=list(c.token_ids)) for c in self.completions],
                             self.finished)


@dataclass
class _Job:
    request: RemoteRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    engine: int


def _start_engines(config: EngineConfig, ranks: range, input_addr: str, output_addr: str) -> dict:
    ctx = mp.get_context("spawn")
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // max(1, len(ranks)))
    config = dataclasses.replace(config, num_threads=threads)
    procs = {}
    for rank in ranks:
        procs[rank] = ctx.Process(target=engine_core_main, args=(config, rank, input_addr, output_addr),
                                  name=f"engine-core-{rank}")  # not daemonic: it may start TP workers
        procs[rank].start()
    return procs


class DPAsyncLLM:
    def __init__(self, config: EngineConfig):
        size = config.data_parallel_size
        local = size if config.data_parallel_size_local is None else config.data_parallel_size_local
        if not 0 <= local <= size:
            raise ValueError(f"data_parallel_size_local must be in [0, {size}]")
        if local < size and not config.data_parallel_rpc_port:
            raise ValueError("engines on other hosts need a fixed --data-parallel-rpc-port to connect to")
        self.router = make_router(config.routing_policy, size)  # refuses an unknown policy
        self.policy = config.routing_policy
        seed = config.prefix_caching_hash_seed or secrets.token_hex(16)
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
        self.procs = _start_engines(config, range(local), f"tcp://{addr}:{ports[0]}", f"tcp://{addr}:{ports[1]}")
        self.lock = threading.Lock()  # jobs, router, coordinator and the ROUTER socket
        self.jobs: dict[str, _Job] = {}
        self.dead: dict[int, str] = {}
        self.num_unfinished = self.num_aborted = 0
        self.coordinator = Coordinator(size)
        try:
            info = self._handshake(size, {"prefix_caching_hash_seed": seed})
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = Tokenizer(resolve_model_path(config.model))
        self.max_model_len = info[0]["max_model_len"]
        self.processor = InputProcessor(self.tokenizer, info[0]["model_config"], self.max_model_len,
                                        min(i["num_blocks"] for i in info.values()), config.block_size,
                                        torch.device("cpu"))
        self.hasher = BlockHasher(config.block_size, make_none_hash(seed))
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._output_loop, name="dp-outputs", daemon=True)
        self._thread.start()

    def _handshake(self, size: int, shared: dict) -> dict[int, dict]:
        """Answer every engine's hello with the shared settings; wait until all are ready."""
        ready: dict[int, dict] = {}
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        poller.register(self.out, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < size:
            events = dict(poller.poll(500))
            if self.inp in events:
                identity, payload = self.inp.recv_multipart()
                self.inp.send_multipart([identity, pickle.dumps(("init", shared))])
            if self.out in events:
                msg = pickle.loads(self.out.recv())
                if msg[0] == "ready":
                    ready[msg[1]] = msg[2]
                elif msg[0] == "dead":
                    raise RuntimeError(f"engine {msg[1]} failed to start:\n{msg[2]}")
            gone = [r for r, p in self.procs.items() if not p.is_alive() and r not in ready]
            if gone:
                raise RuntimeError(f"engine {gone[0]} exited while starting (exit code {self.procs[gone[0]].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only engines {sorted(ready)} of {size} became ready")
        return ready

    # ---- the API: what the server's handlers call --------------------------------------

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str | None = None) -> RemoteRequest:
        r = self.processor.make_request(prompt, params, request_id, cache_salt)  # raises a 400's error
        return RemoteRequest(r.request_id, r.prompt, r.prompt_token_ids, params, cache_salt)

    @property
    def error(self) -> EngineDeadError | None:
        """Set when no engine is left to serve."""
        if len(self.dead) == len(self.coordinator.stats):
            return EngineDeadError("every engine has died: " + "; ".join(self.dead.values()))
        return None

    async def generate(self, request: RemoteRequest) -> AsyncIterator[RequestOutput]:
        """Route the request, then yield each delta its engine sends until it finishes. If the
        consumer stops early (client disconnect), the engine holding it gets an abort."""
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(), -1)
        with self.lock:
            if self.error is not None:
                raise self.error
            hashes = self._block_hashes(request) if self.policy == "cache_aware" else []
            job.engine = self.router.route(hashes, self.coordinator.loads())
            self.coordinator.routed(job.engine)
            self.jobs[request.request_id] = job
            self._send(job.engine, ("add", request.request_id, request.prompt, request.prompt_token_ids,
                                    request.params, request.cache_salt))
        self.num_unfinished += 1
        try:
            while True:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                request.absorb(item)
                yield item
                if item.finished:
                    return
        finally:
            if not request.finished:
                request.aborted = True
                with self.lock:
                    if self.jobs.pop(request.request_id, None) is not None and job.engine not in self.dead:
                        self._send(job.engine, ("abort", request.request_id))
                        self.num_aborted += 1
            self.num_unfinished -= 1

    def _block_hashes(self, request: RemoteRequest) -> list[bytes]:
        seq = SimpleNamespace(block_hashes=[], token_ids=request.prompt_token_ids,
                              request=SimpleNamespace(cache_salt=request.cache_salt))
        self.hasher.hash_new_full_blocks(seq)  # exactly the engines' hashes (part 07)
        return seq.block_hashes

    def _send(self, engine: int, msg: tuple) -> None:
        try:
            self.inp.send_multipart([f"engine-{engine}".encode(), pickle.dumps(msg)])
        except zmq.ZMQError:  # its socket is gone: the output thread will declare it dead
            pass

    # ---- the output thread -----------------------------------------------------------------

    def _output_loop(self) -> None:
        while not self._stopping.is_set():
            if self.out.poll(100):
                msg = pickle.loads(self.out.recv())
                kind, engine = msg[0], msg[1]
                with self.lock:
                    if kind == "outputs":
                        self.coordinator.report(engine, msg[3])
                        for delta in msg[2]:
                            self._deliver(delta.request_id, delta, done=delta.finished)
                    elif kind == "alive":
                        self.coordinator.heard(engine)
                    elif kind == "rejected":
                        self._deliver(msg[2], InvalidRequestError(msg[3], msg[4]), done=True)
                    elif kind == "dead":
                        self._engine_died(engine, f"engine {engine} failed:\n{msg[2]}")
            with self.lock:
                for engine, p in self.procs.items():
                    if not p.is_alive() and engine not in self.dead:
                        self._engine_died(engine, f"engine {engine} died (exit code {p.exitcode})")
                for engine in self.coordinator.silent_engines():
                    if engine not in self.dead:
                        self._engine_died(engine, f"engine {engine} has not been heard from")

    def _deliver(self, request_id: str, item, done: bool) -> None:
        job = self.jobs.pop(request_id, None) if done else self.jobs.get(request_id)
        if job is not None:  # None: its handler left already (the abort is on its way)
            job.loop.call_soon_threadsafe(job.outputs.put_nowait, item)

    def _engine_died(self, engine: int, reason: str) -> None:
        self.dead[engine] = reason
        self.router.forget(engine)
        if engine in self.procs and self.procs[engine].is_alive():
            self.procs[engine].kill()
        for request_id in [r for r, j in self.jobs.items() if j.engine == engine]:
            self._deliver(request_id, EngineDeadError(reason), done=True)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        pass  # the output thread runs from construction on (AsyncLLM's interface)

    def run_engine_loop(self) -> None:
        """The server's main thread waits here until shutdown (the engines are elsewhere)."""
        self._stopping.wait()

    def shutdown(self) -> None:
        if self.inp.closed:
            return
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
            self._thread.join(timeout=5)
        with self.lock:
            for engine in range(len(self.coordinator.stats)):
                if engine not in self.dead:
                    self._send(engine, ("shutdown",))
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.inp.close()
        self.out.close()
        self.ctx.term()


def run_headless_engines(config: EngineConfig) -> int:
    """Another host's engines: ranks start..start+local-1, connecting to the API server."""
    if not config.data_parallel_rpc_port:
        raise ValueError("--headless engines need the API server's --data-parallel-rpc-port")
    local = config.data_parallel_size_local or 1
    addr, port = config.data_parallel_address, config.data_parallel_rpc_port
    start = config.data_parallel_start_rank
    procs = _start_engines(config, range(start, start + local), f"tcp://{addr}:{port}", f"tcp://{addr}:{port + 1}")
    try:
        for p in procs.values():
            p.join()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
    return max((abs(p.exitcode or 0) for p in procs.values()), default=0)
