"""The sampler: from a batch of logits to one token per row, each row with its own parameters.

Order: logprobs of the raw logits (vLLM's default) -> ban tokens (min_tokens) -> penalties ->
greedy rows take the argmax -> temperature -> top-k -> top-p -> min-p (HF's warper order; vLLM
V1 applies min-p before top-p, which differs only when both are set) -> sample. Sampling
uses the exponential race (argmax of p / Exp(1) noise), so a row with a seed draws its noise
from its own generator and gets the same tokens whatever else is in the batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: tuple[int, ...] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of each sampled token
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    width = max((len(r) for r in rows), default=0)
    if width:
        ids = torch.full((len(rows), width), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output, HF style), then presence and frequency (output only,
    OpenAI style)."""
    vocab, dev = logits.shape[1], logits.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
    if (rep != 1.0).any():
        seen = (_token_counts([r.prompt_token_ids for r in rows], vocab, dev) + out_counts) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf every token outside a row's top-k, top-p nucleus or min-p floor.
    top_k: [B] long (0 = off), top_p, min_p: [B] float."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    pos = torch.arange(vocab, device=logits.device)[None, :]
    drop = pos >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass *before* it is below top_p: the first token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in want_logprobs) else None

        if any(r.banned_token_ids for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.banned_token_ids:
                    logits[i, list(r.banned_token_ids)] = float("-inf")
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)

        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            tokens[sampled] = self._sample(logits[sampled], [rows[i] for i in sampled])
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list)
        return self._gather_logprobs(raw_logprobs, tokens, want_logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev)[:, None]
        logits = logits / temp
        if any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in rows):
            logits = apply_top_k_top_p_min_p(
                logits,
                torch.tensor([r.params.top_k for r in rows], device=dev, dtype=torch.long),
                torch.tensor([r.params.top_p for r in rows], device=dev),
                torch.tensor([r.params.min_p for r in rows], device=dev))
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, want: list[int | None]) -> SamplerOutput:
        chosen = raw.gather(1, tokens[:, None])[:, 0]
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        k = max(n or 0 for n in want)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
        tops = []
        for i, n in enumerate(want):
            n = n or 0
            tops.append(list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else [])
        return SamplerOutput(tokens.tolist(), chosen.tolist(), ranks.tolist(), tops)
