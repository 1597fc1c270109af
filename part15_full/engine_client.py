"""EngineClient: what the API server needs from an engine, wherever the engine runs.

    server routes ──▶ EngineClient ──┬── AsyncLLM: the engine on a thread of this process (async_llm.py)
                                     ├── AsyncMPClient: one engine core in a process of its own
                                     └── DPAsyncMPClient: several engine cores, a router in front
                                                          (core_client.py)

Every client validates a prompt into an EngineCoreRequest (`process_inputs`, a 400 before anything
is queued), streams RequestOutput deltas for it (`generate`; a consumer that stops early aborts
it), and says when it can no longer serve (`dead_error`: /health answers 503, requests in flight
end with EngineDeadError). The server talks to nothing else, so it runs unchanged over any of them.
This module is the interface only and imports none of the three, which import it; the server picks
one at its entry point (server.py: make_engine_client).

In vLLM: vllm/engine/protocol.py (EngineClient), vllm/v1/engine/async_llm.py (AsyncLLM) and
vllm/v1/engine/core_client.py (AsyncMPClient, DPAsyncMPClient)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator

from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

from .input_processor import InputProcessor
from .messages import EngineCoreRequest


class EngineDeadError(RuntimeError):
    """The engine serving a request (or every engine) has failed: the client gets a 503."""


class EngineClient(ABC):
    tokenizer: Tokenizer
    max_model_len: int
    processor: InputProcessor

    def process_inputs(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None, kv_transfer_params: dict | None = None,
                       priority: int = 0) -> EngineCoreRequest:
        """Validate and tokenize: raises InvalidRequestError (a 400) for what no engine could run."""
        return self.processor.process_inputs(prompt, params, request_id, cache_salt, kv_transfer_params, priority)

    @abstractmethod
    def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's output deltas until it finishes. If the consumer stops early (a
        client disconnect cancels it), the request is aborted in its engine."""

    @property
    @abstractmethod
    def dead_error(self) -> Exception | None:
        """Set once this client cannot serve any request."""

    def start(self) -> None:
        """Begin serving in the background (tests, notebooks); a server instead calls
        run_engine_loop() on its main thread."""

    @abstractmethod
    def run_engine_loop(self) -> None:
        """Serve until shutdown() (the main thread of `python -m ...server`)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and end every thread and process this client started."""

