"""What generate() returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # A KV connector's parameters for the client (part 13: where a prefill left this request's KV).
    kv_transfer_params: dict | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold a delta (what is new since the last one) into this whole output: text, tokens and
        logprobs appended, the cumulative logprob summed in the same order the engine sums it, the
        latest reasons kept. A server that streams deltas builds whole responses this way."""
        whole = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = whole.get(d.index)
            if c is None:
                c = whole[d.index] = CompletionOutput(d.index, "", [])
                self.outputs.append(c)
                self.outputs.sort(key=lambda o: o.index)
            c.text += d.text
            c.token_ids = c.token_ids + d.token_ids
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
                for token, entry in zip(d.token_ids, d.logprobs):
                    c.cumulative_logprob = (c.cumulative_logprob or 0.0) + entry[token].logprob
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        self.finished = delta.finished
        self.kv_transfer_params = delta.kv_transfer_params or self.kv_transfer_params
