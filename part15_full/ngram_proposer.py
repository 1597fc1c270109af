"""The n-gram proposer: prompt lookup decoding (vLLM's `method="ngram"`), a drafter with no model.

Generated text often repeats its context: code edits copy lines, summaries quote the document,
chat answers reuse names. So take the sequence's last n tokens, look for the same n tokens
earlier in the sequence, and guess that what followed them then follows now. Longer n-grams
are tried first (a longer matched context is a better predictor); among the occurrences of one
n-gram the earliest wins. The drafts are point masses (there is no q), which the rejection
sampler verifies with acceptance probability p(x).

Cost: it runs on the host every step for every decoding sequence, so one call is a handful of
vectorised numpy passes over the sequence: O(prompt_lookup_max * len), no per-position Python."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `token_ids` (prompt + output so far);
        [] if no n-gram of the allowed sizes recurs. (The engine's budget keeps a verified run
        within the model's length and the request's max_tokens.)"""
        budget = min(self.k, max_drafts)
        if budget <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        last = len(tokens) - 1
        # run[e]: how many tokens ending at position e (e < last, so never the suffix itself)
        # equal the sequence's last tokens, counted backwards and capped at max_n. Step j
        # compares tokens[e - j] with tokens[last - j] for every e at once.
        run = np.zeros(last, dtype=np.int64)
        alive = np.ones(last, dtype=bool)
        for j in range(min(self.max_n, last)):
            alive[j:] &= tokens[: last - j] == tokens[last - j]
            alive[:j] = False  # an occurrence ending at e < j would start before the sequence
            if not alive.any():
                break
            run += alive
        for n in range(self.max_n, self.min_n - 1, -1):
            ends = np.flatnonzero(run >= n)
            if ends.size:  # the earliest end of an n-token match is its earliest start
                start = ends[0] + 1
                return tokens[start: start + budget].tolist()
        return []
