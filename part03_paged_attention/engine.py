"""LLMEngine: runs requests in static batches over a paged KV cache.

A batch starts together and runs until its last sequence finishes: one forward pass per step
over every live sequence (the first step prefills all prompts, later steps decode one token
each). KV blocks are taken one at a time as sequences grow and returned as soon as a sequence
finishes. A batch admits requests only while the pool can hold the worst case of every member
(prompt + max_tokens), so it never runs out mid-batch; part 04 replaces this with admission on
demand and preemption."""
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
from .kv_cache_manager import KVCacheManager, cdiv
from .model_runner import ModelRunner, SequenceBatchEntry
from .request import Request


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = Tokenizer(self.runner.model_path)
        self.sampler = Sampler()
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, self.runner.block_size)
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
        longest = min(self.max_model_len, len(request.prompt_token_ids)
                      + (request.params.max_tokens or self.max_model_len))
        return request.params.n * cdiv(longest, self.runner.block_size)

    def take_batch(self, waiting: list[Request]) -> list[Request]:
        """Pop from the front of `waiting` the requests whose worst cases fit together (FCFS)."""
        batch, reserved, seqs = [], 0, 0
        free = self.kv_cache_manager.num_free_blocks
        while waiting:
            r = waiting[0]
            need = self.worst_case_blocks(r)
            if batch and (reserved + need > free or seqs + r.params.n > self.config.max_num_seqs):
                break
            batch.append(waiting.pop(0))
            reserved, seqs = reserved + need, seqs + r.params.n
        return batch

    def run_batch(self, requests: list[Request]) -> Iterator[None]:
        """Run a static batch to the end, yielding after every step (read deltas then)."""
        seqs = [s for r in requests for s in r.sequences]
        kv = self.kv_cache_manager
        try:
            while True:
                for r in requests:
                    if r.aborted:
                        for s in r.sequences:
                            s.state.abort()
                live = [s for s in seqs if not s.finished]
                for s in seqs:
                    if s.finished:
                        kv.free(s.seq_id)
                if not live:
                    return
                entries = []
                for s in live:
                    if not kv.allocate_slots(s.seq_id, s.num_tokens):
                        raise RuntimeError("KV pool exhausted despite the batch's reservation")
                    entries.append(SequenceBatchEntry(s.token_ids[s.num_computed_tokens:],
                                                      s.num_computed_tokens, kv.get_block_ids(s.seq_id)))
                logits = self.runner.forward(entries)
                rows = [SamplingRow(s.request.params, s.generator, s.request.prompt_token_ids,
                                    s.state.token_ids, s.state.banned_token_ids) for s in live]
                out = self.sampler(logits, rows)
                for i, s in enumerate(live):
                    s.num_computed_tokens = s.num_tokens
                    if out.logprobs is None:
                        s.append(out.token_ids[i])
                    else:
                        s.append(out.token_ids[i], out.logprobs[i], out.top_logprobs[i], out.ranks[i])
                yield
        finally:
            for s in seqs:  # however the batch ends, no block outlives it
                kv.free(s.seq_id)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run the requests to the end in FCFS static batches."""
        waiting = list(requests)
        while waiting:
            for _ in self.run_batch(self.take_batch(waiting)):
                pass
        return [r.output() for r in requests]
