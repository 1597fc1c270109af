"""Part 08's n-gram proposer (prompt lookup decoding) against hand-made sequences and a
brute-force reference: the longest n-gram wins, the earliest occurrence wins, the suffix is never
its own match, the proposal stops at the sequence's end and at the engine's budget."""
from __future__ import annotations

import random

import numpy as np
import pytest

from part08_specdec.ngram_proposer import NgramProposer


class proposer(NgramProposer):
    """A proposer whose budget is no limit unless a test gives one."""

    def __init__(self, lo: int = 1, hi: int = 3, k: int = 4):
        super().__init__(lo, hi, k)

    def propose(self, tokens, max_drafts: int = 1000):
        return super().propose(tokens, max_drafts)


def reference(tokens: list[int], lo: int, hi: int, k: int, max_drafts: int) -> list[int]:
    """The definition, spelled out position by position."""
    budget = min(k, max_drafts)
    if budget <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # every occurrence but the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + budget]
    return []


def test_longest_ngram_wins():
    # The 1-gram [3] first occurs at 0 (followed by 8); the 3-gram [1, 2, 3] occurs at 4.
    tokens = [3, 8, 8, 8, 1, 2, 3, 9, 9, 1, 2, 3]
    assert proposer(1, 3, k=2).propose(tokens) == [9, 9]
    assert proposer(1, 1, k=2).propose(tokens) == [8, 8]


def test_earliest_occurrence_wins():
    tokens = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert proposer(2, 2, k=2).propose(tokens) == [10, 11]


def test_fewer_than_k_tokens_at_the_end_and_overlap():
    # The only earlier occurrence of [7, 7] starts at 0 and overlaps the suffix: what follows
    # it runs into the suffix itself and stops at the sequence's end.
    assert proposer(2, 2, k=5).propose([7, 7, 7]) == [7]
    assert proposer(1, 2, k=5).propose([1, 2, 9, 1, 2]) == [9, 1, 2]


def test_no_match_is_empty():
    assert proposer().propose([1, 2, 3, 4, 5]) == []
    assert proposer().propose([]) == []
    assert proposer().propose([4]) == []


def test_the_suffix_is_not_its_own_match():
    # [1, 2] occurs only as the suffix: no proposal, although tokens[-2:] == [1, 2] trivially.
    assert proposer(2, 2).propose([9, 8, 1, 2]) == []


def test_min_and_max_bound_the_ngram_size():
    tokens = [1, 2, 3, 4, 0, 2, 3, 4]  # the 3-gram [2, 3, 4] recurs, no 4-gram does
    assert proposer(4, 5).propose(tokens) == []
    assert proposer(1, 2, k=1).propose(tokens) == [0]  # [3, 4] at 2
    assert proposer(3, 3, k=2).propose(tokens) == [0, 2]


def test_the_budget_caps_the_proposal():
    tokens = [1, 2, 3, 1, 2]  # [1, 2] matches at 0: [3, 1, 2] follows
    assert proposer(k=3).propose(tokens, 3) == [3, 1, 2]
    assert proposer(k=3).propose(tokens, 2) == [3, 1]
    assert proposer(k=3).propose(tokens, 1) == [3]
    assert proposer(k=3).propose(tokens, 0) == []


def test_accepts_numpy_input():
    assert proposer(k=2).propose(np.array([1, 2, 3, 1, 2])) == [3, 1]


@pytest.mark.parametrize("args", [(0, 3, 4), (3, 2, 4), (1, 3, 0)])
def test_argument_validation(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


def test_matches_brute_force_reference():
    rng = random.Random(0)
    for _ in range(500):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        budget = rng.randint(0, 8)
        assert NgramProposer(lo, hi, k).propose(tokens, budget) == reference(tokens, lo, hi, k, budget)
