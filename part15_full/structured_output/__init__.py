"""Structured outputs (grammar-constrained decoding): one interface, two backends.

- backend_types.py: StructuredOutputOptions, StructuredOutputGrammar, StructuredOutputBackend
- bitmask.py: the int32 token bitmask and apply_token_bitmask_inplace
- backend_xgrammar.py: every constraint type through xgrammar (vLLM's default backend)
- backend_course.py: REGEX and CHOICE through the course's own token-level FSM, built from
  regex_parser.py (regex -> syntax tree), regex_dfa.py (-> byte NFA -> byte DFA) and
  vocab_trie.py (vocabulary bytes in a trie; a DFA state's allowed tokens)

xgrammar is imported only by backend_xgrammar.py, so the course backend works without it.

In vLLM: vllm/v1/structured_output/ (__init__.py holds StructuredOutputManager)."""
from .backend_types import StructuredOutputBackend, StructuredOutputGrammar, StructuredOutputOptions
from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace

__all__ = ["StructuredOutputBackend", "StructuredOutputGrammar", "StructuredOutputOptions",
           "allocate_token_bitmask", "apply_token_bitmask_inplace"]
