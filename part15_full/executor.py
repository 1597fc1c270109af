"""The executor: where the model's steps run (vLLM: Executor and its Worker).

`execute_model` returns a Future at once, so the engine can schedule and prepare the next step
while this one runs. By default the step runs right away in the caller's thread (one thread:
nothing overlaps, the step is simply done when the Future comes back). While
`run_worker_loop()` serves, the steps run there instead, in order, and the engine core (the
scheduler, input preparation, output processing) runs on another thread.

The worker loop is meant for the main thread: on CPU, PyTorch runs about 2x slower on a thread
other than the one that has been using its OpenMP pool (part 02's finding), so the model keeps
the thread that loaded it and the Python bookkeeping moves away from it.

With tensor parallelism (part 09) the model runs in worker processes instead: MultiprocExecutor
(multiproc_executor.py) offers the same methods. This one, the model in the engine's own process, is
vLLM's UniProcExecutor."""
from __future__ import annotations

import queue
from concurrent.futures import Future

from .config import EngineConfig
from .model_runner import ModelInput, ModelRunner
from .parallel_state import ParallelConfig
from .runner_messages import SequenceBatchEntry


class Executor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self.serving = False
        self.error: Exception | None = None  # a MultiprocExecutor's, once a worker has died
        # What the engine needs to know about the model (a MultiprocExecutor hears it from rank 0).
        self.model_path, self.model_config = runner.model_path, runner.model_config
        self.max_model_len, self.num_blocks = runner.max_model_len, runner.num_blocks
        self.block_size, self.device = runner.block_size, runner.device
        self.kv_connector_info = runner.kv_connector_info

    def execute_batch(self, batch: list[SequenceBatchEntry], finished_seq_ids: list[str],
                      kv_connector_metadata=None, grammar_output=None, preempted_seq_ids: list[str] = ()) -> Future:
        """Prepare the step's inputs here (the engine's thread) and launch it."""
        return self.execute_model(self.runner.prepare_inputs(batch, kv_connector_metadata, grammar_output,
                                                             [*finished_seq_ids, *preempted_seq_ids]))

    @property
    def runs_elsewhere(self) -> bool:
        """Does a launched step run on another thread (so the engine can work meanwhile)?"""
        return self.serving

    def execute_model(self, model_input: ModelInput) -> Future:
        future: Future = Future()
        if self.serving:
            self._steps.put((model_input, future))
        else:
            self._run(model_input, future)
        return future

    def start_serving(self) -> None:
        """Route steps to the worker loop from now on (call before starting the engine thread,
        then run run_worker_loop())."""
        self.serving = True

    def run_worker_loop(self) -> None:
        """Run steps as they come, until stop()."""
        self.serving = True
        try:
            while (item := self._steps.get()) is not None:
                self._run(*item)
        finally:
            self.serving = False

    def stop(self) -> None:
        self._steps.put(None)

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:  # the host tier's copy threads
            self.runner.kv_connector.shutdown()

    def _run(self, model_input: ModelInput, future: Future) -> None:
        try:
            future.set_result(self.runner.execute_model(model_input))
        except BaseException as e:  # the engine sees it when it reads the result
            future.set_exception(e)


def make_executor(config: EngineConfig):
    """The uniprocess executor, or one worker process per tensor-parallel rank."""
    backend = config.distributed_executor_backend or ("mp" if config.world_size > 1 else "uni")
    if backend == "uni":
        if config.world_size > 1:
            raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 needs distributed_executor_backend mp")
        return Executor(ModelRunner(config))
    if backend != "mp":
        raise ValueError(f"distributed_executor_backend must be uni or mp, got {backend!r}")
    from shared.weights import resolve_model_path

    from .moe_config import load_configs
    from .multiproc_executor import MultiprocExecutor
    from .parallel_layers import check_divisible
    from .pipeline import get_pp_indices

    cfg, moe = load_configs(resolve_model_path(config.model))
    check_divisible(cfg, config.tensor_parallel_size)
    get_pp_indices(cfg.num_hidden_layers, 0, config.pipeline_parallel_size)  # or a ValueError: too few layers
    if moe is not None:
        moe.check_divisible(config.tensor_parallel_size, config.enable_expert_parallel)
    parallel = ParallelConfig.resolve(config.tensor_parallel_size, config.nnodes, config.node_rank,
                                      config.master_addr, config.master_port, config.pipeline_parallel_size)
    if parallel.node_rank != 0:
        raise ValueError(f"node {parallel.node_rank} runs workers only: start it with --headless")
    return MultiprocExecutor(config, parallel)
