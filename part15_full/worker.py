"""A worker process: one tensor-parallel rank of one pipeline stage, with its shard of the stage's
layers and of their KV cache.

Every rank hears each step from the engine directly: the driver publishes the step's plain
scheduling data once on a ZeroMQ PUB socket and every rank, on this node or another, has it at
once (vLLM broadcasts the scheduler output the same way, through a shared-memory ring for local
ranks). Every rank then prepares the same inputs, runs its shard of the same forward pass (the
all-reduces meet in the middle) and samples the same tokens from the same all-gathered logits, so
every rank also keeps the same placeholder tokens for the next step (part 05) without asking
anyone. For that, their random streams must agree too: unseeded rows draw from each process's
global generator, seeded from one value rank 0 broadcasts; a seeded sequence gets its own
generator, made here from the seed on first sight and dropped when it finishes. The last stage's
first rank sends the sampled tokens back (rank 0 with one stage); any rank that fails sends its
traceback. With pipeline stages (pipeline.py) each stage's ranks run its layers on the activations
the previous stage sends; only the last stage samples.

Async scheduling survives the process hop: a receiver thread takes step N+1 off the socket and
prepares its inputs while the main thread runs step N, and a sender thread copies step N's tokens
to the host and sends them (on a GPU that copy waits for the step; the main thread does not).

The only process that touches the network API is the engine's; workers never see a request.

In vLLM: vllm/v1/executor/multiproc_executor.py (WorkerProc) and vllm/v1/worker/gpu_worker.py."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import queue
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from shared.model import LayerFactory
from shared.sampler import SampledBatch, make_generator

from . import envs
from .config import EngineConfig
from . import prompt_logprobs
from .model_runner import ModelRunner
from .parallel_layers import TensorParallelLayers
from .parallel_state import ParallelConfig, init_distributed, rank_device
from .pipeline import PipelineStage
from .process_utils import follow_parent
from .runner_messages import ModelRunnerOutput, SequenceBatchEntry, StepMessage


DRIVER_SILENCE_MS = 10_000


def worker_main(config: EngineConfig, parallel: ParallelConfig, rank: int, num_threads: int) -> None:
    """The body of a worker process (started with multiprocessing's spawn)."""
    follow_parent()
    torch.set_num_threads(num_threads)
    device = rank_device(config.device, rank, parallel.ranks_per_node, torch.cuda.is_available())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = zmq.Context()
    steps = ctx.socket(zmq.SUB)
    # zmq's I/O thread answers heartbeats even while the driver's Python is busy, so silence means
    # the driver (its process, or its host) is gone: the rank then disconnects and exits.
    steps.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    steps.setsockopt(zmq.HEARTBEAT_TIMEOUT, DRIVER_SILENCE_MS)
    gone = steps.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.connect(parallel.broadcast_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(parallel.result_addr)
    try:
        cpu_group = init_distributed(parallel, rank, device, config)
        size, stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        stage, tp_rank = parallel.coordinates(rank)
        # A group of one needs no sharding and no collectives (each would still cost a call into gloo).
        layers = TensorParallelLayers(tp_rank, size) if size > 1 else LayerFactory() if stages > 1 else None
        pipeline = PipelineStage(stage, stages, size, rank) if stages > 1 else None
        runner = ModelRunner(config, layers, str(device), pipeline)
        if stages > 1:  # every stage holds as many blocks as the one with room for the fewest
            blocks = torch.tensor([runner.num_blocks])
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=cpu_group)
            runner.num_blocks = int(blocks)
        seed = [config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "little")]  # --seed
        dist.broadcast_object_list(seed, src=0, group=cpu_group)
        torch.manual_seed(seed[0])  # the same stream on every rank, for unseeded sampling
        if rank == 0:
            results.send(pickle.dumps(("ready", {
                "model_path": runner.model_path, "model_config": runner.model_config,
                "max_model_len": runner.max_model_len, "num_blocks": runner.num_blocks,
                "block_size": runner.block_size, "kv_connector_info": runner.kv_connector_info,
                "cudagraph_mode": runner.cudagraph_mode, "device": str(device)})))
        if envs.VLLM_COURSE_STEP_TIMELINE:
            runner.timeline = []  # perf_counter: one clock for every process of the host
        WorkerProc(runner, rank == parallel.output_rank, steps, gone, results).run()
    except BaseException:
        try:
            results.send(pickle.dumps(("error", f"rank {rank}:\n{traceback.format_exc()}")))
        except zmq.ZMQError:
            pass
        raise
    finally:
        if "runner" in locals() and runner.timeline is not None:
            folder = Path(envs.VLLM_COURSE_STEP_TIMELINE)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{rank}.json").write_text(json.dumps(runner.timeline))
        if "runner" in locals() and runner.kv_connector is not None:
            runner.kv_connector.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.destroy(linger=2000)


class WorkerProc:
    """Three threads: the receiver prepares step N+1's inputs while the main thread runs step N,
    and (the output rank) the sender ships each step's tokens back as soon as they are on the host."""

    def __init__(self, runner: ModelRunner, sends_results: bool, steps: zmq.Socket, gone: zmq.Socket,
                 results: zmq.Socket):
        self.runner, self.sends_results = runner, sends_results
        self.steps, self.gone, self.results = steps, gone, results
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()  # prepared steps, None: stop
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # step results to send, None: stop
        self.generators: dict[str, torch.Generator] = {}

    def run(self) -> None:
        receiver = threading.Thread(target=self._receive_loop, name="step-receiver", daemon=True)
        receiver.start()
        sender = threading.Thread(target=self._send_loop, name="result-sender", daemon=True)
        if self.sends_results:
            sender.start()
        try:
            while (item := self.inputs.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                out = self.runner.execute_model(item)
                if self.sends_results:
                    self.outputs.put(out)
        finally:
            self.outputs.put(None)
            if sender.is_alive():
                sender.join()

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.steps, zmq.POLLIN)
        poller.register(self.gone, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self.gone in events:  # the driver is gone (its process or its host)
                    self.inputs.put(None)
                    return
                msg: StepMessage | None = pickle.loads(self.steps.recv())
                if msg is None:  # shutdown
                    self.inputs.put(None)
                    return
                self.inputs.put(self.runner.prepare_inputs(self._with_generators(msg), msg.kv_connector_metadata,
                                                             msg.grammar_output,
                                                             [*msg.finished_seq_ids, *msg.preempted_seq_ids]))
        except BaseException as e:  # re-raised by the main thread, which reports it
            self.inputs.put(e)

    def _with_generators(self, msg: StepMessage) -> list[SequenceBatchEntry]:
        for seq_id in msg.finished_seq_ids:
            self.generators.pop(seq_id, None)
        for seq_id, s in msg.seeds.items():
            if seq_id not in self.generators:
                self.generators[seq_id] = make_generator(s, self.runner.device)
        return [e if e.sampling is None or e.seq_id not in self.generators else
                dataclasses.replace(e, sampling=dataclasses.replace(e.sampling, generator=self.generators[e.seq_id]))
                for e in msg.batch]

    def _send_loop(self) -> None:
        while (out := self.outputs.get()) is not None:
            self.results.send(pickle.dumps(("ok", _to_host(out))))


def _to_host(out: ModelRunnerOutput) -> ModelRunnerOutput:
    """The step's result, picklable: tensors moved to the CPU (on a GPU this waits for the step)."""
    sampled = out.sampled
    if isinstance(sampled, SampledBatch):
        sampled = SampledBatch(**{f.name: v.cpu() if isinstance(v, torch.Tensor) else v
                                  for f in dataclasses.fields(sampled) for v in [getattr(sampled, f.name)]})
    # a RejectionOutput is host data already
    return ModelRunnerOutput(sampled, out.kv_connector_output, prompt_logprobs.to_host(out.prompt_logprobs))
