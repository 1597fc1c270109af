"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong twice over: a byte-level BPE token can hold half of a
UTF-8 character, and SentencePiece drops a token's leading space when it is decoded alone. So we
decode a short window of ids (starting a few tokens back, the prompt's tail at first) and emit
only the text the newest token added, holding it back while it ends in a broken character."""
from __future__ import annotations

from .tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


def find_stop_string(text: str, new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """Find the earliest stop string that ends inside the last `new_chars` characters (it may
    start in older text: a stop string can span several tokens). Returns (stop, start index)."""
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best
