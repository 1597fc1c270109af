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

    def _validate(self) -> None:
        super()._validate()
        if isinstance(self.structured_outputs, dict):  # from a message or a user's dict
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            # The grammar may allow only EOS while min_tokens bans it: no token would be left.
            raise InvalidRequestError("min_tokens cannot be combined with structured_outputs", "min_tokens")
