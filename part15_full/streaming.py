"""The server's two ways of consuming engine outputs, over any engine client whose `generate(request)`
yields RequestOutput deltas:

* `run_to_end`: generate several requests together (they batch) and return their whole outputs;
  if the HTTP client goes away meanwhile, abort them all (as a stream would).
* `interleave`: one stream of (request index, delta, whole output so far) over several requests,
  in the order the engine makes them; cancelling the consumer (a disconnect) aborts every request.

Whole outputs are folded from the deltas (RequestOutput.add), so the same code serves an engine in
this process or one in another process that only sends deltas."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request as HTTPRequest

from .outputs import RequestOutput  # with prompt logprobs (part 15)
from shared.protocol import ErrorInfo, ErrorResponse

from .kv_connector import KVLoadFailed

DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there


def _empty(request) -> RequestOutput:
    """The whole output of a request before its first delta."""
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids)


async def run_to_end(client, requests: list, raw: HTTPRequest) -> list[RequestOutput]:
    whole = [_empty(r) for r in requests]

    async def drain(i: int, request) -> None:
        async for delta in client.generate(request):
            whole[i].add(delta)
            _check(delta)

    tasks = [asyncio.ensure_future(drain(i, r)) for i, r in enumerate(requests)]
    everything = asyncio.gather(*tasks)
    try:
        while not (await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S))[0]:
            if await raw.is_disconnected():
                everything.cancel()  # each generator's cleanup aborts its request
                break
        try:
            await everything  # engine errors surface here
        except asyncio.CancelledError:
            pass  # we cancelled it: nobody is left to read the reply
    finally:
        for t in tasks:  # one failed, or this handler was cancelled: stop the rest too
            t.cancel()
    return whole


async def interleave(client, requests: list) -> AsyncIterator[tuple[int, RequestOutput, RequestOutput]]:
    arrived: asyncio.Queue = asyncio.Queue()
    whole = [_empty(r) for r in requests]

    async def pump(i: int, request) -> None:
        try:
            async for delta in client.generate(request):
                arrived.put_nowait((i, delta))
            arrived.put_nowait((i, None))
        except Exception as e:  # an engine error: re-raised to the consumer
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
                whole[i].add(item)
                _check(item)
                yield i, item, whole[i]
    finally:
        for t in tasks:
            t.cancel()


def _check(delta: RequestOutput) -> None:
    """A completion the engine ended with "error" (part 13: its KV could not be loaded)."""
    if any(c.finish_reason == "error" for c in delta.outputs):
        raise KVLoadFailed(f"request {delta.request_id}: its KV cache could not be loaded from the prefill "
                           f"engine (kv_load_failure_policy is fail)")


def stream_error(exc: Exception) -> str:
    """An engine failure after a stream has begun (its 200 is sent): OpenAI's error object as the
    last event, so the client raises instead of waiting or taking a cut stream for a whole one."""
    info = ErrorInfo(message=f"the engine serving this request has failed: {exc}", type="server_error", code=503)
    return ErrorResponse(error=info).model_dump_json()
