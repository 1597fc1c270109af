"""A request: its prompt, sampling parameters, and one CompletionState per sample (n)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.output_processor import CompletionState
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    generators: list[torch.Generator | None] = field(default_factory=list)  # one per sample
    aborted: bool = field(default=False)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self, delta: bool = False) -> RequestOutput:
        outs = [c.delta() if delta else c.output() for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished)
