"""The disaggregation proxy: one OpenAI endpoint in front of prefill servers and decode servers.

Every request runs twice. A prefill server (P) computes the prompt's KV cache and keeps its blocks;
a decode server (D) fetches those blocks through its KV connector and generates the answer:

    client ──POST /v1/completions──▶ proxy
                                       │ 1. copy: max_tokens=1, stream=false, kv_transfer_params=
                                       │    {do_remote_decode: true, ...}      (X-Request-Id: id)
                                       ├──────────────────────▶ P  prefill; blocks held for D
                                       │◀── kv_transfer_params ─┘  (engine id, block ids, host, port)
                                       │ 2. the original body + P's kv_transfer_params
                                       ├──────────────────────▶ D  pulls the KV, decodes
    client ◀── D's answer, as it comes ┘◀── JSON or SSE ────────┘

Why max_tokens=1 at P: an OpenAI request must make at least one token, and one is all it takes to
run the prompt through the model. P finishes right after its prefill step, so it never spends a
decode step, and its connector's request_finished hands back where the blocks are. P's token is
thrown away: D samples the first token itself, from the prompt's last position.

    python -m part13_disagg.proxy --port 8000 --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 http://127.0.0.1:8201

In vLLM: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (v0.33.0: this flow, one
round-robin cycle per role); examples/online_serving/disaggregated_serving/disagg_proxy_demo.py
(XpYd, with instances added at run time through an admin route). Production routers:
  NVIDIA Dynamo: a Rust router that picks workers by KV-cache overlap, and prefills only when worth it.
  llm-d: the Gateway API inference extension's endpoint picker chooses P and D; a sidecar runs P first.
  Mooncake (Kimi): a global scheduler (Conductor) pairs P and D by cache hits and load; Transfer Engine."""
from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from shared.serving import error_response

# What P is told: "decode happens elsewhere; keep the blocks and say where they are".
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                              "remote_block_ids": None, "remote_host": None, "remote_port": None}
HEALTH_TIMEOUT_S = 5.0  # a hung server must not hang /health for the full request timeout


class UpstreamError(Exception):
    """A server could not be reached, timed out, or gave an answer the proxy cannot use."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prefill_request(body: dict) -> dict:
    """The copy of the client's body that P gets: fill the KV cache and stop."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    req["stream"] = False  # P's one token is thrown away; the proxy only needs its final JSON
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:  # chat's newer name; it would override max_tokens
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)  # only valid with stream=true
    req.pop("min_tokens", None)  # a minimum above 1 would contradict max_tokens=1
    req.pop("min_completion_tokens", None)
    # n choices share one prompt, so one prefill serves them all: D samples the n choices from
    # the same KV. n > 1 at P would only leave n-1 more block sets waiting for a pull never made.
    req["n"] = 1
    return req


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0) -> FastAPI:
    """The proxy app. `timeout_s` bounds connecting to a server and each wait for its bytes (for a
    stream: the gap between two chunks, not the whole generation)."""
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill URL and one decode URL")
    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    next_prefill, next_decode = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # One client, one connection pool for all requests. No pool limit: the servers queue
        # requests themselves. trust_env=False: HTTP_PROXY must not reroute calls to our servers.
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False,
                                             limits=httpx.Limits(max_connections=None))
        try:
            yield
        finally:
            await app.state.client.aclose()

    app = FastAPI(title="vllm-course part 13 proxy", lifespan=lifespan)

    @app.exception_handler(UpstreamError)
    async def _upstream(raw: Request, exc: UpstreamError):
        resp = error_response(exc.status, str(exc), "server_error", code=exc.status)
        if rid := getattr(raw.state, "request_id", None):
            resp.headers["X-Request-Id"] = rid
        return resp

    async def send(request: httpx.Request, stream: bool = False) -> httpx.Response:
        try:
            return await app.state.client.send(request, stream=stream)
        except httpx.TimeoutException as e:
            raise UpstreamError(503, f"{request.url} did not answer within {timeout_s} s ({type(e).__name__})")
        except httpx.TransportError as e:  # refused, reset, DNS...: the server is down
            raise UpstreamError(503, f"{request.url} is unreachable: {type(e).__name__}: {e}")

    def as_is(resp: httpx.Response, rid: str | None = None) -> Response:
        return Response(resp.content, resp.status_code, headers={"X-Request-Id": rid} if rid else None,
                        media_type=resp.headers.get("content-type"))

    async def disaggregated(raw: Request, path: str) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "We could not parse the JSON body of your request.")
        # One id for both halves: servers that honour X-Request-Id name the request the same on P
        # and D, which makes the two ends of one KV transfer findable in both logs.
        rid = raw.state.request_id = raw.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        client: httpx.AsyncClient = app.state.client

        p_url = next(next_prefill)
        p = await send(client.build_request("POST", p_url + path, json=prefill_request(body), headers=headers))
        if p.status_code != 200:  # P's verdict on the request (a 400 for bad input) is the answer
            return as_is(p, rid)
        try:
            kv_transfer_params = p.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            kv_transfer_params = None
        if not kv_transfer_params:  # no connector at P: D would silently redo the prefill itself
            raise UpstreamError(502, f"{p_url} answered without kv_transfer_params "
                                     "(is it running with --kv-transfer-config?)")
        body["kv_transfer_params"] = kv_transfer_params

        d_url = next(next_decode)
        # If D fails from here on, P's blocks wait for a pull that never comes, until P frees them
        # (NIXL: kv_lease_duration). A production router would retry on another D.
        d = await send(client.build_request("POST", d_url + path, json=body, headers=headers),
                       stream=bool(body.get("stream")))
        if not body.get("stream") or d.status_code != 200:
            await d.aread()
            await d.aclose()
            return as_is(d, rid)

        async def passthrough() -> AsyncIterator[bytes]:
            try:
                async for chunk in d.aiter_raw():  # D's SSE bytes, unparsed and unbuffered
                    yield chunk
            except httpx.TransportError as e:  # the 200 is sent: end with an error event
                info = {"message": f"{d_url} failed mid-stream: {type(e).__name__}", "type": "server_error",
                        "param": None, "code": 502}
                yield f"data: {json.dumps({'error': info})}\n\n".encode()
            finally:  # also on client disconnect: closing the upstream stream makes D abort
                await d.aclose()

        return StreamingResponse(passthrough(), headers=headers, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await disaggregated(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await disaggregated(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        d = await send(app.state.client.build_request("GET", decode_urls[0] + "/v1/models"))
        return as_is(d)

    async def healthy(url: str) -> bool:
        try:
            return (await app.state.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.TransportError:
            return False

    @app.get("/health")
    @app.get("/healthcheck")  # the name vLLM's toy proxy uses
    async def health():
        servers = list(dict.fromkeys(prefill_urls + decode_urls))
        down = [u for u, ok in zip(servers, await asyncio.gather(*map(healthy, servers))) if not ok]
        if down:
            return error_response(503, f"not healthy: {', '.join(down)}", "server_error", code=503)
        return {"status": "ok", "prefill": prefill_urls, "decode": decode_urls}

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (round-robin)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (round-robin)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="connect / per-read timeout to a server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
