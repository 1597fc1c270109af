"""Speculative decoding's counters, in vLLM's terms.

A *draft* is one sequence's k proposed tokens in one step. Per step and sequence the rejection
sampler accepts a run of 0..k of them and adds one token of its own, so a step that speculates
yields 1 + accepted tokens:

    acceptance rate         = accepted tokens / draft tokens
    mean acceptance length  = 1 + accepted tokens / drafts      (tokens per verifying step)
    accepted per position   : how often draft position j was accepted (it falls with j: the run
                              ends at the first rejection)"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))  # k may be raised on a live engine
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
