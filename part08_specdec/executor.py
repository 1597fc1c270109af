"""The executor: where the model's steps run (vLLM: Executor and its Worker).

`execute_model` returns a Future at once, so the engine can schedule and prepare the next step
while this one runs. By default the step runs right away in the caller's thread (one thread:
nothing overlaps, the step is simply done when the Future comes back). While
`run_worker_loop()` serves, the steps run there instead, in order, and the engine core (the
scheduler, input preparation, output processing) runs on another thread.

The worker loop is meant for the main thread: on CPU, PyTorch runs about 2x slower on a thread
other than the one that has been using its OpenMP pool (part 02's finding), so the model keeps
the thread that loaded it and the Python bookkeeping moves away from it."""
from __future__ import annotations

import queue
from concurrent.futures import Future

from .model_runner import ModelInput, ModelRunner


class Executor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self.serving = False

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

    def _run(self, model_input: ModelInput, future: Future) -> None:
        try:
            future.set_result(self.runner.execute_model(model_input))
        except BaseException as e:  # the engine sees it when it reads the result
            future.set_exception(e)
