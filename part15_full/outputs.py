"""What generate() returns, with the prompt's logprobs (prompt_logprobs.py) beside the completions.

`prompt_logprobs`: None unless the request asked; else one entry per prompt token, the first None
(nothing precedes it), each a dict token id -> Logprob with the prompt's token first. It comes with
the request's first delta; folding deltas (`add`) keeps it.

In vLLM: vllm/outputs.py (RequestOutput.prompt_logprobs)."""
from __future__ import annotations

from dataclasses import dataclass

from shared import outputs
from shared.outputs import Logprob

PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput(outputs.RequestOutput):
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: outputs.RequestOutput) -> None:
        super().add(delta)
        if getattr(delta, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = delta.prompt_logprobs
