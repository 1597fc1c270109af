"""Stand-ins for the parts of a request a scheduler reads, so schedulers are tested without a
model: a Sequence whose request has SamplingParams and whose state has the generated tokens."""
from __future__ import annotations

from types import SimpleNamespace

from shared.sampling_params import SamplingParams


class State:
    """The bits of CompletionState a scheduler reads."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.finished = False


def make_seq(sequence_cls, name: str, prompt_len: int, max_tokens: int | None = 100):
    request = SimpleNamespace(params=SamplingParams(max_tokens=max_tokens), cache_salt=None)
    return sequence_cls(name, request=request, state=State(), token_ids=list(range(prompt_len)))


def arrive(s, token: int = 7) -> bool:
    """The host receives one sampled token of `s` (what the engine's update does): kept unless
    the sequence finished meanwhile."""
    keep = not s.finished
    s.num_output_placeholders -= 1
    if keep:
        s.token_ids.append(token)
        s.state.token_ids.append(token)
    return keep


def names(out) -> list[tuple[str, int]]:
    return [(s.seq_id, n) for s, n in out.scheduled]
