"""Part 15's own structured-output backend, model-free: the regex DFA against Python's `re` (the
oracle), the vocabulary trie's allowed tokens against walking every token through the DFA, the
bitmask against a plain bool mask, and the token FSM (EOS only where the regex may end, drafts
cut at the first token the grammar rejects, rollback) on a toy vocabulary."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from part15_full.structured_output.backend_course import CourseGrammar, TokenFSM, choice_as_regex
from part15_full.structured_output.bitmask import (allocate_token_bitmask, apply_token_bitmask_inplace,
                                                   pack_allowed, unpack_bitmask)
from part15_full.structured_output.regex_dfa import build_dfa
from part15_full.structured_output.regex_parser import parse_regex
from part15_full.structured_output.vocab_trie import VocabTrie

PATTERNS = [r"a|b", r"ab*c?", r"[a-c]{2,3}", r"\d+(\.\d{1,2})?", r"-?(0|[1-9]\d*)", r"(ab|a)*b",
            r"[^a\n]+", r".{1,3}", r"\w+@\w+\.(com|org)", r'"([^"\\]|\\.)*"', r"(?:yes|no|maybe)",
            r"[é-ü]x?", r"\s*\{\s*\}", r"a{0,2}b{3}", r"^[A-Z][a-z]*$"]
ALPHABET = ["a", "b", "c", "0", "1", "9", ".", "-", '"', "\\", "é", "ü", "\n", " ", "{", "}", "@",
            "x", "A", "Z", "m", "o", "y", "e", "s", "n"]


def samples(pattern: str, rng: random.Random) -> list[str]:
    out = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(1500)]
    # Strings the regex matches, so that both answers are exercised.
    out += ["a", "abbbc", "ac", "abc", "acb", "12.5", "12.555", "-0", "-01", "907", "aabab", "b", "bc ",
            "x@y.com", "me@host.org", '"a\\"b"', '"', "yes", "maybe", "no ", "éx", "üx", "ÿ", " { } ",
            "{}", "bbb", "aabbb", "Abc", "A", "a\nb", "ééé"]
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_accepts_what_python_re_accepts(pattern):
    dfa = build_dfa(parse_regex(pattern))
    rng = random.Random(pattern)
    hits = 0
    for s in samples(pattern, rng):
        expected = re.fullmatch(pattern, s, flags=re.ASCII) is not None
        assert dfa.fullmatch(s.encode()) == expected, (pattern, s)
        hits += expected
    assert hits > 0


@pytest.mark.parametrize("bad", ["(a", "a)", "[a-", r"(?=a)b", r"a\1", "a$b", "a{2,1}", "a{5000}"])
def test_unsupported_or_broken_regexes_are_refused(bad):
    with pytest.raises(ValueError):
        build_dfa(parse_regex(bad))


def toy_vocabulary(seed: int) -> list[bytes | None]:
    """Byte strings over a small alphabet, with multi-byte characters split across tokens (as BPE
    does) and a few byteless tokens (specials)."""
    rng = random.Random(seed)
    pieces = [c.encode() for c in ALPHABET] + ["é".encode()[:1], "é".encode()[1:]]
    vocab = [None, None] + sorted({b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
                                   for _ in range(400)})
    return vocab


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_tries_allowed_tokens_are_those_that_walk_without_dying(pattern):
    dfa = build_dfa(parse_regex(pattern))
    vocab = toy_vocabulary(len(pattern))
    trie = VocabTrie.build(vocab)
    for state in range(dfa.num_states):
        brute = np.array([bool(t) and dfa.walk(state, t) >= 0 for t in vocab])
        assert (trie.allowed_tokens(dfa, state) == brute).all(), (pattern, state)


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 95, 49152])
def test_bitmask_round_trips_and_masks_exactly_the_clear_bits(vocab_size):
    rng = np.random.default_rng(vocab_size)
    allowed = rng.random((3, vocab_size)) < 0.3
    bitmask = allocate_token_bitmask(4, vocab_size)
    for r in range(3):
        bitmask[r] = torch.from_numpy(pack_allowed(allowed[r], vocab_size))
    assert torch.equal(unpack_bitmask(bitmask[:3], vocab_size), torch.from_numpy(allowed))
    assert unpack_bitmask(bitmask[3:], vocab_size).all()  # a fresh row allows everything
    logits = torch.randn(4, vocab_size)
    for indices in (None, [2, 0]):
        out = logits.clone()
        apply_token_bitmask_inplace(out, bitmask, indices)
        rows = range(4) if indices is None else indices
        expected = logits.clone()
        for r in rows:
            expected[r] = logits[r].masked_fill(~unpack_bitmask(bitmask[r], vocab_size), float("-inf"))
        assert torch.equal(out, expected)
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(2, vocab_size + 32), bitmask)


EOS = 1


def toy_fsm(pattern: str) -> tuple[TokenFSM, list[bytes | None]]:
    vocab = [None, None, b"a", b"b", b"ab", b"ba", b"1", b"12", b"x", b"yes", b"y", b"es", b"no"]
    return TokenFSM(build_dfa(parse_regex(pattern)), VocabTrie.build(vocab), vocab, [EOS], len(vocab)), vocab


def allowed_ids(fsm: TokenFSM, state: int) -> set[int]:
    row = torch.from_numpy(fsm.mask(state)).unsqueeze(0)
    return set(torch.nonzero(unpack_bitmask(row, fsm.vocab_size)[0]).flatten().tolist())


def test_eos_is_allowed_exactly_where_the_regex_may_end():
    fsm, vocab = toy_fsm("ab?")
    grammar = CourseGrammar(fsm)
    assert allowed_ids(fsm, grammar.state) == {vocab.index(b"a"), vocab.index(b"ab")}
    assert grammar.accept_tokens("r", [vocab.index(b"a")])
    assert allowed_ids(fsm, grammar.state) == {EOS, vocab.index(b"b")}
    assert grammar.accept_tokens("r", [EOS]) and grammar.is_terminated()
    bitmask = allocate_token_bitmask(1, fsm.vocab_size)
    bitmask[0] = 0
    grammar.fill_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, fsm.vocab_size).all()  # finished: unconstrained


def test_drafts_are_cut_at_the_first_rejected_token_and_rollback_restores_the_state():
    fsm, vocab = toy_fsm(choice_as_regex('["yes", "no"]'))
    grammar = CourseGrammar(fsm)
    y, es, no, a = (vocab.index(t) for t in (b"y", b"es", b"no", b"a"))
    assert grammar.validate_tokens([y, es, EOS, a]) == [y, es, EOS]
    assert grammar.validate_tokens([y, a, es]) == [y]
    assert grammar.state == fsm.dfa.start  # validating accepts nothing
    assert grammar.accept_tokens("r", [y, es])
    assert not grammar.accept_tokens("r", [a])
    grammar.rollback(2)
    assert grammar.state == fsm.dfa.start
    assert grammar.accept_tokens("r", [no, EOS]) and grammar.is_terminated()
    with pytest.raises(ValueError):
        grammar.rollback(5)
    with pytest.raises(ValueError):
        choice_as_regex("[]")
