"""LLMEngine: continuous batching. Requests are added at any time; every `step()` asks the
scheduler for a batch (new prompts and running decodes together), runs it as one flattened
forward pass, samples one token per sequence, and retires finished sequences at once.

Admission no longer reserves a request's worst case: a sequence takes blocks as it grows, and
when the pool runs dry the scheduler preempts (recompute) instead."""
from __future__ import annotations

import itertools

from shared.errors import InvalidRequestError
from shared.output_processor import CompletionState
from shared.outputs import RequestOutput
from shared.sampler import Sampler, SamplingRow, make_generators
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager, cdiv
from .model_runner import ModelRunner, SequenceBatchEntry
from .request import Request
from .scheduler import Scheduler, SchedulerConfig


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = Tokenizer(self.runner.model_path)
        self.sampler = Sampler()
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, self.runner.block_size)
        max_tokens = config.max_num_batched_tokens or self.max_model_len
        if max_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}) must be at least max_model_len "
                             f"({self.max_model_len}): without chunked prefill a whole sequence must "
                             f"fit in one step")
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, max_tokens, config.continuous_batching),
                                   self.kv_cache_manager)
        self.requests: dict[str, Request] = {}
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
        request = Request(request_id or str(next(self._ids)), text, ids, params, completions,
                          make_generators(params.seed, params.n, self.runner.device))
        usable = self.runner.num_blocks - 1  # all but the null block
        if self.worst_case_blocks(request) > usable:
            raise InvalidRequestError(
                f"this request may need {self.worst_case_blocks(request)} KV blocks but the pool has "
                f"{usable}; lower max_tokens or n, or raise --kv-cache-memory-mb", "max_tokens")
        return request

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

    def worst_case_blocks(self, request: Request) -> int:
        """Blocks the request's sequences need to run alone to the end: if that does not fit
        the whole pool, it could be preempted forever, so it is refused at the door."""
        longest = min(self.max_model_len, len(request.prompt_token_ids)
                      + (request.params.max_tokens or self.max_model_len))
        return request.params.n * cdiv(longest, self.runner.block_size)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.sequences:
            self.scheduler.add(seq)

    def abort_request(self, request: Request) -> None:
        for seq in request.sequences:
            seq.state.abort()
            self.scheduler.finish(seq)
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One iteration: schedule, run the flattened batch, sample, retire. Returns the
        requests that got new output (read their deltas) or finished."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        kv = self.kv_cache_manager
        entries = [SequenceBatchEntry(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n],
                                      seq.num_computed_tokens, kv.get_block_ids(seq.seq_id))
                   for seq, n in out.scheduled]
        logits = self.runner.forward(entries)
        seqs = [seq for seq, _ in out.scheduled]
        rows = [SamplingRow(s.request.params, s.generator, s.request.prompt_token_ids,
                            s.state.token_ids, s.state.banned_token_ids) for s in seqs]
        sampled = self.sampler(logits, rows)
        touched: dict[str, Request] = {}
        for i, (seq, n) in enumerate(out.scheduled):
            seq.num_computed_tokens += n
            if sampled.logprobs is None:
                seq.append(sampled.token_ids[i])
            else:
                seq.append(sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i], sampled.ranks[i])
            if seq.finished:
                self.scheduler.finish(seq)
            touched[seq.request.request_id] = seq.request
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
        return list(touched.values())

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run the requests to the end with continuous batching."""
        for r in requests:
            self.add_request(r)
        while self.has_unfinished_requests():
            self.step()
        return [r.output() for r in requests]
