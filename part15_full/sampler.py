"""The sampler on a step's SamplingMetadata: the shared sampler's pipeline, with no host sync.

Why. shared/sampler.py is the reference every part reads: per-row objects, Python lists, and on a
GPU a copy from pageable memory (a wait for the device) for each of them. Part 15 samples from the
tensors of sampling_metadata.py instead, and keeps every host decision to flags the host already
knows, so the only time a step's results reach the host is their copy after sampling
(SampledBatch.copy_to_host_async).

How. The same order and arithmetic as the shared sampler (bans -> logit_bias -> penalties -> greedy
argmax -> temperature -> top-k / top-p / min-p -> exponential race; vLLM's allowed_token_ids and bad
words are bans too, -inf like min_tokens', so where they sit among the bans changes nothing), so a seeded request samples
the same tokens as there (tests/test_part15_sampler.py). Three differences, none visible in the
tokens:
- greedy and random rows go through one pass, `torch.where` picking each row's token, instead of
  indexing the random rows with a list;
- the repetition penalty is read and written at the ids a row has seen (a gather and a scatter over
  its history), not over the whole vocabulary; frequency and presence count the output with one
  scatter; a history's newest token, still in flight, is patched in from the previous step's
  sampled ids on the device;
- when every random row has a top-k, only the best `max(top_k)` tokens are sorted and sampled from
  (`topk` rather than a sort of the whole vocabulary, temperature applied to those alone); a seeded
  row still draws its noise over the whole vocabulary, and reads it at its candidates, so its
  generator advances as before.

In vLLM v0.33.0: vllm/v1/sample/sampler.py (Sampler), vllm/v1/sample/ops/penalties.py and
vllm/v1/sample/ops/topk_topp_sampler.py (top-k / top-p, and FlashInfer's sampling kernels)."""
from __future__ import annotations

import torch

from shared.sampler import SampledBatch, Sampler as RowSampler, apply_top_k_top_p_min_p, argmax_rows, \
    mask_sorted_logits

from .sampling_metadata import SamplingMetadata


class Sampler:
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               prev_sampled: torch.Tensor | None = None) -> SampledBatch:
        """One token per row, left on the device (its copy to the host queued); `prev_sampled`: the
        previous step's sampled ids, for histories whose newest token is still in flight."""
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.num_top is not None else None
        logits = self.process_logits(logits, meta, prev_sampled)
        if meta.all_greedy:
            tokens = argmax_rows(logits)
        elif meta.all_random:
            tokens = self._sample(logits, meta)
        else:
            tokens = torch.where(meta.row("greedy") > 0.5, argmax_rows(logits), self._sample(logits, meta))
        if raw_logprobs is None:
            return SampledBatch(tokens).copy_to_host_async()
        return RowSampler._gather_logprobs(raw_logprobs, tokens, meta.num_top).copy_to_host_async()

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata, prev_sampled: torch.Tensor | None) -> torch.Tensor:
        """Banned tokens (min_tokens, allowed_token_ids, bad words) -> logit_bias -> penalties (the
        shared sampler's process_logits, with vLLM's two extra bans)."""
        if meta.ban_rows is not None or meta.allowed_rows is not None or meta.bad_rows is not None:
            logits = logits.clone()
        if meta.allowed_rows is not None:  # -inf everywhere but the allowed ids
            keep = torch.full((len(meta.allowed_rows), logits.shape[1]), float("-inf"), device=logits.device)
            logits[meta.allowed_rows] += keep.scatter_(1, meta.allowed_ids, 0.0)
        if meta.ban_rows is not None:
            logits[meta.ban_rows[:, None], meta.ban_ids] = float("-inf")
        if meta.bad_rows is not None:
            _ban_bad_words(logits, meta, prev_sampled)
        if meta.bias_rows is not None:
            bias = torch.zeros_like(logits)
            bias[meta.bias_rows[:, None], meta.bias_ids] = meta.bias_vals.to(logits.dtype)
            logits = logits + bias
        if meta.penalties and meta.pen_rows is None:  # every row
            logits = _penalized(logits, meta, prev_sampled)
        elif meta.penalties:
            logits = logits.clone()
            logits[meta.pen_rows] = _penalized(logits[meta.pen_rows], meta, prev_sampled)
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, the masks and the exponential race (argmax p / Exp(1) noise), over every row."""
        temperature = meta.row("temperature")[:, None]
        top_k, top_p, min_p = meta.row("top_k").long(), meta.row("top_p"), meta.row("min_p")
        if meta.max_top_k:  # every random row keeps at most max_top_k tokens: sample among those
            best, candidates = logits.topk(meta.max_top_k, dim=-1)  # the order temperature keeps
            probs = mask_sorted_logits(best / temperature, top_k, top_p, min_p).softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for i, g in meta.generators:  # a seeded row's noise over the whole vocabulary, as before
                noise[i] = torch.empty(logits.shape[1], device=logits.device).exponential_(generator=g)[candidates[i]]
            return candidates.gather(1, argmax_rows(probs / noise)[:, None])[:, 0]
        logits = logits / temperature
        if meta.top_k_p:
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, g in meta.generators:
            noise[i].exponential_(generator=g)
        return argmax_rows(probs / noise)


def _ban_bad_words(logits: torch.Tensor, meta: SamplingMetadata, prev_sampled: torch.Tensor | None) -> None:
    """A multi-token bad word's last token gets -inf where the row's last output tokens are the
    word's prefix; compared on the device, so a token still in flight needs no wait."""
    tail = meta.bad_tail
    if meta.bad_prev is not None:
        tail = tail.clone()
        tail[meta.bad_prev[0], -1] = prev_sampled[meta.bad_prev[1]]
    match = ((meta.bad_prefix == tail) | (meta.bad_prefix < 0)).all(dim=1)
    ban = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((meta.bad_rows, meta.bad_last), ban, accumulate=True)


def _penalized(logits: torch.Tensor, meta: SamplingMetadata, prev_sampled: torch.Tensor | None) -> torch.Tensor:
    """The shared sampler's apply_penalties on the penalized rows: repetition (prompt and output, HF
    style), then frequency and presence (output only, OpenAI style). The repetition penalty touches
    only the ids a row has seen, so it is read and written there, not over the vocabulary."""
    if meta.prev_fix is not None:  # the newest token, sampled by the step before, still on the device
        row, in_output, in_seen, prev = meta.prev_fix
        if meta.output_ids is not None:
            meta.output_ids[row, in_output] = prev_sampled[prev]
        if meta.seen_ids is not None:
            meta.seen_ids[row, in_seen] = prev_sampled[prev]

    def param(name):
        values = meta.row(name)
        return (values if meta.pen_rows is None else values[meta.pen_rows])[:, None]
    if meta.repetition:
        rep, seen = param("repetition_penalty"), logits.gather(1, meta.seen_ids)
        logits = logits.scatter(1, meta.seen_ids, torch.where(seen > 0, seen / rep, seen * rep))
    if meta.frequency_presence:
        counts = _counts(meta.output_ids, *logits.shape)
        logits = logits - param("frequency_penalty") * counts - param("presence_penalty") * (counts > 0).to(logits.dtype)
    return logits


def _counts(ids: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] occurrences of each id (the padding id, `vocab`, lands in a dropped column)."""
    counts = torch.zeros(rows, vocab + 1, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]
