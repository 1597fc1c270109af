"""An async OpenAI-compatible server with streaming (SSE).

Generation runs on the AsyncLLM's engine thread, so the event loop stays free: /health answers
during a long generation, tokens stream as they are made, and a client that disconnects stops
its generation. The prompts of one /v1/completions request are generated together, so
continuous batching runs them in the same steps.

    python -m partNN_<name>.server [--model M] [--host 127.0.0.1] [--port 8000]
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from shared.outputs import RequestOutput
from shared.protocol import (ChatCompletionRequest, ChatCompletionStreamResponse, CompletionRequest,
                             CompletionStreamResponse)
from shared.serving import OpenAIServing, install_error_handlers, new_request_id, sse_response
from shared.weights import served_model_name

from .async_llm import AsyncLLM
from .config import EngineConfig
from .llm import LLM
from .request import Request

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there


def build_app(llm: LLM, model_name: str, engine_thread: bool = True) -> FastAPI:
    """The app; with engine_thread=False the caller must run app.state.async_llm.run_engine_loop()."""
    engine = llm.engine
    async_llm = AsyncLLM(engine)
    if engine_thread:
        async_llm.start()
    serving = OpenAIServing(engine.tokenizer, model_name, engine.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        async_llm.shutdown()

    app = FastAPI(title=f"vllm-course {__package__}", lifespan=lifespan)
    app.state.llm, app.state.async_llm = llm, async_llm
    install_error_handlers(app)

    async def run_to_end(requests: list[Request], raw: HTTPRequest) -> list[RequestOutput]:
        """Generate all to the end together (they batch); if the client goes away meanwhile,
        abort them all (as a stream would)."""
        async def drain(request: Request) -> None:
            async for _ in async_llm.generate(request):
                pass

        tasks = [asyncio.ensure_future(drain(r)) for r in requests]
        everything = asyncio.gather(*tasks)
        try:
            while not (await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S))[0]:
                if await raw.is_disconnected():
                    everything.cancel()  # each generator's cleanup marks its request aborted
                    break
            try:
                await everything  # engine errors surface here
            except asyncio.CancelledError:
                pass  # we cancelled it: nobody is left to read the reply
        finally:
            for t in tasks:  # one failed, or this handler was cancelled: stop the rest too
                t.cancel()
        return [r.output() for r in requests]

    async def interleave(requests: list[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(request index, delta) of all the requests, in the order the engine makes them.
        Cancelling the consumer (client disconnect) aborts every request."""
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request: Request) -> None:
            try:
                async for delta in async_llm.generate(request):
                    arrived.put_nowait((i, delta))
                arrived.put_nowait((i, None))
            except Exception as e:  # engine error: re-raised to the consumer
                arrived.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        left = len(requests)
        try:
            while left:
                i, item = await arrived.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    left -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: HTTPRequest):
        serving.check_model(req.model)
        params = req.to_sampling_params()
        requests = [engine.make_request(p, params) for p in req.prompts()]
        if not req.stream:
            return serving.completion_response(req, await run_to_end(requests, raw))

        async def events() -> AsyncIterator[str]:
            rid = new_request_id("cmpl")
            async for i, delta in interleave(requests):  # each chunk names its choice index
                for chunk in serving.completion_chunks(req, rid, i, delta):
                    yield chunk.model_dump_json()
            if req.include_usage:
                yield serving.usage_chunk(CompletionStreamResponse, rid,
                                          [r.output() for r in requests]).model_dump_json()
            yield "[DONE]"

        return sse_response(events())

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: HTTPRequest):
        serving.check_model(req.model)
        request = engine.make_request(serving.chat_prompt(req), req.to_sampling_params())
        if not req.stream:
            return serving.chat_response(req, (await run_to_end([request], raw))[0])

        async def events() -> AsyncIterator[str]:
            rid, first = new_request_id("chatcmpl"), True
            async for delta in async_llm.generate(request):
                for chunk in serving.chat_chunks(req, rid, delta, first):
                    yield chunk.model_dump_json()
                first = False
            if req.include_usage:
                yield serving.usage_chunk(ChatCompletionStreamResponse, rid, [request.output()]).model_dump_json()
            yield "[DONE]"

        return sse_response(events())

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.replace("partNN_<name>", __package__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = LLM(**EngineConfig.from_cli_args(args).to_dict())
    app = build_app(llm, args.served_model_name or served_model_name(args.model), engine_thread=False)
    # The engine keeps the main thread (where the model was loaded: the fast place for PyTorch on
    # CPU); the event loop, which only moves bytes, runs on a second thread.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    try:
        while not server.started and http.is_alive():
            time.sleep(0.05)
        if http.is_alive():
            app.state.async_llm.run_engine_loop()  # until the app's shutdown stops it
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)



if __name__ == "__main__":
    main()
