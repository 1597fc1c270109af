"""Reasoning parsers: split a thinking model's output into its reasoning and its answer.

Reasoning models write their chain of thought between `<think>` and `</think>` before the
answer. `--reasoning-parser` names the convention, and the API returns the two apart:
`message.reasoning` (also `reasoning_content`) and `message.content`; in a stream,
`delta.reasoning` and `delta.content`.

- `deepseek_r1`: everything up to `</think>` is reasoning, with or without a leading `<think>`
  (DeepSeek-R1's chat template writes `<think>` into the prompt, so the model's text often starts
  inside it). No `</think>` at all: the whole text is reasoning.
- `qwen3`: reasoning only where `<think>` appears (Qwen3 may answer without thinking); from it to
  `</think>`, or to the end if the model stopped thinking-first. Text around the block is content.

The tags are found in the text, not as token ids: a model whose tokenizer has no `<think>` token
writes it in pieces, and streaming holds back a piece that may begin a tag until it is clear.

In vLLM: vllm/reasoning/ (abs_reasoning_parsers.py: ReasoningParser, ReasoningParserManager;
basic_parsers.py: BaseThinkingReasoningParser; deepseek_r1_reasoning_parser.py;
qwen3_engine_reasoning_parser.py). vLLM finds the tags by token id (each is one token in those
models' vocabularies) and its streaming method gets the previous/current/delta texts and ids."""
from __future__ import annotations

from typing import Any

from .chat_protocol import DeltaMessage
from .tool_parsers import partial_tag_overlap


class ReasoningParser:
    """One per response choice (it keeps the stream's state)."""
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any = None):
        self.model_tokenizer = tokenizer
        self._sent = ["", ""]  # reasoning and content sent so far

    def extract_reasoning(self, model_output: str, request=None) -> tuple[str | None, str | None]:
        """(reasoning, content), either None when there is none."""
        reasoning, content = self._split(model_output, finished=True)
        return reasoning, content or None

    def _split(self, text: str, finished: bool) -> tuple[str | None, str]:
        raise NotImplementedError

    def _hold(self, text: str, tag: str, finished: bool) -> str:
        """`text` less a tail that may begin `tag`, unless the output is finished."""
        return text if finished else text[:len(text) - partial_tag_overlap(text, tag)]

    def extract_reasoning_streaming(self, current_text: str, finished: bool = False) -> DeltaMessage | None:
        """What is new since the last delta (all of it on the last one, `finished`)."""
        reasoning, content = self._split(current_text, finished)
        new = []
        for i, part in enumerate((reasoning or "", content)):
            sent = self._sent[i]
            grew = len(part) > len(sent) and part.startswith(sent)
            new.append(part[len(sent):] if grew else None)
            if grew:
                self._sent[i] = part
        if new == [None, None]:
            return None
        return DeltaMessage(reasoning=new[0], reasoning_content=new[0], content=new[1])


class DeepSeekR1ReasoningParser(ReasoningParser):
    def _split(self, text: str, finished: bool) -> tuple[str | None, str]:
        if not finished and self.start_token.startswith(text):
            return "", ""  # maybe the opening tag, in pieces
        body = text[len(self.start_token):] if text.startswith(self.start_token) else text
        reasoning, tag, content = body.partition(self.end_token)
        if not tag:
            return self._hold(body, self.end_token, finished), ""
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    def _split(self, text: str, finished: bool) -> tuple[str | None, str]:
        before, tag, rest = text.partition(self.start_token)
        if not tag:
            return None, self._hold(text, self.start_token, finished)
        reasoning, end, after = rest.partition(self.end_token)
        if not end:
            return self._hold(rest, self.end_token, finished), before
        return reasoning, before + after


class ReasoningParserManager:
    reasoning_parsers: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1ReasoningParser,
                                                           "qwen3": Qwen3ReasoningParser}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise KeyError(f"reasoning parser {name!r} is not one of {', '.join(cls.reasoning_parsers)}")
        return cls.reasoning_parsers[name]
