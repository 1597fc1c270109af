"""A node that runs compute and no API server (`--headless`): with data parallelism, its share of the
engines, which connect to the API server's node (core_client.py); with tensor or pipeline parallelism
across nodes, its share of the ranks, which meet node 0's at the rendezvous address and take their
steps from node 0's engine (multiproc_executor.py). Either way it waits for them and exits with the
worst of their exit codes.

The server's entry point dispatches here, so the front end itself imports neither the executor nor
the worker.

In vLLM v0.33.0: vllm/entrypoints/cli/serve.py (run_headless)."""
from __future__ import annotations

from .config import EngineConfig
from .core_client import run_headless_engines
from .multiproc_executor import start_workers
from .parallel_state import ParallelConfig
from .process_utils import join_all


def run_headless(config: EngineConfig) -> int:
    """Run this node's engines or ranks until they end (the engine's node stops them, or they notice
    it is gone)."""
    if config.data_parallel_size > 1:
        return run_headless_engines(config)
    parallel = ParallelConfig.resolve(config.tensor_parallel_size, config.nnodes, config.node_rank,
                                      config.master_addr, config.master_port, config.pipeline_parallel_size)
    return join_all(start_workers(config, parallel))
