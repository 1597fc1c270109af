"""An OpenAI-compatible server that runs one request at a time.

The handlers are `async def` but call the engine directly, so generation runs *on the event
loop*: while one request generates, the server cannot even answer /health. That is the point of
this stage, and what part 02 fixes.

    python -m part01_simple_server.server [--model M] [--host 127.0.0.1] [--port 8000]
"""
from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI

from shared.errors import InvalidRequestError
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.serving import OpenAIServing, install_error_handlers
from shared.weights import served_model_name

from .config import EngineConfig
from .llm import LLM


def build_app(llm: LLM, model_name: str) -> FastAPI:
    engine = llm.engine
    serving = OpenAIServing(engine.tokenizer, model_name, engine.max_model_len)
    app = FastAPI(title="vllm-course part 01")
    app.state.llm = llm
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        serving.check_model(req.model)
        if req.stream:
            raise InvalidRequestError("streaming arrives in part 02", "stream")
        params = req.to_sampling_params()
        requests = [engine.make_request(p, params) for p in req.prompts()]
        outputs = [engine.generate(r) for r in requests]  # blocks the event loop, on purpose
        return serving.completion_response(req, outputs)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        serving.check_model(req.model)
        if req.stream:
            raise InvalidRequestError("streaming arrives in part 02", "stream")
        request = engine.make_request(serving.chat_prompt(req), req.to_sampling_params())
        return serving.chat_response(req, engine.generate(request))

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = LLM(**EngineConfig.from_cli_args(args).to_dict())
    app = build_app(llm, args.served_model_name or served_model_name(args.model))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
