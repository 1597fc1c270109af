"""The rejection sampler: verify k draft tokens with one target forward pass, and emit tokens
that follow the target's distribution exactly (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; vLLM's RejectionSampler).

A cheap proposer guesses tokens x_0..x_{k-1}, drawn from its distribution q (a draft model) or
just named (n-gram lookup: q is a point mass on x). The target model runs once over the sequence
plus the k drafts and gives, for every output position j = 0..k, the distribution p_j it would
sample from there (row j already counts drafts[:j] as generated output). Then, position by
position:

- accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
- at the first rejection, emit a *recovered* token drawn from normalize(max(0, p_j - q_j)) and stop;
- if all k drafts are accepted, the last row is free: emit a *bonus* token drawn from p_k.

Why this is exact: P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) * max(0, p(x) - q(x)) / Z
= min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), because P(reject) = 1 - sum min(p, q) = Z. So a
step emits 1..k+1 tokens, each distributed exactly as plain sampling would have drawn it: the
draft changes speed, never the output distribution. Greedy rows are the special case where p
is a point mass on the argmax: accept while the draft equals the target's argmax, then emit the
argmax, which is token for token what plain greedy decoding produces.

p is shaped exactly as the plain sampler shapes it (bans, logit_bias, penalties, temperature,
top-k/top-p/min-p): this module calls `Sampler.process_logits` and `Sampler.probs`.

Randomness: unseeded rows draw from the global RNG in batched draws (uniforms first, then the
exponential-race noise). A seeded sequence draws everything from its own generator in a fixed
order (its draft rows' uniforms in row order, then every row's noise in row order), so its tokens
do not depend on what else is in the batch. Every row draws its noise even if its candidate is
not used: which row's candidate is emitted depends on the uniforms, and drawing a fixed amount
keeps the stream position independent of the outcome. A sequence with no drafts draws exactly
what the plain sampler draws, and gets the same token."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampler import Sampler, SamplerOutput, SamplingRow, argmax_rows


def accept_drafts(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Accept draft x when u < p(x) / q(x), with u ~ U[0, 1): probability min(1, p(x) / q(x)).
    Written without the division: q(x) = 0 accepts any x with p(x) > 0, and p(x) = 0 (a banned
    or masked token) is never accepted."""
    return u * q_x < p_x


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What the target wants and the draft under-proposed, max(0, p - q), unnormalised: the
    recovered token's distribution after a rejection."""
    return (p - q).clamp(min=0.0)


@dataclass
class SpecDecodeMetadata:
    """The drafts of each sequence that samples this step, in batch order. Sequence s owns
    k_s + 1 consecutive rows of the target logits: one per draft, then the bonus row."""
    num_draft_tokens: list[int]  # k_s >= 0 (0: an ordinary decode or a prompt's last chunk)
    draft_token_ids: list[list[int]]  # k_s ids each

    def __post_init__(self) -> None:
        if len(self.num_draft_tokens) != len(self.draft_token_ids):
            raise ValueError("num_draft_tokens and draft_token_ids must have one entry per sequence")
        for k, ids in zip(self.num_draft_tokens, self.draft_token_ids):
            if k < 0 or len(ids) != k:
                raise ValueError(f"a sequence declares {k} draft tokens but has {len(ids)}")

    @classmethod
    def from_drafts(cls, draft_token_ids: list[list[int]]) -> SpecDecodeMetadata:
        return cls([len(d) for d in draft_token_ids], [list(d) for d in draft_token_ids])

    @property
    def num_rows(self) -> int:
        return sum(self.num_draft_tokens) + len(self.num_draft_tokens)

    @property
    def row_offsets(self) -> list[int]:
        """Sequence s's first row in the target logits."""
        offsets, row = [], 0
        for k in self.num_draft_tokens:
            offsets.append(row)
            row += k + 1
        return offsets


@dataclass
class RejectionOutput:
    """Per sequence, the tokens to append: the accepted drafts, then one recovered or bonus
    token. Each SamplerOutput carries logprobs (of the raw target logits, as the plain sampler
    reports them) for its tokens when any row of the batch asked for them."""
    outputs: list[SamplerOutput]
    num_accepted: list[int]  # drafts accepted per sequence (0..k_s)

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, target_logits: torch.Tensor, rows: list[SamplingRow], meta: SpecDecodeMetadata,
                 draft_probs: torch.Tensor | None = None) -> RejectionOutput:
        """target_logits: [sum(k_s + 1), V] raw logits, a sequence's rows contiguous, row j its
        target distribution for output position j. rows: one per logits row, row j's history
        already extended by drafts[:j]. draft_probs: [sum(k_s), V], the draft's processed q
        for each draft row in order, or None when the drafts are point masses (n-gram)."""
        num_rows, dev = meta.num_rows, target_logits.device
        if target_logits.shape[0] != num_rows or len(rows) != num_rows:
            raise ValueError(f"{num_rows} rows expected (sum of k_s + 1), got logits for "
                             f"{target_logits.shape[0]} and {len(rows)} sampling rows")
        if draft_probs is not None and draft_probs.shape[0] != sum(meta.num_draft_tokens):
            raise ValueError(f"draft_probs needs one row per draft token ({sum(meta.num_draft_tokens)}), "
                             f"got {draft_probs.shape[0]}")

        # Per row: is it a draft position, and which token did the draft propose there.
        is_draft, drafted = [], []
        for ids in meta.draft_token_ids:
            is_draft += [True] * len(ids) + [False]
            drafted += list(ids) + [0]  # the bonus row's 0 is never read
        is_draft_t = torch.tensor(is_draft, dtype=torch.bool, device=dev)
        drafted_t = torch.tensor(drafted, dtype=torch.long, device=dev)

        logits = self.sampler.process_logits(target_logits, rows)
        # Greedy rows: p is a point mass on the argmax, so accept iff draft == argmax, and the
        # argmax is also the recovered or bonus token.
        candidates = argmax_rows(logits)
        accepted = candidates == drafted_t
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.long, device=dev)
            # draft_probs holds the draft rows in order: a draft row's index there is the number
            # of draft rows before it.
            q_rows = (torch.cumsum(is_draft_t.long(), 0) - 1)[idx]
            acc, cand = self._verify(logits[idx], [rows[i] for i in sampled], is_draft_t[idx],
                                     drafted_t[idx], q_rows, draft_probs)
            accepted[idx], candidates[idx] = acc, cand
        accepted &= is_draft_t

        # The first rejection ends the run: pad each sequence's accept flags to [S, max k] with
        # False, and the cumulative product counts the leading accepted drafts.
        num_draft = torch.tensor(meta.num_draft_tokens, dtype=torch.long, device=dev)
        max_k = max(meta.num_draft_tokens, default=0)
        padded = torch.zeros(len(num_draft), max_k, dtype=torch.bool, device=dev)
        padded[torch.arange(max_k, device=dev)[None, :] < num_draft[:, None]] = accepted[is_draft_t]
        num_accepted = padded.long().cumprod(dim=1).sum(dim=1)
        offsets = torch.tensor(meta.row_offsets, dtype=torch.long, device=dev)
        last_tokens = candidates[offsets + num_accepted].tolist()  # recovered or bonus
        num_accepted = num_accepted.tolist()

        tokens = [ids[:n] + [t] for ids, n, t in zip(meta.draft_token_ids, num_accepted, last_tokens)]
        return RejectionOutput(self._outputs(target_logits, rows, meta, tokens), num_accepted)

    def _verify(self, logits: torch.Tensor, rows: list[SamplingRow], is_draft: torch.Tensor,
                drafted: torch.Tensor, q_rows: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-greedy rows: (accept flag, candidate token) per row. The candidate is a draw from
        the residual max(0, p - q) on draft rows and from p on bonus rows; the caller keeps the
        one at each sequence's first rejection (or its bonus row)."""
        p = self.sampler.probs(logits, rows)
        generators = [r.generator for r in rows]
        u = self._uniforms(is_draft, generators)
        # A point-mass draft is q = one-hot(x): acceptance becomes p(x), the residual p without x.
        q = torch.zeros_like(p)
        draft_rows = is_draft.nonzero()[:, 0]
        if draft_probs is None:
            q[draft_rows, drafted[draft_rows]] = 1.0
        else:
            q[draft_rows] = draft_probs[q_rows[draft_rows]].to(p.dtype)
        x = drafted[:, None]
        accept = is_draft & accept_drafts(u, p.gather(1, x)[:, 0], q.gather(1, x)[:, 0])
        residual = residual_probs(p, q)
        dist = torch.where(is_draft[:, None], residual, p)
        # A residual that is all zero (p == q) is never used in exact arithmetic (nothing is
        # rejected); fall back to p so rounding cannot make the race pick an impossible token.
        empty = dist.sum(dim=-1) <= 0
        dist = torch.where(empty[:, None], p, dist)
        # The race argmax dist / Exp(1) samples dist normalised: no need to divide by its sum.
        noise = self.sampler.exponential_noise(p, generators)
        return accept, argmax_rows(dist / noise)

    @staticmethod
    def _uniforms(is_draft: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """U[0, 1) for each draft row: unseeded rows in one draw, seeded rows one by one from
        their own generator in row order (bonus rows draw none, so k_s = 0 draws nothing)."""
        u = torch.zeros(len(generators), device=is_draft.device)
        flags = is_draft.tolist()
        unseeded = [i for i, (d, g) in enumerate(zip(flags, generators)) if d and g is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), device=is_draft.device)
        for i, (d, g) in enumerate(zip(flags, generators)):
            if d and g is not None:
                u[i] = torch.rand(1, generator=g, device=is_draft.device)[0]
        return u

    def _outputs(self, target_logits: torch.Tensor, rows: list[SamplingRow], meta: SpecDecodeMetadata,
                 tokens: list[list[int]]) -> list[SamplerOutput]:
        """Wrap each sequence's tokens; when any row asks for logprobs, every emitted token gets
        its logprob, rank and top-n under the raw target logits of the row that emitted it
        (output position j is scored by row j), exactly as the plain sampler reports them."""
        want = [r.params.logprobs for r in rows]
        if all(n is None for n in want):
            return [SamplerOutput(t) for t in tokens]
        emit_rows = [off + j for off, t in zip(meta.row_offsets, tokens) for j in range(len(t))]
        flat = torch.tensor([tok for t in tokens for tok in t], dtype=torch.long, device=target_logits.device)
        raw = target_logits[emit_rows].float().log_softmax(dim=-1)
        out = Sampler._gather_logprobs(raw, flat, [want[i] for i in emit_rows]).to_output()
        outputs, start = [], 0
        for t in tokens:
            end = start + len(t)
            outputs.append(SamplerOutput(t, out.logprobs[start:end], out.ranks[start:end],
                                         out.top_logprobs[start:end]))
            start = end
        return outputs
