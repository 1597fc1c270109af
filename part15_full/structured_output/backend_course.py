"""The course's own structured-output backend: REGEX and CHOICE by a token-level FSM.

The idea in three steps:
1. regex -> DFA over bytes (regex_parser.py, regex_dfa.py). Walking the DFA over the text so far
   gives one state; after pruning, a state exists only while the text is a prefix of a match.
2. DFA state -> token mask (vocab_trie.py). Token t is allowed in state s iff its bytes walk
   from s without dying. EOS is allowed iff s is accepting. Special tokens never are.
3. Per request, the grammar holds only its current DFA state (and the states before it, for
   rollback). Accepting a token = walking its bytes; the mask = a look-up by state.

Why lazy per-state masks: a DFA can have many states, most of which a given request never
visits; walking the 49k-token vocabulary for all of them up front would make compilation slow
for nothing. So compilation builds only the DFA (milliseconds), and a state's mask is computed
the first time some request stands in it, then cached on the shared `TokenFSM`: every later
request with the same regex (or the n sequences of one request) reuses it. Outlines precomputes
all states eagerly instead; xgrammar precomputes the context-independent part of each mask and
finishes the rest at run time. CHOICE is a REGEX: an alternation of escaped literals.

In vLLM: vllm/v1/structured_output/backend_xgrammar.py (XgrammarBackend, XgrammarGrammar: the
same interface over xgrammar), vllm/v1/structured_output/backend_outlines.py (the other
regex-to-FSM backend), vllm/v1/structured_output/__init__.py (StructuredOutputManager)."""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from .backend_types import StructuredOutputBackend, StructuredOutputGrammar, StructuredOutputOptions
from .bitmask import FULL_MASK, allocate_token_bitmask, pack_allowed
from .regex_dfa import ByteDFA, build_dfa
from .regex_parser import escape, parse_regex
from .vocab_trie import VocabTrie, vocabulary_bytes

MAX_CACHED_FSMS = 32


def choice_as_regex(grammar_spec: str) -> str:
    """CHOICE's spec (a JSON list of strings) as an alternation of escaped literals."""
    try:
        choices = json.loads(grammar_spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"choice must be a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty JSON list of strings")
    return "|".join(f"(?:{escape(c)})" for c in choices)


class TokenFSM:
    """One compiled regex against one vocabulary: the DFA plus its lazily filled mask cache."""

    def __init__(self, dfa: ByteDFA, trie: VocabTrie, token_bytes: list[bytes | None],
                 eos_token_ids: list[int], vocab_size: int) -> None:
        self.dfa, self.trie, self.token_bytes = dfa, trie, token_bytes
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._masks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # vLLM may fill bitmasks from a thread pool

    def mask(self, state: int) -> np.ndarray:
        """int32 [ceil(vocab_size / 32)]: the tokens allowed in `state` (EOS iff accepting)."""
        row = self._masks.get(state)
        if row is None:
            allowed = self.trie.allowed_tokens(self.dfa, state)
            allowed[self.eos_token_ids] = bool(self.dfa.accepting[state])
            row = pack_allowed(allowed, self.vocab_size)
            with self._lock:
                self._masks[state] = row
        return row

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (not EOS), or -1 if the grammar rejects it."""
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        return -1 if not data else self.dfa.walk(state, data)


class CourseGrammar(StructuredOutputGrammar):
    def __init__(self, fsm: TokenFSM) -> None:
        self.fsm = fsm
        self._eos = set(fsm.eos_token_ids)
        self.reset()

    @property
    def state(self) -> int:
        return self._history[-1][0]

    def _step(self, state: int, terminated: bool, token: int) -> tuple[int, bool] | None:
        if terminated:
            return None
        if token in self._eos:
            return (state, True) if self.fsm.dfa.accepting[state] else None
        nxt = self.fsm.next_state(state, token)
        return None if nxt < 0 else (nxt, False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.is_terminated():
                return True  # tokens after EOS are not the grammar's business
            step = self._step(*self._history[-1], token)
            if step is None:
                return False
            self._history.append(step)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        state, terminated = self._history[-1]
        accepted = []
        for token in tokens:
            step = self._step(state, terminated, token)
            if step is None:
                break
            accepted.append(token)
            state, terminated = step
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens < len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: "
                             f"{len(self._history) - 1} accepted")
        if num_tokens:
            del self._history[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        if self.is_terminated():  # done: leave the row unconstrained, as vLLM's manager does
            bitmask[idx].fill_(FULL_MASK)
        else:
            bitmask[idx].copy_(torch.from_numpy(self.fsm.mask(self.state)))

    def is_terminated(self) -> bool:
        return self._history[-1][1]

    def reset(self) -> None:
        # (DFA state, terminated) after each accepted token; entry 0 is the start.
        self._history: list[tuple[int, bool]] = [(self.fsm.dfa.start, False)]


class CourseBackend(StructuredOutputBackend):
    """REGEX and CHOICE only; the vocabulary's bytes and trie are built once, here."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 eos_token_ids: list[int] | None = None) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.token_bytes = vocabulary_bytes(tokenizer, vocab_size)
        self.trie = VocabTrie.build(self.token_bytes)
        self._fsms: dict[tuple[StructuredOutputOptions, str], TokenFSM] = {}

    def compile_grammar(self, request_type: StructuredOutputOptions,
                        grammar_spec: str) -> StructuredOutputGrammar:
        key = (request_type, grammar_spec)
        fsm = self._fsms.get(key)
        if fsm is None:
            if request_type == StructuredOutputOptions.REGEX:
                pattern = grammar_spec
            elif request_type == StructuredOutputOptions.CHOICE:
                pattern = choice_as_regex(grammar_spec)
            else:
                raise ValueError(f"the course backend supports REGEX and CHOICE only, not "
                                 f"{request_type.name}: use the xgrammar backend")
            dfa = build_dfa(parse_regex(pattern))
            fsm = TokenFSM(dfa, self.trie, self.token_bytes, self.eos_token_ids, self.vocab_size)
            if len(self._fsms) >= MAX_CACHED_FSMS:  # drop the oldest entry
                self._fsms.pop(next(iter(self._fsms)))
            self._fsms[key] = fsm
        return CourseGrammar(fsm)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return allocate_token_bitmask(max_num_seqs, self.vocab_size)
