"""An engine-core process: one whole engine (scheduler, KV cache, model; tensor-parallel workers
of its own if asked) serving the API server over ZeroMQ.

Sockets (the API server binds both, engines connect, so an engine may run on another host):

    API server ROUTER  <── DEALER  engine i    requests, aborts, pings in, addressed by identity
    API server PULL    <── PUSH    engine i    outputs, stats and heartbeats out

Handshake: the engine says hello, the API server answers with what every engine must share (the
prefix-cache hash seed, so that the server's cache-aware router computes the engines' block
hashes), the engine builds its LLMEngine and says ready with its model's shape and KV pool size.
Then the busy loop: take every message that has arrived (waiting for one only when idle), run one
engine step, send the requests' new output deltas with the engine's stats (when idle, every
HEARTBEAT_S): the coordinator's load figures and the scheduler's state for /metrics (stats.py), plus
when each completion was first scheduled, sent with its first output (the API process times
requests; it cannot see the scheduler). A thread of its own says "alive" every HEARTBEAT_S on a
socket of its own, even while a long step runs, so the server can tell a busy engine from a dead one. The other way round, the
engine leaves when its server is gone: zmq's heartbeats on the DEALER find a vanished server (its
process, or its host) and the engine exits instead of lingering (a headless engine has no parent
to follow).

Every message is a typed struct (messages.py), msgpack on the wire.

In vLLM: vllm/v1/engine/core.py (EngineCoreProc, DPEngineCoreProc: the busy loop, input and
output threads)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback

import torch
import zmq

from shared.errors import InvalidRequestError

from .config import EngineConfig
from .coordinator import HEARTBEAT_S, EngineStats
from .engine import LLMEngine, run_overlapped
from .messages import (EngineCoreEventType as Event, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                       EngineCoreRequestType as Kind, Dead, Handshake, LogprobEntry, Ready, Rejected, decode, encode)
from .parallel_state import engine_device
from .request import Request
from .stats import make_scheduler_stats, sequences_not_started
from .process_utils import follow_parent

log = logging.getLogger("vllm_course.engine_core")
SERVER_SILENCE_MS = 10_000  # zmq answers heartbeats from its I/O thread: silence means gone


def engine_core_main(config: EngineConfig, rank: int, input_addr: str, output_addr: str) -> None:
    """The body of engine `rank`'s process."""
    follow_parent()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, f"engine-{rank}".encode())
    inp.setsockopt(zmq.LINGER, 0)
    inp.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    inp.setsockopt(zmq.HEARTBEAT_TIMEOUT, SERVER_SILENCE_MS)
    gone = inp.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    engine = None
    try:
        inp.send_multipart([Event.HELLO.value, encode(rank)])
        if not inp.poll(config.engine_ready_timeout_s * 1000):
            raise TimeoutError(f"the API server did not answer engine {rank}'s hello")
        _, payload = inp.recv_multipart()
        shared = decode(payload, Handshake)
        config = dataclasses.replace(config, prefix_caching_hash_seed=shared.prefix_caching_hash_seed)
        # On one host's GPUs, each engine and its ranks (TP x PP) on GPUs of their own (part 15).
        device = engine_device(config.device, rank - config.data_parallel_start_rank,
                               config.tensor_parallel_size * config.pipeline_parallel_size,  # one node's (validate)
                               torch.cuda.is_available())
        config = dataclasses.replace(config, device=device)
        if device is not None and device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        # With tensor parallelism this process only schedules: the workers get the cores.
        torch.set_num_threads(1 if config.world_size > 1 else config.num_threads or torch.get_num_threads())
        engine = LLMEngine(config)
        threading.Thread(target=_heartbeat, args=(ctx, output_addr, rank), name="heartbeat", daemon=True).start()
        out.send_multipart([Event.READY.value, encode(Ready(rank, engine.executor.model_config,
                                                            engine.max_model_len, engine.executor.num_blocks))])
        core = EngineCore(engine, rank, inp, gone, out)
        if engine.max_steps_in_flight > 1:  # the model keeps this (main) thread, as in part 05
            run_overlapped(engine.executor, core.busy_loop)
        else:
            core.busy_loop()
    except Exception:
        out.send_multipart([Event.DEAD.value, encode(Dead(rank, traceback.format_exc()))])
        raise
    finally:
        if engine is not None:
            engine.shutdown()
        inp.disable_monitor()
        for sock in (gone, inp, out):
            sock.close()
        ctx.term()  # the heartbeat thread sees ContextTerminated and closes its own socket


class EngineCore:
    def __init__(self, engine: LLMEngine, rank: int, inp: zmq.Socket, gone: zmq.Socket, out: zmq.Socket):
        self.engine, self.rank, self.inp, self.out = engine, rank, inp, out
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.poller.register(gone, zmq.POLLIN)
        self.gone = gone
        self.num_aborted = self.num_finished = 0
        # seq_id -> when it was first scheduled (this process's monotonic clock), until its first output
        self.first_scheduled: dict[str, float] = {}

    def busy_loop(self) -> None:
        last_report = 0.0
        while True:
            idle = not self.engine.has_unfinished_requests()
            # Idle: sleep until a message comes, waking for the heartbeat. Busy: just look.
            events = dict(self.poller.poll(int(HEARTBEAT_S * 1000) if idle else 0))
            if self.gone in events:
                log.warning("engine %d: the API server is gone; exiting", self.rank)
                return
            while self.inp in events:
                kind, payload = self.inp.recv_multipart()
                if kind == Kind.SHUTDOWN.value:
                    return
                self._handle(kind, payload)
                events = dict(self.poller.poll(0))
            outputs = []
            if self.engine.has_unfinished_requests():
                start = time.monotonic()  # a step schedules before it runs the model
                touched = self.engine.step()
                for seq in sequences_not_started(self.engine):
                    self.first_scheduled.setdefault(seq.seq_id, start)
                for request in touched:
                    for o in _outputs_of(request):
                        o.scheduled_time = self._first_scheduled(request.sequences[o.index], o, start)
                        outputs.append(o)
                    self.num_finished += request.finished
            if outputs or time.monotonic() - last_report >= HEARTBEAT_S:
                last_report = time.monotonic()
                self.out.send_multipart([Event.OUTPUTS.value, encode(EngineCoreOutputs(
                    self.rank, outputs, self.stats(), make_scheduler_stats(self.engine, self.rank), last_report))])

    def _first_scheduled(self, seq, output: EngineCoreOutput, step_start: float) -> float | None:
        """When `seq` was first scheduled, for its first output only. Not recorded yet and this is
        its first output (all its tokens are new): it was scheduled in this very step call."""
        t = self.first_scheduled.pop(seq.seq_id, None)
        if t is None and len(output.new_token_ids) == len(seq.state.token_ids):
            t = step_start
        return t

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == Kind.ADD.value:
            request = decode(payload, EngineCoreRequest)
            try:
                request.sampling_params.verify_vocab(self.engine.executor.model_config.vocab_size)
                self.engine.add_request(request)
            except InvalidRequestError as e:  # the API server validates first; this is a backstop
                self.out.send_multipart([Event.REJECTED.value, encode(Rejected(request.request_id, str(e), e.param))])
        elif kind == Kind.ABORT.value:
            for request_id in decode(payload, list[str]):
                if request_id in self.engine.requests:  # it may have finished on the way
                    for seq in self.engine.requests[request_id].sequences:
                        self.first_scheduled.pop(seq.seq_id, None)
                    self.engine.abort_request(request_id)
                    self.num_aborted += 1

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        cache = self.engine.prefix_cache_stats
        return EngineStats(len(s.waiting), len(s.running), cache.queries, cache.hits, self.num_aborted,
                           self.num_finished)


def _outputs_of(request: Request) -> list[EngineCoreOutput]:
    """One output per completion with something new (or a reason to finish)."""
    outs, delta = [], request.output(delta=True)
    for d in delta.outputs:
        if not (d.token_ids or d.text or d.finish_reason):
            continue
        lps = None if d.logprobs is None else [
            [LogprobEntry(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()] for entry in d.logprobs]
        outs.append(EngineCoreOutput(request.request_id, d.index, d.token_ids, d.text, lps, d.finish_reason,
                                     d.stop_reason, delta.kv_transfer_params if d.finish_reason else None))
    if outs and delta.prompt_logprobs is not None:  # once, with the first output (the None first is implied)
        outs[0].prompt_logprobs = [[LogprobEntry(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()]
                                   for entry in delta.prompt_logprobs[1:]]
    return outs


def _heartbeat(ctx: zmq.Context, output_addr: str, rank: int) -> None:
    sock = ctx.socket(zmq.PUSH)  # zmq sockets are not thread-safe: this thread has its own
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(output_addr)
    try:
        while True:
            time.sleep(HEARTBEAT_S)
            sock.send_multipart([Event.ALIVE.value, encode(rank)])
    except zmq.ContextTerminated:  # the engine is shutting down
        sock.close()
