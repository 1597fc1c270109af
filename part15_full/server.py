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
a process of its own, or several behind a router; `make_engine_client` picks which.

A production server around them (part 15): /tokenize, /detokenize (serving_tokenization.py) and
/version; API keys, CORS and X-Request-Id (middleware.py, flags in cli_args.py); a graceful
shutdown on SIGTERM (graceful_shutdown.py); the configuration validated before anything starts
and its effective values printed once the model is loaded (config.py), with every switch in
effect (envs.py). Deployments: deploy/.

In vLLM: vllm/entrypoints/openai/api_server.py (build_app, init_app_state, run_server) and
vllm/entrypoints/launchers/launcher.py (serve_http)."""
from __future__ import annotations

import argparse
import importlib.metadata
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest

from shared.protocol import ChatCompletionStreamResponse, CompletionStreamResponse
from shared.errors import InvalidRequestError
from shared.outputs import RequestOutput
from shared.serving import error_response, install_error_handlers, sse_response
from shared.weights import served_model_name

from . import envs
from .chat_template import load_chat_template
from .cli_args import FrontendArgs
from .async_llm import AsyncLLM
from .config import EngineConfig
from .core_client import AsyncMPClient, DPAsyncMPClient
from .engine import LLMEngine
from .engine_client import EngineClient, EngineDeadError
from .generation_config import default_sampling_params
from .graceful_shutdown import AbortableClient, GracefulShutdown
from .kv_connector import KVLoadFailed
from .metrics import attach_stat_logger, mount_metrics
from .middleware import base_request_id, engine_request_id, install_middleware
from .headless import run_headless
from .process_utils import WorkerDied
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving_chat import OpenAIServingChat
from .serving_completion import CompletionStream, clamp, completion_response
from .serving_tokenization import router as tokenization_router
from .streaming import interleave, run_to_end, stream_error

ENGINE_ERRORS = (WorkerDied, EngineDeadError, KVLoadFailed)  # a 503, or a stream's last event
router = APIRouter()


def build_app(client: EngineClient, model_name: str, engine_thread: bool = True,
              frontend: FrontendArgs | None = None) -> FastAPI:
    """The app; with engine_thread=False the caller must run app.state.engine_client.run_engine_loop().
    `frontend`: API keys, CORS, request-id headers, shutdown timeout (default: vLLM's defaults)."""
    stat_logger = attach_stat_logger(client, model_name)  # before the engine runs: every step counts
    if engine_thread:
        client.start()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        client.shutdown()

    app = FastAPI(title=f"vllm-course {__package__}", lifespan=lifespan)
    app.state.engine_client = client
    frontend = frontend or FrontendArgs()
    config = getattr(client, "config", None)
    app.state.serving = OpenAIServingChat(  # the chat endpoint's tool calls and reasoning (serving_chat.py)
        client.tokenizer, model_name, client.max_model_len, enable_auto_tools=frontend.enable_auto_tool_choice,
        tool_parser=frontend.tool_call_parser, reasoning_parser=config.reasoning_parser if config else None)
    # --chat-template and --generation-config (request_fields.py): read once, used by every request
    app.state.chat_template = load_chat_template(config.chat_template) if config and config.chat_template else None
    app.state.default_sampling_params = default_sampling_params(config.generation_config, client.tokenizer.path) \
        if config is not None else {}
    frontend = frontend or FrontendArgs()
    app.state.shutdown = GracefulShutdown(frontend.shutdown_timeout)
    app.state.generator = AbortableClient(client, app.state.shutdown)  # what the handlers generate with
    install_middleware(app, frontend, app.state.shutdown)
    install_error_handlers(app)
    for error in ENGINE_ERRORS:
        app.add_exception_handler(error, _engine_failed)
    app.include_router(router)
    app.include_router(tokenization_router)  # /tokenize, /detokenize
    mount_metrics(app, stat_logger)  # /metrics: vLLM's Prometheus metrics of all the engines
    return app


async def _engine_failed(_: HTTPRequest, exc: Exception):
    return error_response(503, f"the engine has failed: {exc}", "server_error")


@router.get("/health")
async def health(raw: HTTPRequest):
    error = raw.app.state.engine_client.dead_error
    if error is not None:  # a worker process died, or every engine did
        return error_response(503, f"the engine has failed: {error}", "server_error")
    return {"status": "ok"}


@router.get("/version")
async def version():
    return {"version": package_version()}


def package_version() -> str:
    """The installed package's version; in a source tree that is not installed, pyproject's."""
    try:
        return importlib.metadata.version("vllm-course")
    except importlib.metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.exists() else "unknown"


@router.get("/v1/models")
async def models(raw: HTTPRequest):
    return raw.app.state.serving.models()


def with_kv_transfer_params(response, outputs: list[RequestOutput]) -> dict:
    """The response, with the connector's kv_transfer_params (vLLM returns them beside the choices)."""
    return {**response.model_dump(), "kv_transfer_params": outputs[0].kv_transfer_params if outputs else None}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: HTTPRequest):
    client, serving = raw.app.state.generator, raw.app.state.serving
    rid = f"cmpl-{base_request_id(raw.headers)}"
    serving.check_model(req.model)
    params = req.to_sampling_params(raw.app.state.default_sampling_params)
    if req.kv_transfer_params is not None and len(req.prompts()) > 1:
        raise InvalidRequestError("kv_transfer_params names one request's KV: send one prompt", "kv_transfer_params")
    requests = [client.process_inputs(p, params, engine_request_id(rid, i), cache_salt=req.cache_salt,
                                      kv_transfer_params=req.kv_transfer_params, priority=req.priority)
                for i, p in enumerate(req.prompts())]
    if not req.stream:
        outputs = await run_to_end(client, requests, raw)
        response = completion_response(serving, req, outputs).model_copy(update={"id": rid})  # echo too
        return with_kv_transfer_params(response, outputs)

    async def events() -> AsyncIterator[str]:
        whole, stream = [None] * len(requests), CompletionStream(serving, req, rid)
        try:
            async for i, delta, so_far in interleave(client, requests):  # each chunk names its choice
                whole[i] = so_far
                for chunk in stream.chunks(i, delta, so_far):
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
    client, serving = raw.app.state.generator, raw.app.state.serving
    rid = f"chatcmpl-{base_request_id(raw.headers)}"
    serving.check_model(req.model)
    prompt = serving.chat_prompt(req, raw.app.state.chat_template)  # tool checks, then chat_template.py
    request = client.process_inputs(prompt, req.to_sampling_params(raw.app.state.default_sampling_params),
                                    engine_request_id(rid, 0), cache_salt=req.cache_salt,
                                    kv_transfer_params=req.kv_transfer_params, priority=req.priority)
    if not req.stream:
        outputs = await run_to_end(client, [request], raw)
        response = serving.chat_response(req, outputs[0]).model_copy(update={"id": rid})
        return {**with_kv_transfer_params(response, outputs), "prompt_logprobs": clamp(outputs[0].prompt_logprobs)}

    async def events() -> AsyncIterator[str]:
        first, whole, stream = True, None, serving.chat_stream(req, rid)  # the choices' parsers
        try:
            async for _, delta, whole in interleave(client, [request]):
                for chunk in stream.chunks(delta, first):
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
    FrontendArgs.add_cli_args(p)
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    FrontendArgs.check_cli_args(p, args)
    return args


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
    try:  # every invalid flag and combination at once, before any process starts or weight loads
        config.validate(headless=args.headless)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.headless:  # another node's engines (data parallelism) or ranks (tensor/pipeline parallelism)
        raise SystemExit(run_headless(config))
    client = make_engine_client(config)
    print(config.summary(client.max_model_len, client.processor.num_blocks), flush=True)
    print(envs.summary(), flush=True)  # every VLLM_COURSE_* switch in effect (envs.py)
    app = build_app(client, args.served_model_name or served_model_name(args.model), engine_thread=False,
                    frontend=FrontendArgs.from_cli_args(args))
    serve(app, args.host, args.port)


def serve(app: FastAPI, host: str, port: int) -> None:
    """The engine keeps the main thread (where the model was loaded: the fast place for PyTorch on
    CPU); the event loop, which only moves bytes, runs on a second thread. SIGTERM and Ctrl-C start
    a graceful shutdown (graceful_shutdown.py): once drained, the HTTP server stops, its lifespan
    shuts the engine client down, and run_engine_loop returns here."""
    client = app.state.engine_client
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    http = threading.Thread(target=server.run, name="http", daemon=True)

    def on_signal(signum: int, _frame) -> None:
        app.state.shutdown.begin(on_drained=lambda: setattr(server, "should_exit", True))

    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn installs none off the main thread
        signal.signal(sig, on_signal)
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
