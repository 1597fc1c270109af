"""An engine-core process: one whole engine (scheduler, KV cache, model; tensor-parallel workers
of its own if asked) serving the API server over ZeroMQ.

Sockets (the API server binds both, engines connect, so an engine may run on another host):

    API server ROUTER  <── DEALER  engine i    requests and aborts in, addressed by identity
    API server PULL    <── PUSH    engine i    outputs and stats out

Handshake: the engine says hello, the API server answers with what every engine must share (the
prefix-cache hash seed, so that the server's cache-aware router computes the engines' block
hashes), the engine builds its LLMEngine and says ready with its KV pool size. Then the busy loop:
take every message that has arrived (waiting for one only when idle), run one engine step, send the
requests' new output deltas with the engine's stats (when idle, every HEARTBEAT_S). A thread of its
own says "alive" every HEARTBEAT_S on a socket of its own, even while a long step runs, so the
server can tell a busy or quiet engine from a dead one.

Messages are pickled Python objects: the engines and the API server trust each other (one
deployment, a private network), as vLLM's engine-core transport does.

In vLLM: vllm/v1/engine/core.py (EngineCoreProc, DPEngineCoreProc: the busy loop, input and
output threads)."""
from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import traceback

import torch
import zmq

from shared.errors import InvalidRequestError

from .config import EngineConfig
from .coordinator import HEARTBEAT_S, EngineStats
from .engine import LLMEngine, run_overlapped
from .worker import follow_parent


def engine_core_main(config: EngineConfig, rank: int, input_addr: str, output_addr: str) -> None:
    """The body of engine `rank`'s process."""
    follow_parent()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, f"engine-{rank}".encode())
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    try:
        inp.send(pickle.dumps(("hello", rank)))
        kind, shared = pickle.loads(inp.recv())
        config = dataclasses.replace(config, **shared)
        if config.num_threads and config.tensor_parallel_size == 1:
            torch.set_num_threads(config.num_threads)
        engine = LLMEngine(config)
        threading.Thread(target=_heartbeat, args=(ctx, output_addr, rank), name="heartbeat", daemon=True).start()
        out.send(pickle.dumps(("ready", rank, {"num_blocks": engine.executor.num_blocks, "max_model_len":
                                                engine.max_model_len, "model_config": engine.executor.model_config})))
        core = EngineCore(engine, rank, inp, out)
        if engine.max_steps_in_flight > 1:  # the model keeps this (main) thread, as in part 05
            run_overlapped(engine.executor, core.busy_loop)
        else:
            core.busy_loop()
    except Exception:
        out.send(pickle.dumps(("dead", rank, traceback.format_exc())))
        raise
    finally:
        if "engine" in locals():
            engine.shutdown()
        inp.close()
        out.close()
        ctx.term()


class EngineCore:
    def __init__(self, engine: LLMEngine, rank: int, inp: zmq.Socket, out: zmq.Socket):
        self.engine, self.rank, self.inp, self.out = engine, rank, inp, out
        self.requests = {}
        self.num_aborted = self.num_finished = 0

    def busy_loop(self) -> None:
        last_report = 0.0
        while True:
            idle = not self.engine.has_unfinished_requests()
            # Idle: sleep until a message comes, waking for the heartbeat. Busy: just look.
            if self.inp.poll(int(HEARTBEAT_S * 1000) if idle else 0):
                while True:
                    msg = pickle.loads(self.inp.recv())
                    if msg[0] == "shutdown":
                        return
                    self._handle(msg)
                    if not self.inp.poll(0):
                        break
            deltas = []
            if self.engine.has_unfinished_requests():
                for request in self.engine.step():
                    deltas.append(request.output(delta=True))
                    if request.finished:
                        self.requests.pop(request.request_id, None)
                        self.num_finished += 1
            if deltas or time.monotonic() - last_report >= HEARTBEAT_S:
                self.out.send(pickle.dumps(("outputs", self.rank, deltas, self.stats())))
                last_report = time.monotonic()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, request_id, prompt, prompt_token_ids, params, cache_salt = msg
            try:
                request = self.engine.make_request(prompt_token_ids, params, request_id, cache_salt)
            except InvalidRequestError as e:  # the API server validates first; this is a backstop
                self.out.send(pickle.dumps(("rejected", self.rank, request_id, str(e), e.param)))
                return
            request.prompt = prompt
            self.requests[request_id] = request
            self.engine.add_request(request)
        elif msg[0] == "abort":
            request = self.requests.pop(msg[1], None)
            if request is not None:  # it may have finished while the abort was on its way
                self.engine.abort_request(request)
                self.num_aborted += 1

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        cache = self.engine.prefix_cache_stats
        return EngineStats(len(s.waiting), len(s.running), cache.queries, cache.hits, self.num_aborted,
                           self.num_finished)


def _heartbeat(ctx: zmq.Context, output_addr: str, rank: int) -> None:
    sock = ctx.socket(zmq.PUSH)  # zmq sockets are not thread-safe: this thread has its own
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(output_addr)
    try:
        while True:
            time.sleep(HEARTBEAT_S)
            sock.send(pickle.dumps(("alive", rank)))
    except zmq.ContextTerminated:  # the engine is shutting down
        sock.close()
