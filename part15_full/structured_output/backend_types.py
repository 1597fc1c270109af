"""The structured-output interface: what every grammar backend gives the engine.

Structured output (grammar-constrained decoding) keeps the model's text inside a formal language:
a JSON schema, a regex, a list of choices, an EBNF grammar. It works one token at a time: before
sampling, the grammar says which next tokens keep the text a prefix of some sentence of the
language; every other token's logit becomes -inf. After sampling, the chosen token advances the
grammar. EOS is allowed exactly when the text so far is a whole sentence.

Two objects carry this, whatever the backend:
- a `StructuredOutputBackend` per engine: it knows the tokenizer and the model's logits width
  (`vocab_size`), compiles a request's constraint once, and allocates the batch's bitmask;
- a `StructuredOutputGrammar` per request: the matcher's state. The scheduler advances it with
  `accept_tokens`, trims speculative drafts with `validate_tokens`, takes rejected drafts back
  with `rollback`, and writes the next-token mask into one row of the bitmask with `fill_bitmask`.
  A request with n > 1 sequences needs one grammar per sequence (compile again: backends cache
  compiled constraints, so the second compile is cheap), and `reset` rewinds one to the start.

The bitmask is int32 [rows, ceil(vocab_size / 32)]: bit j of word i is token 32 * i + j, 1 means
allowed (xgrammar's layout). 32x smaller than a bool mask, so cheap to ship to the device.

In vLLM: vllm/v1/structured_output/backend_types.py (these classes, plus STRUCTURAL_TAG and a
`destroy` every backend implements), vllm/v1/structured_output/__init__.py
(StructuredOutputManager: compiles, fills the bitmask while the forward runs)."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

import torch


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()  # a JSON-schema string
    JSON_OBJECT = enum.auto()  # any JSON object
    REGEX = enum.auto()
    GRAMMAR = enum.auto()  # EBNF (GBNF-style, as xgrammar reads it)
    CHOICE = enum.auto()  # a JSON list of strings: the output is exactly one of them


class StructuredOutputGrammar(ABC):
    """One request's (one sequence's) position in its compiled constraint."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens`. False at the first token the grammar rejects (the tokens before
        it stay accepted). Tokens after termination are ignored."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept, stopping after a terminating
        EOS. The state is left unchanged (used to trim speculative drafts)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        """Write the allowed next tokens into row `idx` of an int32 bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once EOS was accepted at an accepting state."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the constraint."""


class StructuredOutputBackend(ABC):
    """Engine-wide: compiles constraints against one tokenizer and one logits width."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 eos_token_ids: list[int] | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        # An id past the logits width can never be sampled: drop it.
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids if 0 <= e < vocab_size})

    @abstractmethod
    def compile_grammar(self, request_type: StructuredOutputOptions,
                        grammar_spec: str) -> StructuredOutputGrammar:
        """Compile one request's constraint; ValueError (the server's 400) if it is malformed."""

    @abstractmethod
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """An int32 [max_num_seqs, ceil(vocab_size / 32)] bitmask, all allowed."""

    def destroy(self) -> None:
        """Release backend resources (nothing to release by default)."""
