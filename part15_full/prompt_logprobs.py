"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of every prompt token given the
ones before it, plus the top-k tokens at each position. Evaluation harnesses score a model this way
(lm-evaluation-harness sends context + continuation with `echo` and reads these).

Why here. A prefill computes hidden states for every prompt position, but the runner keeps only the
last one's logits (the one that samples). A request that asks for prompt logprobs also has the logits
of its chunk's other positions computed, log-softmaxed (raw: no temperature, penalty or bias, as vLLM)
and scored against the next prompt token, in the same step; chunked prefill gives them chunk by chunk,
and the engine stores each at its prompt position, so a preemption that recomputes a chunk only
overwrites. Every position is needed, so such a request never reads the prefix cache (its blocks are
still written there). Position 0 has no logprob: the list starts with None, as vLLM's.

Device results stay on the device until the engine reads the step (one `SampledBatch`, copied to the
host with the step's sampled tokens): no extra sync in the step.

In vLLM: vllm/v1/worker/gpu_model_runner.py (_get_prompt_logprobs_dict), vllm/v1/engine/logprobs.py
(LogprobsProcessor's prompt logprobs), vllm/v1/request.py (skip_reading_prefix_cache)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.outputs import Logprob
from shared.sampler import SampledBatch, Sampler as RowSampler


@dataclass
class PromptLogprobsSpec:
    """One prefill chunk's share: its first len(target_ids) rows each score the prompt's next token."""
    num_top: int
    start: int  # the prompt position of the chunk's first row
    target_ids: list[int]


def spec_for(seq, start: int, num_tokens: int) -> PromptLogprobsSpec | None:
    """What a chunk of `num_tokens` tokens from position `start` contributes, if its request asks:
    the first of its n samples only, and only until the request's first output has gone out."""
    k = getattr(seq.request.params, "prompt_logprobs", None)
    if k is None or seq.state.index != 0 or seq.state.token_ids:
        return None
    prompt = seq.request.prompt_token_ids
    end = min(start + num_tokens, len(prompt) - 1)  # the last prompt position samples instead
    return PromptLogprobsSpec(k, start, prompt[start + 1:end + 1]) if end > start else None


@dataclass
class PromptLogprobsPlan:
    """A step's prompt-logprob rows, as the runner reads them."""
    seq_ids: list[str]
    starts: list[int]
    counts: list[int]
    num_top: list[int]
    rows: torch.Tensor  # [R] rows of the step's hidden states
    targets: torch.Tensor  # [R] the prompt token each row scores


def plan(batch, tensor) -> PromptLogprobsPlan | None:
    """The rows of the flattened step (entries in batch order) whose logits score a prompt token."""
    seq_ids, starts, counts, num_top, rows, targets, offset = [], [], [], [], [], [], 0
    for e in batch:
        spec = e.prompt_logprobs
        if spec is not None:
            seq_ids.append(e.seq_id)
            starts.append(spec.start)
            counts.append(len(spec.target_ids))
            num_top.append(spec.num_top)
            rows += range(offset, offset + len(spec.target_ids))
            targets += spec.target_ids
        offset += e.num_new_tokens
    if not seq_ids:
        return None
    return PromptLogprobsPlan(seq_ids, starts, counts, num_top, tensor(rows), tensor(targets))


@dataclass
class PromptLogprobsOutput:
    """A step's prompt logprobs, on the device until the engine reads them."""
    plan: PromptLogprobsPlan
    batch: SampledBatch


def compute(model, hidden: torch.Tensor, p: PromptLogprobsPlan) -> PromptLogprobsOutput:
    logprobs = model.compute_logits(hidden[p.rows]).float().log_softmax(dim=-1)
    want = [k for k, n in zip(p.num_top, p.counts) for _ in range(n)]
    return PromptLogprobsOutput(p, RowSampler._gather_logprobs(logprobs, p.targets, want).copy_to_host_async())


def to_host(out: PromptLogprobsOutput | None) -> PromptLogprobsOutput | None:
    """Picklable (a worker process sends it): tensors on the CPU."""
    if out is None:
        return None
    b = out.batch
    moved = {name: getattr(b, name).cpu() if isinstance(getattr(b, name), torch.Tensor) else getattr(b, name)
             for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "num_top")}
    p = out.plan
    return PromptLogprobsOutput(PromptLogprobsPlan(p.seq_ids, p.starts, p.counts, p.num_top, p.rows.cpu(),
                                                   p.targets.cpu()), SampledBatch(**moved))


def record(out: PromptLogprobsOutput, sequences: dict, decode) -> None:
    """Store each row's entry at its prompt position in its request's `prompt_logprobs` (the scored
    token first, then the top-k, as a generated token's)."""
    host = out.batch.to_output()
    row = 0
    for seq_id, start, count in zip(out.plan.seq_ids, out.plan.starts, out.plan.counts):
        seq = sequences.get(seq_id)
        target = seq.request.prompt_logprobs if seq is not None else None
        for j in range(row, row + count):
            if target is None:
                continue
            tid = host.token_ids[j]
            entry = {tid: Logprob(host.logprobs[j], host.ranks[j], decode([tid], skip_special_tokens=False))}
            for r, (t, lp) in enumerate(host.top_logprobs[j], start=1):
                entry.setdefault(t, Logprob(lp, r, decode([t], skip_special_tokens=False)))
            target[start + 1 + j - row] = entry
        row += count
