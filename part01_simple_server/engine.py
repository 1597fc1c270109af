"""LLMEngine: turns a prompt into a Request and runs it to the end, one sequence at a time:
one prefill forward over the prompt, then one decode forward per new token."""
from __future__ import annotations

import itertools
from typing import Iterator

from shared.errors import InvalidRequestError
from shared.output_processor import CompletionState
from shared.outputs import RequestOutput
from shared.sampler import Sampler, SamplingRow, make_generators
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

from .config import EngineConfig
from .model_runner import ModelRunner
from .request import Request


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = Tokenizer(self.runner.model_path)
        self.sampler = Sampler()
        self.max_model_len = self.runner.max_model_len
        eos = self.runner.model_config.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)
        self._ids = itertools.count()

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> Request:
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        completions = [CompletionState(i, params, self.tokenizer, ids, self.eos_token_ids, self.max_model_len)
                       for i in range(params.n)]
        return Request(request_id or str(next(self._ids)), text, ids, params, completions,
                       make_generators(params.seed, params.n, self.runner.device))

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.runner.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        params.verify_vocab(vocab)
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {wanted} tokens ({len(ids)} in the prompt, {params.max_tokens or 1} for the "
                f"completion). Please reduce the length of the prompt or max_tokens.", "max_tokens"
                if params.max_tokens and len(ids) < self.max_model_len else "prompt")

    def run(self, request: Request) -> Iterator[RequestOutput]:
        """Generate every sample of the request; yield a delta after each new token."""
        for state in request.completions:
            for _ in self._generate(request, state):
                yield request.output(delta=True)
                if request.aborted:
                    for s in request.completions:
                        s.abort()
                    yield request.output(delta=True)
                    return

    def _generate(self, request: Request, state: CompletionState) -> Iterator[None]:
        params = request.params
        tokens = list(request.prompt_token_ids)
        cache = None
        if self.config.use_kv_cache:
            # Contiguous: reserve the worst case (prompt + max_tokens) before the first token.
            cap = min(self.max_model_len, len(tokens) + (params.max_tokens or self.max_model_len))
            cache = self.runner.new_cache(cap)
        start = 0
        while not state.finished:
            logits = self.runner.forward(tokens[start:], start, cache)
            row = SamplingRow(params, request.generators[state.index], request.prompt_token_ids,
                              state.token_ids, state.banned_token_ids)
            out = self.sampler(logits, [row])
            tok = out.token_ids[0]
            if out.logprobs is None:
                state.append(tok)
            else:
                state.append(tok, out.logprobs[0], out.top_logprobs[0], out.ranks[0])
            tokens.append(tok)
            # With a cache the next step feeds only the new token; without, everything again.
            start = len(tokens) - 1 if cache is not None else 0
            yield

    def generate(self, request: Request) -> RequestOutput:
        for _ in self.run(request):
            pass
        return request.output()
