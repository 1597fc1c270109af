"""LLMEngine: continuous batching with async scheduling, chunked prefill, prefix caching and
speculative decoding. Requests are added
at any time; every `step()` asks the scheduler for a batch within the step's token budget (long
prompts in chunks), hands it to the executor, and processes the sampled tokens of a finished
step: appends them, detokenizes, checks stops, retires finished sequences.

Async scheduling keeps up to two steps in the batch queue: step N+1 is scheduled, prepared and
launched *before* step N's tokens are read back, so the model never waits for the host's
bookkeeping. The price: when step N finishes a sequence (EOS, a stop string), step N+1 has
already computed one more token for it; that token is thrown away, never emitted or counted.
With async scheduling off, the queue holds one step and the engine behaves as part 04's.

Speculative decoding (part 08): before each schedule the proposer drafts up to k tokens for every
decoding sequence; the step verifies them and returns 1..k+1 tokens per sequence, appended one by
one with the usual stop checks, so a run stops exactly where token-by-token decoding would. With
speculation the engine keeps one step in flight: the next step's drafts, and even how many tokens
it computes, depend on how many of this step's drafts were accepted."""
from __future__ import annotations

import itertools
import threading
from collections import deque

from shared.errors import InvalidRequestError
from shared.output_processor import CompletionState
from shared.outputs import RequestOutput
from shared.sampler import SamplerOutput, SamplingRow, make_generators
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

from .config import EngineConfig
from .executor import Executor
from .kv_cache_manager import KVCacheManager, cdiv
from .model_runner import ModelRunner, SequenceBatchEntry
from .ngram_proposer import NgramProposer
from .rejection_sampler import RejectionOutput
from .request import Request, Sequence
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .spec_decode_metrics import SpecDecodingStats

SPECULATIVE_METHODS = ("ngram", "draft_model")

# The default token budget per step with chunked prefill. Smaller chunks bound the pause a long
# prompt imposes on running streams; larger ones pay the per-step cost (a full read of the
# weights) fewer times. On the course's 2-core CPU a step costs about 54 ms + 2.4 ms per token
# (notebook 06): 1024 tokens keeps a 3k-token prompt's stall under half of an unchunked one while
# costing a burst of 32 prompts about four extra steps.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {config.speculative_method!r}")
        if config.speculative_method and config.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if config.speculative_model and config.speculative_method != "draft_model":
            raise ValueError("--speculative-model needs --speculative-method draft_model")
        self.runner = ModelRunner(config)
        self.executor = Executor(self.runner)
        self.tokenizer = Tokenizer(self.runner.model_path)
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, self.runner.block_size,
                                               config.enable_prefix_caching, config.prefix_caching_hash_seed)
        chunked = config.enable_chunked_prefill
        max_tokens = config.max_num_batched_tokens or (DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked
                                                       else self.max_model_len)
        if not chunked and max_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}) must be at least max_model_len "
                             f"({self.max_model_len}): without chunked prefill a whole sequence must "
                             f"fit in one step")
        if max_tokens < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}) must be at least max_num_seqs "
                             f"({config.max_num_seqs}): every running sequence may decode in one step")
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, max_tokens, config.continuous_batching, self.max_model_len, chunked,
            config.long_prefill_token_threshold), self.kv_cache_manager)
        # Steps launched and not yet processed: (what was scheduled, the Future of its tokens).
        self.batch_queue: deque[tuple[SchedulerOutput, object]] = deque()
        self.max_steps_in_flight = 2 if config.async_scheduling and not config.speculative_method else 1
        self.proposer = None
        if config.speculative_method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                          config.num_speculative_tokens)
        elif config.speculative_method == "draft_model":
            self.proposer = self.runner.drafter
        self.spec_decoding_stats = SpecDecodingStats(config.num_speculative_tokens) if self.proposer else None
        self._last_rows: dict[str, int] = {}  # seq_id -> its row in the newest launched step
        self.requests: dict[str, Request] = {}
        eos = self.runner.model_config.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)
        self._ids = itertools.count()

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str | None = None) -> Request:
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        completions = [CompletionState(i, params, self.tokenizer, ids, self.eos_token_ids, self.max_model_len)
                       for i in range(params.n)]
        request = Request(request_id or str(next(self._ids)), text, ids, params, completions,
                          make_generators(params.seed, params.n, self.runner.device), cache_salt=cache_salt)
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

    @property
    def prefix_cache_stats(self):
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return not self.has_unfinished_requests() and self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batch_queue)

    def step(self) -> list[Request]:
        """Launch a step if the queue has room; then, unless that leaves the queue short of
        full, process the oldest step's tokens. Returns the requests that got new output (read
        their deltas) or finished."""
        if len(self.batch_queue) < self.max_steps_in_flight:
            if self.proposer is not None:
                self._propose_drafts()
            out = self.scheduler.schedule()
            if out.scheduled:
                inp = self.runner.prepare_inputs(self._batch_entries(out))
                self.batch_queue.append((out, self.executor.execute_model(inp)))
                if len(self.batch_queue) < self.max_steps_in_flight:
                    return []  # launch the next step before waiting for this one
        if not self.batch_queue:
            return []
        out, future = self.batch_queue.popleft()
        return self._update_from_output(out, future.result())

    def _propose_drafts(self) -> None:
        """Drafts for every decoding sequence, at most what it may still generate minus the one
        token the step adds anyway. Prompts get none: their last chunk samples as usual."""
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if self.scheduler.is_prefilling(seq) or seq.num_output_placeholders:
                continue
            # Verifying d drafts may append d + 1 tokens: within the model's length and max_tokens.
            room = self.max_model_len - seq.num_tokens - 1
            max_tokens = seq.request.params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - seq.num_output_tokens - 1)
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room) if room > 0 else []

    def _batch_entries(self, out: SchedulerOutput) -> list[SequenceBatchEntry]:
        kv, entries, rows = self.kv_cache_manager, [], {}
        drafter = self.runner.drafter
        for (seq, n), samples, drafts in zip(out.scheduled, out.samples, out.spec_token_ids):
            start = seq.num_computed_tokens - n  # the scheduler has advanced it already
            n -= len(drafts)
            known = seq.token_ids[start:start + n]
            # The one unknown input a step can have: the token the previous step samples for it.
            prev_row = self._last_rows[seq.seq_id] if len(known) < n else None
            row = self._sampling_row(seq, prev_row is not None) if samples else None
            if samples:  # rows of the sampled tensor: only the sequences that sample
                rows[seq.seq_id] = len(rows)
            entry = SequenceBatchEntry(known, start, kv.get_block_ids(seq.seq_id), row, prev_row, drafts)
            if samples:
                entry.min_tokens_left = seq.request.params.min_tokens - len(seq.state.token_ids)
            if drafter is not None:  # the known tokens its KV cache lacks (see _advance_draft)
                frontier = start if seq.num_draft_computed is None else seq.num_draft_computed
                entry.draft_input_ids = seq.token_ids[frontier:start + n]
            entries.append(entry)
        self._last_rows = rows
        return entries

    @staticmethod
    def _sampling_row(seq: Sequence, token_in_flight: bool) -> SamplingRow:
        """A snapshot: the executor may sample while this thread appends the previous tokens."""
        state, params = seq.state, seq.request.params
        produced = len(state.token_ids) + token_in_flight  # before the token this step samples
        banned = () if produced >= params.min_tokens else (*state.eos_token_ids, *params.stop_token_ids)
        history = list(state.token_ids) if params.has_penalties else []
        return SamplingRow(params, seq.generator, seq.request.prompt_token_ids, history, banned)

    def _update_from_output(self, out: SchedulerOutput, sampled) -> list[Request]:
        touched: dict[str, Request] = {}
        if isinstance(sampled, RejectionOutput):
            outputs, accepted = sampled.outputs, sampled.num_accepted
        else:  # one token per sequence
            host = sampled.to_output()
            outputs = [self._one(host, i) for i in range(len(host.token_ids))]
            accepted = [0] * len(outputs)
        samples_iter = iter(zip(outputs, accepted))
        for (seq, _), samples, drafts in zip(out.scheduled, out.samples, out.spec_token_ids):
            if not samples:  # a partial prefill has nothing to add
                self._advance_draft(seq, 0, 0)
                continue
            output, num_accepted = next(samples_iter)
            self._advance_draft(seq, len(drafts), num_accepted)
            if self.spec_decoding_stats is not None:
                self.spec_decoding_stats.observe(len(drafts), num_accepted)
            if not self.scheduler.update_from_output(seq, len(drafts) - num_accepted):
                continue  # finished while this step was in flight: its token is discarded
            for j, token in enumerate(output.token_ids):  # stop checks token by token
                if output.logprobs is None:
                    seq.append(token)
                else:
                    seq.append(token, output.logprobs[j], output.top_logprobs[j], output.ranks[j])
                if seq.finished:
                    break  # nothing past the stop is kept
            if seq.finished:
                self.scheduler.finish(seq)
            touched[seq.request.request_id] = seq.request
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
        return list(touched.values())

    @staticmethod
    def _one(host: SamplerOutput, i: int) -> SamplerOutput:
        if host.logprobs is None:
            return SamplerOutput([host.token_ids[i]])
        return SamplerOutput([host.token_ids[i]], [host.logprobs[i]], [host.ranks[i]], [host.top_logprobs[i]])

    def _advance_draft(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """How far the draft model's KV cache is valid after this step. Its passes computed the
        known tokens and drafts 0..k-2 as inputs, so it holds the accepted run except, when all k
        were accepted, the last draft: the next catch-up pass computes that one."""
        if self.runner.drafter is None:
            return
        known_end = seq.num_computed_tokens - num_drafts  # before the rejected drafts roll back
        seq.num_draft_computed = known_end + (min(num_accepted, num_drafts - 1) if num_drafts else 0)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run the requests to the end. With async scheduling, this thread becomes the worker
        (it runs the model) and the engine core steps on a second thread."""
        for r in requests:
            self.add_request(r)
        if self.max_steps_in_flight == 1:
            self._run_to_end()
        else:
            run_overlapped(self.executor, self._run_to_end)
        return [r.output() for r in requests]

    def _run_to_end(self) -> None:
        while self.has_unfinished_requests():
            self.step()


def run_overlapped(executor: Executor, engine_loop) -> None:
    """Run `engine_loop` on an engine-core thread while this thread serves the executor's steps;
    return when the loop does, re-raising its error."""
    errors: list[BaseException] = []

    def core() -> None:
        try:
            engine_loop()
        except BaseException as e:
            errors.append(e)
        finally:
            executor.stop()

    executor.start_serving()  # before the core thread's first step
    thread = threading.Thread(target=core, name="engine-core", daemon=True)
    thread.start()
    executor.run_worker_loop()
    thread.join()
    if errors:
        raise errors[0]
