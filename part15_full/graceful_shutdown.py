"""Graceful shutdown: on SIGTERM (or Ctrl-C) the server drains instead of dropping its requests.

    SIGTERM ─▶ draining: new requests get 503 (a load balancer retries them elsewhere; /health is 503
               too, so it stops sending), requests in flight go on
            ─▶ all done, or --shutdown-timeout seconds passed: what is left is aborted; each of its
               completions ends with finish_reason "abort" (a stream sends that chunk and [DONE]), the
               engine frees its KV blocks
            ─▶ the HTTP server stops, the engine client shuts down its threads and processes
               (tensor-parallel workers, data-parallel engines), the process exits 0

A second signal skips the wait. Kubernetes sends SIGTERM and kills terminationGracePeriodSeconds
later, so that grace period must exceed --shutdown-timeout.

Three pieces: `DrainMiddleware` counts the requests in flight and refuses new ones while draining;
`AbortableClient` is the engine client as the route handlers see it, whose `generate` a shutdown
can end early (the handlers then finish their responses as usual); `GracefulShutdown.begin` runs
the drain on a thread of its own (a signal handler must return at once).

In vLLM: vllm/entrypoints/launchers/launcher.py (serve_http: the SIGTERM handler), the shutdown_timeout of
vllm/engine/arg_utils.py, and vllm/entrypoints/serve/elastic_ep/middleware.py
(ServiceUnavailableMiddleware: 503 while draining, /metrics exempt)."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from shared.outputs import CompletionOutput, RequestOutput
from shared.serving import error_response

log = logging.getLogger("vllm_course.shutdown")
EXEMPT_PATHS = ("/metrics",)  # scraping goes on while draining (vLLM's exemption)
ABORT_GRACE_S = 10.0  # after the abort: time for handlers to write their last bytes


class GracefulShutdown:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.draining = False  # set once; new requests are refused from then on
        self.aborting = False  # the timeout passed: generations in flight are ended
        self.in_flight = 0  # HTTP requests admitted and not yet answered (streams: until their end)
        self.num_aborted = 0  # generations ended by the shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._skip_wait = threading.Event()

    def begin(self, on_drained: Callable[[], None]) -> None:
        """Start draining (a signal handler calls this; it returns at once). A second call stops
        waiting for the requests in flight."""
        if self._thread is not None:
            log.warning("second shutdown request: aborting the requests in flight now")
            self._skip_wait.set()
            return
        self.draining = True
        self._thread = threading.Thread(target=self._drain, args=(on_drained,), name="drain", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _drain(self, on_drained: Callable[[], None]) -> None:
        log.warning("shutting down: refusing new requests, %d in flight (waiting up to %g s)",
                 self.in_flight, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while self.in_flight and time.monotonic() < deadline and not self._skip_wait.wait(0.05):
            pass
        if self.in_flight:
            log.warning("shutdown timeout: aborting %d request(s) in flight", self.in_flight)
            self.abort_all()
            deadline = time.monotonic() + ABORT_GRACE_S
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
        on_drained()

    def abort_all(self) -> None:
        """End every generation in flight, and any that starts from now on (thread-safe)."""
        self.aborting = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort.set)

    def _abort_event(self) -> asyncio.Event:
        """The event generations wait on, made in (and bound to) the server's event loop."""
        if self._abort is None:
            self._loop, self._abort = asyncio.get_running_loop(), asyncio.Event()
            if self.aborting:  # abort_all ran before any generation: nothing was waiting then
                self._abort.set()
        return self._abort


class DrainMiddleware:
    """Counts the HTTP requests in flight (a streamed response counts until its last byte) and
    answers 503 to new ones once the server is draining."""

    def __init__(self, app: ASGIApp, shutdown: GracefulShutdown):
        self.app, self.shutdown = app, shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PATHS):
            return await self.app(scope, receive, send)
        if self.shutdown.draining:
            response = error_response(503, "the server is shutting down", "server_error", code=503)
            return await response(scope, receive, send)
        self.shutdown.in_flight += 1  # only the event loop's thread changes it
        try:
            await self.app(scope, receive, send)
        finally:
            self.shutdown.in_flight -= 1


class AbortableClient:
    """The engine client for the route handlers: everything passes through, but `generate` ends
    early, with a last delta whose unfinished completions say finish_reason "abort", when the
    shutdown aborts. Closing the inner generator aborts the request in its engine, as a client
    disconnect does, so its KV blocks are freed."""

    def __init__(self, client, shutdown: GracefulShutdown):
        self._client, self._shutdown = client, shutdown

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def generate(self, request) -> AsyncIterator[RequestOutput]:
        unfinished = set(range(request.sampling_params.n))
        inner = self._client.generate(request)
        aborted = asyncio.ensure_future(self._shutdown._abort_event().wait())
        step = None
        try:
            while True:
                # Each next delta races the abort (a task per delta: microseconds, against a step's milliseconds).
                step = asyncio.ensure_future(inner.__anext__())
                await asyncio.wait({step, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the shutdown came first: abort in the engine, then say so
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    break
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                unfinished -= {c.index for c in delta.outputs if c.finish_reason is not None}
                yield delta
                if delta.finished:
                    return
            self._shutdown.num_aborted += 1
            yield RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                [CompletionOutput(i, "", [], finish_reason="abort") for i in sorted(unfinished)],
                                finished=True)
        finally:
            aborted.cancel()
            if step is not None and not step.done():  # cut short (shutdown, or our consumer left):
                step.cancel()  # the inner generator's cleanup aborts the request in its engine
                await asyncio.gather(step, return_exceptions=True)
            await inner.aclose()
