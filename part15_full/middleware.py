"""The HTTP layers every request passes before (and after) its route handler, outermost first:

    CORS ─▶ X-Request-Id ─▶ drain (graceful_shutdown.py) ─▶ API key ─▶ the routes

* CORS (Starlette's CORSMiddleware): a browser page on another origin may call the API only if
  the server says so, in its answer to the browser's preflight OPTIONS request. Outermost, so that
  even a 401 or a 503 carries the CORS headers and the page can read why it was refused.
* X-Request-Id (`--enable-request-id-headers`): every response names its request. A request
  without the header gets a fresh id written into its headers before the handlers see it, so the
  id in the response header is the one the handlers used (`cmpl-<id>` in the body). The handlers
  take a client's X-Request-Id as the request's id whether or not the flag is set, as vLLM does.
* API key (`--api-key`, $VLLM_API_KEY): every path under /v1 needs `Authorization: Bearer <key>`;
  /health, /version, /metrics, /tokenize and /detokenize stay open (vLLM guards by the /v1 prefix,
  not route by route). Keys are compared as SHA-256 digests in constant time, so the time a wrong
  key takes tells nothing about the right one. vLLM answers `{"error": "Unauthorized"}`; we answer
  OpenAI's error object (code invalid_api_key), which OpenAI's clients parse.

In vLLM: vllm/entrypoints/serve/middleware/ (authenticate.py: AuthenticationMiddleware,
x_request_id.py: XRequestIdMiddleware, register.py: the order they are added in)."""
from __future__ import annotations

import hashlib
import secrets
import uuid

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.serving import error_response

from .cli_args import FrontendArgs
from .graceful_shutdown import DrainMiddleware, GracefulShutdown

GUARDED_PREFIX = "/v1"
REQUEST_ID_HEADER = "x-request-id"


class AuthenticationMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for key in self.digests:  # every key compared: no early exit to time
            ok |= secrets.compare_digest(digest, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A CORS preflight carries no credentials by design (the browser asks before sending them).
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS" and \
            scope["path"].removeprefix(scope.get("root_path", "")).startswith(GUARDED_PREFIX)
        if guarded and not self.authorized(Headers(scope=scope)):
            response = error_response(401, "Incorrect API key provided: send `Authorization: Bearer <key>`",
                                      code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class XRequestIdMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get(REQUEST_ID_HEADER)
        if request_id is None:  # name it here, so that the handlers use the id the client is told
            request_id = uuid.uuid4().hex
            scope = {**scope, "headers": [*scope["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_middleware(app: FastAPI, args: FrontendArgs, shutdown: GracefulShutdown) -> None:
    """Starlette runs the middleware added last first: add them innermost first."""
    if args.api_keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=args.api_keys)
    app.add_middleware(DrainMiddleware, shutdown=shutdown)
    if args.enable_request_id_headers:
        app.add_middleware(XRequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                       allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


def base_request_id(headers: Headers) -> str:
    """A request's id: the client's X-Request-Id (with or without --enable-request-id-headers, as in
    vLLM), else a new one. Responses show it as `cmpl-<id>` / `chatcmpl-<id>`."""
    return headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def engine_request_id(response_id: str, index: int) -> str:
    """The id of a response's index-th prompt in its engine. Clients may send the same X-Request-Id
    twice, so a random suffix keeps engine ids unique (vLLM: InputProcessor.assign_request_id)."""
    return f"{response_id}-{index}-{secrets.token_hex(4)}"
