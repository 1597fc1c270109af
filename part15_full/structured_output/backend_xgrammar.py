"""The xgrammar backend: every constraint type, as vLLM serves it by default.

xgrammar (pip `xgrammar`, C++ with Python bindings) compiles JSON schemas, regexes and EBNF
grammars into a pushdown automaton over bytes, and precomputes, for each automaton position, the
tokens that are decided without looking at the stack; the rest are checked at run time. Its
GrammarMatcher is the per-request state: accept_token, fill_next_token_bitmask, rollback, reset.
This file only adapts it to our interface:

- JSON: a JSON-schema string; JSON_OBJECT: any JSON object (the schema {"type": "object"});
  REGEX; GRAMMAR: EBNF as xgrammar reads it (GBNF-like, a `root` rule); CHOICE: a JSON list of
  strings, compiled as the EBNF `root ::= "a" | "b"` (JSON string escapes are EBNF escapes).
- Every compile error (xgrammar raises RuntimeError from C++) becomes ValueError with the
  constraint type in the message, which the server turns into a 400.
- EOS: the ids passed in become the matcher's stop tokens, so EOS is allowed exactly when the
  grammar can end, and accepting it terminates the matcher.
- The compiler caches compiled grammars, so a second compile of the same constraint (one
  grammar per sequence when n > 1) is cheap.
- Where it differs from the course backend (measured on SmolLM2): its regex `.` matches "\\n"
  and its \\s includes Unicode spaces (Python's `re` and ours: no), and its TokenizerInfo takes
  SmolLM2's special tokens (<|endoftext|>, <repo_name>, ...) for text, so a free-text regex such
  as [^"]* allows them; only the ids it pads past the tokenizer are never allowed.

`apply_token_bitmask_inplace_xgrammar` runs xgrammar's own kernel: on CPU it upcasts to fp32
first and copies back, as vLLM does (older CPU kernels took fp32 only).

In vLLM: vllm/v1/structured_output/backend_xgrammar.py (XgrammarBackend, XgrammarGrammar),
vllm/v1/structured_output/utils.py (apply_grammar_bitmask, choice_as_grammar),
vllm/v1/structured_output/__init__.py (StructuredOutputManager)."""
from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from .backend_types import StructuredOutputBackend, StructuredOutputGrammar, StructuredOutputOptions
from .bitmask import FULL_MASK

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def choice_as_ebnf(grammar_spec: str) -> str:
    try:
        choices = json.loads(grammar_spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"choice must be a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty JSON list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_json(grammar_spec: str) -> None:
    """A clear message for the commonest mistake, before xgrammar's own checks."""
    try:
        schema = json.loads(grammar_spec)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"invalid json constraint: the schema is not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise ValueError("invalid json constraint: a JSON schema is an object (or a boolean)")


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: "xgr.GrammarMatcher", vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_processed_tokens = 0
        self._terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self._terminated:
                return True  # tokens after EOS are not the grammar's business
            if not 0 <= token < self.vocab_size or not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        if self._terminated:
            return []
        accepted: list[int] = []
        for token in tokens:
            if not 0 <= token < self.vocab_size or not self.matcher.accept_token(token):
                break
            accepted.append(token)
            if self.matcher.is_terminated():
                break
        if accepted:  # validating must not move the matcher: take the trial steps back
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_processed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: "
                             f"{self.num_processed_tokens} accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens
            self._terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        if self._terminated:  # xgrammar refuses to fill after EOS: leave the row unconstrained
            bitmask[idx].fill_(FULL_MASK)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0
        self._terminated = False


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None = None,
                 *, any_whitespace: bool = True, max_threads: int = 2) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        # vocab_size pads the vocabulary to the logits width; the padding ids are never allowed.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.any_whitespace = any_whitespace  # vLLM's disable_any_whitespace, inverted

    def compile_grammar(self, request_type: StructuredOutputOptions,
                        grammar_spec: str) -> StructuredOutputGrammar:
        try:
            if request_type == StructuredOutputOptions.JSON:
                _check_json(grammar_spec)
                compiled = self.compiler.compile_json_schema(
                    grammar_spec, any_whitespace=self.any_whitespace)
            elif request_type == StructuredOutputOptions.JSON_OBJECT:
                compiled = self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=self.any_whitespace)
            elif request_type == StructuredOutputOptions.REGEX:
                compiled = self.compiler.compile_regex(grammar_spec)
            elif request_type == StructuredOutputOptions.GRAMMAR:
                compiled = self.compiler.compile_grammar(grammar_spec)
            elif request_type == StructuredOutputOptions.CHOICE:
                compiled = self.compiler.compile_grammar(choice_as_ebnf(grammar_spec))
            else:
                raise ValueError(f"unsupported structured output type {request_type!r}")
        except ValueError:
            raise
        except Exception as e:  # xgrammar's C++ errors surface as RuntimeError
            # Its messages start with "[time] file.cc:line: "; keep the readable part.
            detail = _CPP_PREFIX.sub("", str(e).strip())
            raise ValueError(f"invalid {request_type.name.lower()} constraint: {detail}") from e
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self.eos_token_ids)
        return XgrammarGrammar(matcher, self.vocab_size)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


def apply_token_bitmask_inplace_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor,
                                         indices: list[int] | None = None) -> None:
    """xgrammar's kernel; on CPU through an fp32 copy unless the logits already are fp32."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        upcast = logits.float()
        xgr.apply_token_bitmask_inplace(upcast, bitmask, indices=indices)
        logits.copy_(upcast)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
