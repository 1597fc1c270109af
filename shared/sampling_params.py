"""SamplingParams with vLLM's fields, defaults and validation."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per generated token (0: the sampled one only)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # added to a token's logit before sampling (OpenAI)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature",
              f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0.0, "repetition_penalty",
              f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              f"min_tokens must be non-negative, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
              f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check(self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer")
        if self.logit_bias:
            check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias),
                  "logit_bias", "logit_bias keys must be token ids (non-negative integers)")
            check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias",
                  "logit_bias values must be in [-100, 100]")

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary (engines call this:
        the parameters alone do not know the model)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} has token id {bad[0]}, outside the vocabulary "
                                          f"[0, {vocab_size})", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
