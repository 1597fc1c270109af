"""CompletionState: one generated sequence seen from the outside. It appends sampled tokens,
detokenizes them, decides when the sequence is finished (EOS, stop token, stop string,
max_tokens, model length), keeps logprobs, and hands out text deltas for streaming."""
from __future__ import annotations

from .detokenizer import IncrementalDetokenizer, find_stop_string
from .errors import InvalidRequestError
from .outputs import CompletionOutput, Logprob
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


class CompletionState:
    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer,
                 prompt_token_ids: list[int], eos_token_ids: tuple[int, ...], max_model_len: int):
        if params.stop and not tokenizer.available:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                                      "stop")
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_token_ids)
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.max_model_len = max_model_len
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent_chars = 0
        self._sent_tokens = 0
        # While streaming, hold back text that could still turn out to be part of a stop string.
        hide = params.stop and not params.include_stop_str_in_output
        self._holdback = max(map(len, params.stop)) - 1 if hide else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick yet: EOS and stop tokens before min_tokens."""
        if len(self.token_ids) >= self.params.min_tokens:
            return ()
        return tuple(self.eos_token_ids) + tuple(self.params.stop_token_ids)

    def append(self, token_id: int, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None, rank: int | None = None) -> bool:
        """Add a sampled token; returns True when the sequence has just finished."""
        assert not self.finished, "append() after the sequence finished"
        p = self.params
        self.token_ids.append(token_id)
        n = len(self.token_ids)
        if self.logprobs is not None and logprob is not None:
            self._record_logprobs(token_id, logprob, rank or 1, top or [])
        stop_token = n > p.min_tokens and (token_id in self.eos_token_ids or token_id in p.stop_token_ids)
        if stop_token:
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in p.stop_token_ids else None
            if p.include_stop_str_in_output and token_id in p.stop_token_ids:
                self.text += self.detokenizer.step(token_id)
        else:
            delta = self.detokenizer.step(token_id)
            self.text += delta
            if delta and p.stop and n > p.min_tokens:
                hit = find_stop_string(self.text, len(delta), p.stop)
                if hit:
                    s, idx = hit
                    self.text = self.text[: idx + len(s)] if p.include_stop_str_in_output else self.text[:idx]
                    self.finish_reason, self.stop_reason = "stop", s
        if not self.finished and (
                (p.max_tokens is not None and n >= p.max_tokens)
                or self.prompt_len + n >= self.max_model_len):
            self.finish_reason = "length"
        return self.finished

    def abort(self, reason: str = "abort") -> None:
        """End it early: aborted by its client, or (reason "error", part 13) failed by the engine."""
        if not self.finished:
            self.finish_reason = reason

    def _record_logprobs(self, token_id: int, logprob: float, rank: int,
                         top: list[tuple[int, float]]) -> None:
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(logprob, rank, decode([token_id], skip_special_tokens=False))}
        for r, (tid, lp) in enumerate(top, start=1):
            entry.setdefault(tid, Logprob(lp, r, decode([tid], skip_special_tokens=False)))
        self.logprobs.append(entry)
        self.cumulative_logprob += logprob

    def output(self) -> CompletionOutput:
        """The whole sequence so far."""
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)

    def delta(self) -> CompletionOutput:
        """What is new since the last delta: text safe to show, and the new tokens."""
        end = len(self.text) if self.finished else max(self._sent_chars, len(self.text) - self._holdback)
        text, self._sent_chars = self.text[self._sent_chars:end], end
        ids, start = self.token_ids[self._sent_tokens:], self._sent_tokens
        self._sent_tokens = len(self.token_ids)
        lps = self.logprobs[start:] if self.logprobs is not None else None
        return CompletionOutput(self.index, text, ids, None, lps, self.finish_reason, self.stop_reason)
