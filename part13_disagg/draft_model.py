"""The proposers: who guesses the next k tokens, and where.

Both give the engine, before each step is scheduled, a list of draft tokens per decoding sequence
(`propose(token_ids)`), so the scheduler knows how many tokens each sequence's step verifies:

* `NgramProposer` (ngram_proposer.py) finds the drafts on the host right there.
* `DraftModelProposer` (here) answers with k empty slots: the drafts are sampled on the device,
  inside the step, by a smaller model, just before the target verifies them. Its q (the
  distribution each draft was drawn from) goes to the rejection sampler.

The draft model reads and writes its own paged KV cache through *the target's block tables*: the
same block ids and slots, in a second, smaller tensor (its own layers, heads and head size). So it
needs no allocator of its own, a preempted or finished sequence frees both caches at once, and a
prefix-cache hit on the target's blocks is a hit for the draft too (the draft computes every
token the target computes, prompt chunks included, and it is the same draft for the engine's
whole life; whoever swaps it must empty the prefix cache, as notebook 08 does).

Without `--speculative-model` the draft is the target's first L layers with the target's own final
norm and head (a layer-truncated self-draft): no second checkpoint to download, no extra weights in
memory, the same vocabulary by construction. It is a weak guesser, since the target's head was never
trained on layer L's hidden states, but a real one; a trained small sibling (SmolLM2-135M for
SmolLM2-1.7B) guesses better."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shared.model import LlamaForCausalLM
from shared.sampler import Sampler, SamplingRow, argmax_rows
from shared.weights import load_model, resolve_model_path

from .paged_attention import PagedAttention


class LayerTruncatedDraft(nn.Module):
    """The target's embedding, first `num_layers` decoder layers, final norm and head: shared
    modules, no copy. Its attention layers keep their indices 0..L-1, so the draft's own KV
    cache of L layers serves them."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int):
        super().__init__()
        # All the layers is allowed: the target drafting for itself accepts every draft and saves
        # nothing, the ceiling a notebook can compare real drafts against.
        if not 1 <= num_layers <= target.config.num_hidden_layers:
            raise ValueError(f"a self-draft needs 1 to {target.config.num_hidden_layers} layers, got {num_layers}")
        self.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
        self.embed_tokens, self.norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        self.layers = target.layers[:num_layers]
        self.start_layer, self.end_layer = 0, num_layers
        # The target family's own embedding and logits (Gemma scales the one and caps the other).
        self.embed_input_ids, self.compute_logits = target.embed_input_ids, target.compute_logits

    forward = LlamaForCausalLM.forward  # the same code over fewer layers


class DraftSlots:
    """The engine's side of a draft model: it only needs to know how many slots to schedule. (With
    tensor parallelism the draft model lives in the worker processes, not in the engine's.)"""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """k slots (0s) for drafts the step itself samples; fewer when the budget is smaller."""
        return [0] * max(0, min(self.k, max_drafts))


class DraftModelProposer(DraftSlots):
    def __init__(self, target: LlamaForCausalLM, num_speculative_tokens: int, max_model_len: int,
                 num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 model: str | None = None, num_layers: int = 8, load_format: str = "auto",
                 use_triton: bool | None = None):
        super().__init__(num_speculative_tokens)
        if model is None:
            self.model = LayerTruncatedDraft(target, num_layers)
        else:
            self.model = load_model(resolve_model_path(model), device, dtype, max_model_len, load_format)
            if self.model.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.model.config.vocab_size}) differs from "
                                 f"the target's ({target.config.vocab_size}): drafts must be the target's tokens")
        c = self.model.config
        kv_heads = self.model.layers[0].self_attn.num_kv_heads  # a self-draft's are its rank's (part 09)
        self.attn = PagedAttention(c.num_hidden_layers, num_blocks, block_size, kv_heads,
                                   c.head_dim, dtype, device, use_triton=use_triton)


def sample_drafts(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one draft per row from the draft's distribution q, shaped by the same sampling
    parameters as the target's p (bans, logit_bias, penalties, temperature, top-k/p, min-p).
    Returns the tokens and q ([rows, V]; greedy rows, which take the argmax and whose q the
    rejection sampler never reads, have a one-hot q)."""
    processed = Sampler.process_logits(logits, rows)
    tokens = argmax_rows(processed)
    q = torch.zeros_like(processed)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        sub = [rows[i] for i in sampled]
        probs = Sampler.probs(processed[sampled], sub)
        noise = Sampler.exponential_noise(probs, [r.generator for r in sub])
        tokens[sampled] = argmax_rows(probs / noise)
        q[sampled] = probs
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        q[greedy, tokens[greedy]] = 1.0
    return tokens, q
