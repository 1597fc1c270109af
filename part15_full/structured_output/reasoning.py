"""A grammar that waits for the reasoning to end (`--reasoning-parser` with structured outputs).

A reasoning model writes `<think> ... </think>` before its answer. A JSON schema or a regex is
meant for the answer: applied from the first token, it would forbid the reasoning (or force the
model to skip it). So while a constrained sequence is reasoning its logits get no mask and its
tokens do not advance the grammar; the token `</think>` ends the reasoning, and the grammar
constrains every token after it.

The engine sees token ids, not text, so the tags must each be one token of the vocabulary, as
they are in the models these parsers are for (DeepSeek-R1, Qwen3). Where they are not, there is
no gate, and the server refuses structured outputs with a reasoning parser.

Whether a sequence starts inside its reasoning is read from its prompt, as vLLM's parsers read
it: the last tag in the prompt decides (a chat template that writes `<think>` starts it inside,
one that writes an empty `<think></think>` block, Qwen3's with thinking off, starts it after);
no tag at all: inside.

In vLLM: vllm/reasoning/basic_parsers.py (BaseThinkingReasoningParser.is_reasoning_end: the last
tag in the ids decides) and vllm/v1/structured_output/__init__.py (StructuredOutputManager:
should_fill_bitmask / should_advance, `reasoning_ended` per request)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

START_TAG, END_TAG = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningTags:
    start_id: int
    end_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> ReasoningTags | None:
        """The tags' token ids, or None where either is not a single token of the vocabulary."""
        hf = getattr(tokenizer, "hf", None) if getattr(tokenizer, "available", True) else None
        if hf is None:
            return None
        vocab = hf.get_vocab()
        if START_TAG not in vocab or END_TAG not in vocab:
            return None
        return cls(vocab[START_TAG], vocab[END_TAG])

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """Whether ids that begin a sequence leave it past its reasoning: the last tag decides."""
        for token in reversed(token_ids):
            if token == self.end_id:
                return True
            if token == self.start_id:
                return False
        return False
