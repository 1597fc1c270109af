"""A request and its sequences. Each of the n samples of a request is a Sequence: it owns its
KV blocks and knows how many of its tokens are already in the cache, how many of its sampled
tokens are still on their way to the host (async scheduling's output placeholders), and the
hashes of its full blocks (prefix caching's content addresses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .kv_cache_utils import BlockHash

from shared.output_processor import CompletionState
from .outputs import PromptLogprobs, RequestOutput
from shared.sampling_params import SamplingParams


@dataclass
class Sequence:
    seq_id: str
    request: "Request"
    state: CompletionState
    token_ids: list[int]  # prompt + generated so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # Tokens that a step in flight samples but whose ids the host does not know yet. The next
    # step's input for this sequence is such a token: the model runner writes its id there on
    # the device. vLLM: Request.num_output_placeholders.
    num_output_placeholders: int = 0
    # One per full block of known tokens, filled in as blocks fill (kv_cache_utils.py).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Speculative decoding: the draft tokens its next step verifies (set by the engine's proposer
    # before each schedule), and how many of its tokens the draft model's KV cache holds (None: as
    # many as the target's, after an admission or a preemption).
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int | None = None
    # The host tier (part 12): the host blocks holding this sequence's KV while it is swapped out,
    # and how many of its leading prompt blocks have been sent to the host tier's prefix cache.
    host_block_ids: list[int] | None = None
    num_offloaded_blocks: int = 0
    # What its KV connector tells the client once it finished (part 13: where its KV waits).
    kv_transfer_params: dict | None = None
    # Its structured-output grammar (part 15): the constraint's state after its tokens so far.
    grammar: Any = None
    # False while a reasoning model is still thinking: the grammar waits (structured_output/reasoning.py).
    reasoning_ended: bool = True

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the ones still in flight included."""
        return len(self.state.token_ids) + self.num_output_placeholders

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs (part 15) need every prompt position's logits: no prefix-cache hit (vLLM's rule)."""
        return getattr(self.request, "prompt_logprobs", None) is not None

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generators[self.state.index]

    def append(self, token_id: int, logprob=None, top=None, rank=None) -> bool:
        self.token_ids.append(token_id)
        return self.state.append(token_id, logprob, top, rank)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    generators: list[torch.Generator | None] = field(default_factory=list)  # one per sample
    # Enters the first block's hash: requests with different salts never share a cached block.
    cache_salt: str | None = None
    # What the client asked a KV connector to do with this request (part 13: fetch its prompt's KV from
    # a prefill engine, or keep it for a decode engine), as vLLM's kv_transfer_params.
    kv_transfer_params: dict | None = None
    # With --scheduling-policy priority: waiting and preemption order by (priority, arrival_time).
    priority: int = 0
    arrival_time: float = 0.0
    sequences: list[Sequence] = field(default_factory=list)
    # Part 15: one entry per prompt token when the request asks (prompt_logprobs.py), filled as its
    # prefill chunks run; sent with its first output.
    prompt_logprobs: PromptLogprobs | None = None
    _prompt_logprobs_sent: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.sequences = [Sequence(f"{self.request_id}-{c.index}", self, c, list(self.prompt_token_ids))
                          for c in self.completions]
        if getattr(self.params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self, delta: bool = False) -> RequestOutput:
        outs = [c.delta() if delta else c.output() for c in self.completions]
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not (delta and self._prompt_logprobs_sent) \
                and any(c.token_ids or c.finished for c in self.completions):  # complete once a token is out
            prompt_logprobs, self._prompt_logprobs_sent = list(self.prompt_logprobs), self._prompt_logprobs_sent or delta
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.sequences[0].kv_transfer_params, prompt_logprobs)
