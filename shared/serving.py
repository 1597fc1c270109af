"""The HTTP side every server shares: OpenAI error bodies, prompt preparation, building responses
and stream chunks from RequestOutputs, and the stream's framing on the wire. Each part's server.py
only decides *how* it runs the engine (blocking, streaming, batched)."""
from __future__ import annotations

import logging
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import InvalidRequestError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamResponse, ChatLogprob, ChatLogprobs, ChatResponseMessage,
                       ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionRequest,
                       CompletionResponse, CompletionStreamResponse, DeltaMessage, ErrorInfo,
                       ErrorResponse, ModelCard, ModelList, TopLogprob, UsageInfo)
from .tokenizer import Tokenizer

log = logging.getLogger("vllm_course.server")


class ModelNotFoundError(InvalidRequestError):
    pass


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "We could not parse the JSON body of your request.")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, param=loc[0] if loc else None)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError):
        if isinstance(exc, ModelNotFoundError):
            return error_response(404, str(exc), param="model", code="model_not_found")
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


# sse-starlette sends a keep-alive comment every 15 s unless told otherwise; vLLM's server sends
# none. Its `ping=0` turns them off only in recent releases (older ones loop on it without pause), so
# the interval is set longer than any stream instead.
NO_KEEPALIVE_S = 7 * 24 * 3600


def sse_response(events: AsyncIterator[str]) -> EventSourceResponse:
    """A stream as vLLM's server and OpenAI's API send it: every event is `data: <payload>` and a
    blank line, `\n\n`, nothing else between events, and `data: [DONE]` last. sse-starlette
    ends lines with `\r\n` by default. That is valid SSE, but a client that splits events on
    `\n\n` (vLLM's `bench serve`, many hand-written ones) finds no boundary in it: when two events
    arrive in one network read (the usage chunk with `[DONE]`), it cannot parse them and drops both.

    In vLLM: vllm/entrypoints/openai/completion/serving.py and chat_completion/serving.py (the
    `data: ...\n\n` lines of their stream generators)."""
    return EventSourceResponse(events, sep="\n", ping=NO_KEEPALIVE_S)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist.", "model")

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template([m.model_dump() for m in req.messages])
        except InvalidRequestError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequestError(f"could not apply the chat template: {e}", "messages") from e

    # ---- whole responses -------------------------------------------------------------
    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def completion_response(self, req: CompletionRequest, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = [self._completion_choice(i * req.n + c.index, c, req.logprobs or 0)
                   for i, o in enumerate(outputs) for c in o.outputs]
        return CompletionResponse(model=self.model_name, choices=choices, usage=self.usage(outputs))

    def chat_response(self, req: ChatCompletionRequest, output: RequestOutput) -> ChatCompletionResponse:
        top_n = req.top_logprobs or 0
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._chat_logprobs(c, top_n), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason) for c in output.outputs]
        return ChatCompletionResponse(model=self.model_name, choices=choices, usage=self.usage([output]))

    # ---- stream chunks -----------------------------------------------------------------
    def completion_chunks(self, req: CompletionRequest, request_id: str, prompt_index: int,
                          delta: RequestOutput) -> list[CompletionStreamResponse]:
        return [CompletionStreamResponse(id=request_id, model=self.model_name, choices=[
            self._completion_choice(prompt_index * req.n + c.index, c, req.logprobs or 0)])
            for c in delta.outputs if c.text or c.token_ids or c.finish_reason]

    def chat_chunks(self, req: ChatCompletionRequest, request_id: str, delta: RequestOutput,
                    first: bool) -> list[ChatCompletionStreamResponse]:
        chunks = []
        if first:  # OpenAI opens every choice with the assistant role
            chunks += [ChatCompletionStreamResponse(
                id=request_id, model=self.model_name,
                choices=[ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                for c in delta.outputs]
        for c in delta.outputs:
            if c.text or c.token_ids or c.finish_reason:
                chunks.append(ChatCompletionStreamResponse(id=request_id, model=self.model_name, choices=[
                    ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                     logprobs=self._chat_logprobs(c, req.top_logprobs or 0),
                                     finish_reason=c.finish_reason, stop_reason=c.stop_reason)]))
        return chunks

    def usage_chunk(self, cls, request_id: str, outputs: list[RequestOutput]):
        return cls(id=request_id, model=self.model_name, choices=[], usage=self.usage(outputs))

    # ---- logprobs in OpenAI's two formats ---------------------------------------------
    @staticmethod
    def _top(entry: dict[int, Logprob], top_n: int) -> list[Logprob]:
        return sorted((e for e in entry.values() if e.rank <= top_n), key=lambda e: e.rank)

    def _completion_choice(self, index: int, c: CompletionOutput, top_n: int) -> CompletionChoice:
        lp = None
        if c.logprobs is not None:
            lp, offset = CompletionLogprobs(), 0
            for tid, entry in zip(c.token_ids, c.logprobs):
                tok = entry[tid].decoded_token
                lp.tokens.append(tok)
                lp.token_logprobs.append(entry[tid].logprob)
                lp.top_logprobs.append({e.decoded_token: e.logprob for e in self._top(entry, top_n)})
                lp.text_offset.append(offset)
                offset += len(tok)
        return CompletionChoice(index=index, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    def _chat_logprobs(self, c: CompletionOutput, top_n: int) -> ChatLogprobs | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs):
            chosen = entry[tid]
            content.append(ChatLogprob(
                token=chosen.decoded_token, logprob=chosen.logprob, bytes=list(chosen.decoded_token.encode()),
                top_logprobs=[TopLogprob(token=e.decoded_token, logprob=e.logprob,
                                         bytes=list(e.decoded_token.encode())) for e in self._top(entry, top_n)]))
        return ChatLogprobs(content=content)
