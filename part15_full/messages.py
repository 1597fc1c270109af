"""The typed messages between the API server and its engine-core processes, and their wire format.

    API server ──EngineCoreRequest, aborts──▶ engine core
    API server ◀──EngineCoreOutputs (per-request deltas + the engine's stats)── engine core

Only plain data crosses: token ids, sampling parameters, text deltas, logprobs, reasons, counters.
Stats come in two parts: the coordinator's view of the engine's load (EngineStats, for routing) and
the scheduler's state for /metrics (SchedulerStats, stats.py), plus the engine-clock times the API
process needs to time each request (when a completion was first scheduled, when this was sent).
The engine core builds its own Request (detokenizer state, seeded generators) from an
EngineCoreRequest; the API server rebuilds whole outputs from the deltas. Messages are msgpack,
encoded and decoded by msgspec against these declarations: a malformed or unexpected message fails
to decode (an error the client turns into a dead engine), never executes code the way unpickling
would, and costs a few microseconds.

Frames: [kind, payload]; kind is one byte (EngineCoreRequestType / EngineCoreEventType).

In vLLM: vllm/v1/engine/__init__.py (EngineCoreRequest, EngineCoreOutput(s), EngineCoreRequestType)
and vllm/v1/serial_utils.py (MsgpackEncoder / MsgpackDecoder)."""
from __future__ import annotations

import enum
from typing import Any

import msgspec

from shared.config import ModelConfig

from .coordinator import EngineStats
from .stats import SchedulerStats
from .sampling_params import SamplingParams  # with structured_outputs (part 15)


class EngineCoreRequestType(bytes, enum.Enum):
    """What the API server sends an engine core."""
    ADD = b"\x00"
    ABORT = b"\x01"
    SHUTDOWN = b"\x02"
    HANDSHAKE = b"\x03"  # the answer to an engine's hello: settings every engine must share


class EngineCoreEventType(bytes, enum.Enum):
    """What an engine core sends the API server."""
    HELLO = b"\x10"  # on the DEALER: it makes the engine's identity known to the ROUTER
    READY = b"\x11"
    OUTPUTS = b"\x12"
    ALIVE = b"\x13"
    DEAD = b"\x14"  # a fatal error, with its traceback
    REJECTED = b"\x15"  # one request the engine refused (a backstop: the server validates first)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None  # the text, when the prompt was one (outputs echo it)
    cache_salt: str | None = None
    # A KV connector's parameters for this request (part 13: where to fetch a prefilled KV cache).
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0  # lower first, with --scheduling-policy priority (scheduler.py)


class LogprobEntry(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int
    decoded_token: str


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What is new for one of a request's n completions since the last output."""
    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[list[LogprobEntry]] | None = None  # per new token: the sampled one first
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # set when the request finishes (part 13)
    # With a completion's first output only: when the engine first scheduled it (its clock), for
    # the queue and prefill times. vLLM: the SCHEDULED EngineCoreEvent in EngineCoreOutput.events.
    scheduled_time: float | None = None
    # The request's prompt logprobs (part 15), with its first output only: per prompt token after the first.
    prompt_logprobs: list[list[LogprobEntry]] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # the engine's clock when sent: maps scheduled_time onto the receiver's


class Ready(msgspec.Struct, array_like=True):
    engine_index: int
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int


class Rejected(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    param: str | None


class Handshake(msgspec.Struct, array_like=True):
    prefix_caching_hash_seed: str


class Dead(msgspec.Struct, array_like=True):
    engine_index: int
    traceback: str


_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(t) for t in
             (EngineCoreRequest, EngineCoreOutputs, Ready, Rejected, Handshake, Dead, list[str], int)}


def encode(obj) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes, kind: type):
    """Decode against a declared type; raises msgspec.ValidationError / DecodeError on a mismatch."""
    return _decoders[kind].decode(data)
