"""SamplingParams with vLLM's `structured_outputs`: a constraint the output must satisfy.

`StructuredOutputsParams` holds exactly one of: `json` (a JSON schema, as a dict or a string),
`regex`, `choice` (a list of strings: the output is one of them), `grammar` (EBNF, as xgrammar
reads it), `json_object` (any JSON object). Which backend compiles it is the engine's choice
(`--structured-outputs-backend`); a constraint it cannot compile is refused when the request
arrives (structured_output/manager.py), before it is queued.

In vLLM: vllm/sampling_params.py (StructuredOutputsParams, SamplingParams.structured_outputs)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from shared import sampling_params
from shared.errors import InvalidRequestError

from .structured_output.backend_types import StructuredOutputOptions


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                      f"json_object; got {', '.join(given) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", "structured_outputs")

    def key(self) -> tuple[StructuredOutputOptions, str]:
        """(constraint type, spec string): what a backend compiles, and the cache key."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order matters: properties come in it
            return StructuredOutputOptions.JSON, spec
        if self.json_object:
            return StructuredOutputOptions.JSON_OBJECT, ""
        if self.regex is not None:
            return StructuredOutputOptions.REGEX, self.regex
        if self.choice is not None:
            return StructuredOutputOptions.CHOICE, json.dumps(self.choice)
        return StructuredOutputOptions.GRAMMAR, self.grammar


@dataclass
class SamplingParams(sampling_params.SamplingParams):
    structured_outputs: StructuredOutputsParams | None = None
    # The prompt tokens' logprobs, each with this many top tokens (prompt_logprobs.py; None: off).
    prompt_logprobs: int | None = None
    # vLLM's request-shaping fields (request_fields.py lists them all): words whose token sequences
    # are never completed, the only ids that may be sampled, the prompt's last N tokens kept (-1:
    # as many as the model's length allows), and whether added tokens are joined with spaces.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    # The bad words as token sequences, set once by the InputProcessor (it has the tokenizer); plain
    # data, so it crosses to an engine-core process with the rest. vLLM: `_bad_words_token_ids`.
    bad_words_token_ids: list[list[int]] | None = None

    def _validate(self) -> None:
        super()._validate()
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= sampling_params.MAX_LOGPROBS):
            whole = " (-1, the whole vocabulary, is more)" if self.prompt_logprobs == -1 else ""
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {sampling_params.MAX_LOGPROBS}]{whole}, got "
                                      f"{self.prompt_logprobs}", "prompt_logprobs")
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            raise InvalidRequestError("bad_words must be a list of strings", "bad_words")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)):
            raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got "
                                      f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if isinstance(self.structured_outputs, dict):  # from a message or a user's dict
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            # The grammar may allow only EOS while min_tokens bans it: no token would be left.
            raise InvalidRequestError("min_tokens cannot be combined with structured_outputs", "min_tokens")

    def verify_vocab(self, vocab_size: int) -> None:
        super().verify_vocab(vocab_size)
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words", [t for word in self.bad_words_token_ids or [] for t in word])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} has token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                                          name)

    def update_from_tokenizer(self, tokenizer) -> None:
        """The bad words as token sequences, each as it would be written alone and after a space
        (the second only where its first token differs: a word the tokenizer splits the same way
        either side of a space is banned once). In vLLM: SamplingParams.update_from_tokenizer."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        if not tokenizer.available:
            raise InvalidRequestError("bad_words need a tokenizer; this model has none", "bad_words")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if alone:
                sequences.append(alone)
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences
