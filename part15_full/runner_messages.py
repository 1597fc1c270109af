"""The messages between the engine and its model runners: what the engine sends for one step (each
sequence's share, `SequenceBatchEntry`; over a process boundary, `StepMessage`) and what comes back
(`ModelRunnerOutput`). The engine builds and reads these and nothing else of the runner: it imports
this module, never model_runner.py, so the scheduler side can be read, and tested, without the model.

In vLLM v0.33.0: vllm/v1/core/sched/output.py (SchedulerOutput: NewRequestData, CachedRequestData) and
vllm/v1/outputs.py (ModelRunnerOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.sampler import SampledBatch, SamplingRow

    from .prompt_logprobs import PromptLogprobsOutput, PromptLogprobsSpec
    from .rejection_sampler import RejectionOutput


@dataclass
class SequenceBatchEntry:
    """One sequence's share of a step: its new tokens, how many tokens it already has in the
    cache, its block table and how it samples (None: a prefill chunk that stops short of the
    prompt's end samples nothing). When its last new token is the one the previous step sampled
    for it (not yet on the host), `token_ids` lacks it and `prev_row` names the previous step's
    row that holds it."""
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingRow | None
    prev_row: int | None = None
    seq_id: str = ""  # a worker process keeps per-sequence state (its seeded generator) under it
    # Drafts to verify after token_ids (the draft model's are 0s, sampled on the device), and how
    # many positions from the first sampled one still ban EOS and stop ids (min_tokens).
    draft_token_ids: list[int] = field(default_factory=list)
    min_tokens_left: int = 0
    # Draft model only: the known tokens its KV cache lacks, ending with this step's last known one.
    draft_input_ids: list[int] | None = None
    # Part 15: a prefill chunk whose request asks for prompt logprobs (prompt_logprobs.py).
    prompt_logprobs: PromptLogprobsSpec | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + (self.prev_row is not None) + len(self.draft_token_ids)


@dataclass
class ModelRunnerOutput:
    """A step's results: the sampled tokens, and what a KV connector reports (the requests whose
    KV finished sending or arriving; parts 12-13), which the engine hands to its scheduler."""
    sampled: SampledBatch | RejectionOutput
    kv_connector_output: Any = None
    prompt_logprobs: PromptLogprobsOutput | None = None  # part 15 (prompt_logprobs.py)


@dataclass
class StepMessage:
    """One step, as the engine publishes it to every rank."""
    batch: list[SequenceBatchEntry]  # sampling rows without their generators
    seeds: dict[str, int]  # seq_id -> seed, for the sequences with a seeded generator
    finished_seq_ids: list[str]
    # Whatever a KV connector's scheduler side sends its worker side with this step (parts 12-13).
    kv_connector_metadata: Any = None
    grammar_output: Any = None  # structured outputs' bitmask, filled (part 15)
    preempted_seq_ids: list[str] = field(default_factory=list)  # their blocks went back to the pool (part 15)
