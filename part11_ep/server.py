"""An async OpenAI-compatible server with streaming (SSE).

Generation runs on the AsyncLLM's engine thread, so the event loop stays free: /health answers
during a long generation, tokens stream as they are made, and a client that disconnects stops
its generation. The prompts of one /v1/completions request are generated together, so
continuous batching runs them in the same steps.

    python -m partNN_<name>.server [--model M] [--host 127.0.0.1] [--port 8000]

Tensor parallelism (part 09), one machine, and two (node 0 serves; node 1 runs ranks only):

    python -m partNN_<name>.server --tensor-parallel-size 3
    python -m partNN_<name>.server --tensor-parallel-size 4 --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500               # on 10.0.0.1
    python -m partNN_<name>.server --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \\
        --master-addr 10.0.0.1 --master-port 29500 --headless    # on the other machine

Data parallelism (part 10): engine-core processes behind this server, on this host or others:

    python -m partNN_<name>.server --data-parallel-size 2 --routing-policy cache_aware
    python -m partNN_<name>.server --data-parallel-size 4 --data-parallel-size-local 2 \
        --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345        # on 10.0.0.1
    python -m partNN_<name>.server --data-parallel-size 4 --data-parallel-size-local 2 \
        --data-parallel-start-rank 2 --data-parallel-address 10.0.0.1 \
        --data-parallel-rpc-port 13345 --headless                               # on the other host

The app: `build_app` makes the FastAPI object and its state (the engine client, the response
builder); the route handlers below read that state from the request; `streaming.py` holds the
helpers that run a request to the end or interleave several into one stream. The handlers talk to
an EngineClient only (engine_client.py), so the same app serves an engine in this process, one in
a process of its own, or several behind a router; `make_engine_client` picks which."""
from __future__ import annotations

import argparse
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest

from shared.protocol import ChatCompletionRequest, ChatCompletionStreamResponse, CompletionRequest, CompletionStreamResponse
from shared.serving import OpenAIServing, error_response, install_error_handlers, new_request_id, sse_response
from shared.weights import served_model_name

from .async_llm import AsyncLLM
from .config import EngineConfig
from .core_client import AsyncMPClient, DPAsyncMPClient, run_headless_engines
from .engine import LLMEngine
from .engine_client import EngineClient, EngineDeadError
from .multiproc_executor import WorkerDied, run_headless
from .parallel_state import ParallelConfig
from .streaming import interleave, run_to_end, stream_error

ENGINE_ERRORS = (WorkerDied, EngineDeadError)  # the engine failed: a 503, or a stream's last event
router = APIRouter()


def build_app(client: EngineClient, model_name: str, engine_thread: bool = True) -> FastAPI:
    """The app; with engine_thread=False the caller must run app.state.engine_client.run_engine_loop()."""
    if engine_thread:
        client.start()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        client.shutdown()

    app = FastAPI(title=f"vllm-course {__package__}", lifespan=lifespan)
    app.state.engine_client = client
    app.state.serving = OpenAIServing(client.tokenizer, model_name, client.max_model_len)
    install_error_handlers(app)
    for error in ENGINE_ERRORS:
        app.add_exception_handler(error, _engine_failed)
    app.include_router(router)
    return app


async def _engine_failed(_: HTTPRequest, exc: Exception):
    return error_response(503, f"the engine has failed: {exc}", "server_error")


@router.get("/health")
async def health(raw: HTTPRequest):
    error = raw.app.state.engine_client.dead_error
    if error is not None:  # a worker process died, or every engine did
        return error_response(503, f"the engine has failed: {error}", "server_error")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(raw: HTTPRequest):
    return raw.app.state.serving.models()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: HTTPRequest):
    client, serving = raw.app.state.engine_client, raw.app.state.serving
    serving.check_model(req.model)
    params = req.to_sampling_params()
    requests = [client.process_inputs(p, params, cache_salt=req.cache_salt) for p in req.prompts()]
    if not req.stream:
        return serving.completion_response(req, await run_to_end(client, requests, raw))

    async def events() -> AsyncIterator[str]:
        rid = new_request_id("cmpl")
        whole = [None] * len(requests)
        try:
            async for i, delta, so_far in interleave(client, requests):  # each chunk names its choice
                whole[i] = so_far
                for chunk in serving.completion_chunks(req, rid, i, delta):
                    yield chunk.model_dump_json()
        except ENGINE_ERRORS as e:
            yield stream_error(e)
            return
        if req.include_usage:
            yield serving.usage_chunk(CompletionStreamResponse, rid, whole).model_dump_json()
        yield "[DONE]"

    return sse_response(events())


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, raw: HTTPRequest):
    client, serving = raw.app.state.engine_client, raw.app.state.serving
    serving.check_model(req.model)
    request = client.process_inputs(serving.chat_prompt(req), req.to_sampling_params(), cache_salt=req.cache_salt)
    if not req.stream:
        return serving.chat_response(req, (await run_to_end(client, [request], raw))[0])

    async def events() -> AsyncIterator[str]:
        rid, first, whole = new_request_id("chatcmpl"), True, None
        try:
            async for _, delta, whole in interleave(client, [request]):
                for chunk in serving.chat_chunks(req, rid, delta, first):
                    yield chunk.model_dump_json()
                first = False
        except ENGINE_ERRORS as e:
            yield stream_error(e)
            return
        if req.include_usage:
            yield serving.usage_chunk(ChatCompletionStreamResponse, rid, [whole]).model_dump_json()
        yield "[DONE]"

    return sse_response(events())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.replace("partNN_<name>", __package__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--headless", action="store_true", help="no API server: run this host's engine "
                   "cores (with --data-parallel-size > 1) or this node's tensor-parallel ranks")
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


def make_engine_client(config: EngineConfig) -> EngineClient:
    """The engine client the app runs on, chosen here at the entry point (engine_client.py is the
    interface alone): several engine cores behind a router, one in a process of its own, or the
    engine in this process (the fastest on a small CPU: no process hop). vLLM's API server builds
    its client the same way before the app (build_async_engine_client)."""
    if config.data_parallel_size > 1:
        return DPAsyncMPClient(config)
    if config.multiprocess_engine_core:
        return AsyncMPClient(config)
    return AsyncLLM(LLMEngine(config))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    if args.headless and config.data_parallel_size > 1:
        raise SystemExit(run_headless_engines(config))
    if args.headless:
        raise SystemExit(run_headless(config, ParallelConfig.resolve(
            config.tensor_parallel_size, config.nnodes, config.node_rank, config.master_addr, config.master_port)))
    client = make_engine_client(config)
    app = build_app(client, args.served_model_name or served_model_name(args.model), engine_thread=False)
    serve(app, args.host, args.port)


def serve(app: FastAPI, host: str, port: int) -> None:
    """The engine keeps the main thread (where the model was loaded: the fast place for PyTorch on
    CPU); the event loop, which only moves bytes, runs on a second thread."""
    client = app.state.engine_client
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    try:
        while not server.started and http.is_alive():
            time.sleep(0.05)
        if http.is_alive():
            client.run_engine_loop()  # until the app's shutdown stops it
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        client.shutdown()


if __name__ == "__main__":
    main()
