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
it computes, depend on how many of this step's drafts were accepted.

Tensor parallelism (part 09): the engine talks to its executor, never to the model. With
`tensor_parallel_size > 1` the executor is one worker process per rank, and this process keeps
only the bookkeeping: it learns the model's shape (vocabulary, EOS ids, KV blocks per rank) from
the executor and sends it each step's batch.

Structured outputs (part 15): a constrained sequence waits, out of the scheduler's queues, until its
grammar has compiled on a background thread; each step, the rows of the logits that grammars
constrain get a bitmask, built while the forward runs when the model runs on another thread
(structured_output/manager.py), and each sampled token advances its sequence's grammar. The next
mask depends on that token, so a step is never launched while an earlier one still owes a
constrained sequence its token: with structured requests running, async scheduling keeps one
step in flight."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future, wait

from shared.outputs import RequestOutput
from shared.output_processor import CompletionState
from shared.sampler import SamplerOutput, SamplingRow, make_generators
from shared.tokenizer import Tokenizer

from .config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from .draft_model import DraftSlots
from .executor import Executor, make_executor
from . import prompt_logprobs
from .input_processor import InputProcessor
from .messages import EngineCoreRequest
from .kv_cache_manager import KVCacheManager
from .ngram_proposer import NgramProposer
from .rejection_sampler import RejectionOutput
from .request import Request, Sequence
from .runner_messages import SequenceBatchEntry
from .kv_connector import KVConnectorRole, make_connector, resolve_kv_transfer_config
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .spec_decode_metrics import SpecDecodingStats
from .structured_output.manager import StructuredOutputManager
from .structured_output.reasoning import ReasoningTags


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()  # every invalid setting at once (config.py), before a process starts or a weight loads
        self.config = config
        # The KV connector (part 13), resolved once: the workers' halves get the same settings (engine id).
        kv_transfer = resolve_kv_transfer_config(config)
        if kv_transfer is not None:
            config = dataclasses.replace(config, kv_transfer_config=dataclasses.asdict(kv_transfer),
                                         kv_offloading_size=None)
            self.config = config
        self.executor = ex = make_executor(config)
        self.tokenizer = Tokenizer(ex.model_path)
        self.max_model_len = ex.max_model_len
        self.kv_cache_manager = KVCacheManager(ex.num_blocks, ex.block_size,
                                               config.enable_prefix_caching, config.prefix_caching_hash_seed)
        chunked = config.enable_chunked_prefill
        max_tokens = config.max_num_batched_tokens or (DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked
                                                       else self.max_model_len)
        # validate() held the budget to the flags; the model's context length is known only now. Without
        # chunked prefill a whole prompt must fit in one step, and an unset budget is that length.
        if not chunked and max_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}) must be at least max_model_len "
                             f"({self.max_model_len}): without chunked prefill a whole sequence must "
                             f"fit in one step")
        if not chunked and config.max_num_batched_tokens is None and max_tokens < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}, the model's max_model_len) must be at least "
                             f"max_num_seqs ({config.max_num_seqs}): every running sequence may decode in one step")
        # The KV connector's scheduler half (part 13): the workers hold the other half.
        self.connector = None if kv_transfer is None else make_connector(
            kv_transfer, KVConnectorRole.SCHEDULER, ex.block_size, kv_cache_manager=self.kv_cache_manager,
            worker_info=ex.kv_connector_info)
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, max_tokens, config.continuous_batching, self.max_model_len, chunked,
            config.long_prefill_token_threshold, config.preemption_mode, config.scheduling_policy,
            config.pipeline_parallel_size),
            self.kv_cache_manager, self.connector,
            kv_transfer.kv_load_failure_policy if kv_transfer else "fail")
        # Steps launched and not yet processed: (what was scheduled, the Future of its tokens, whether
        # a grammar constrains one of its sequences).
        self.batch_queue: deque[tuple[SchedulerOutput, object, bool]] = deque()
        # Async scheduling: step N + 1 launched before step N's tokens are read. Pipeline parallelism
        # (pipeline.py): PP steps, each with sequences the others do not hold, one on each stage.
        self.max_steps_in_flight = config.pipeline_parallel_size if config.pipeline_parallel_size > 1 else \
            2 if config.async_scheduling and not config.speculative_method else 1
        self.proposer = None
        if config.speculative_method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                          config.num_speculative_tokens)
        elif config.speculative_method == "draft_model":  # the model drafts inside the step
            self.proposer = DraftSlots(config.num_speculative_tokens)
        self.uses_draft_model = config.speculative_method == "draft_model"
        self.spec_decoding_stats = SpecDecodingStats(config.num_speculative_tokens) if self.proposer else None
        self._last_rows: dict[str, int] = {}  # seq_id -> its row in the newest launched step
        self.requests: dict[str, Request] = {}
        self.processor = InputProcessor(self.tokenizer, ex.model_config, self.max_model_len, ex.num_blocks,
                                        ex.block_size, structured_outputs_backend=config.structured_outputs_backend,
                                        speculative_method=config.speculative_method,
                                        scheduling_policy=config.scheduling_policy)
        self.eos_token_ids = self.processor.eos_token_ids
        self.structured: StructuredOutputManager = self.processor.structured
        self.waiting_for_fsm: list[tuple[Sequence, Future]] = []  # vLLM: RequestStatus.WAITING_FOR_FSM
        # --reasoning-parser: a grammar waits for </think> (None: no parser, or tags that are not tokens)
        self.reasoning_tags = ReasoningTags.of(self.tokenizer) if config.reasoning_parser else None

    def add_request(self, core: EngineCoreRequest) -> Request:
        """Take a validated request (InputProcessor's): build its sequences, detokenizer states and
        seeded generators here, where it runs, and queue it."""
        params = core.sampling_params
        completions = [CompletionState(i, params, self.tokenizer, core.prompt_token_ids, self.eos_token_ids,
                                       self.max_model_len) for i in range(params.n)]
        request = Request(core.request_id, core.prompt, core.prompt_token_ids, params, completions,
                          make_generators(params.seed, params.n, self.executor.device), cache_salt=core.cache_salt,
                          kv_transfer_params=core.kv_transfer_params, priority=core.priority,
                          arrival_time=core.arrival_time)
        self.requests[request.request_id] = request
        for seq in request.sequences:
            if getattr(params, "structured_outputs", None) is not None:  # one grammar per sequence
                if self.reasoning_tags is not None:  # the grammar starts after the reasoning
                    seq.reasoning_ended = self.reasoning_tags.ended_in(core.prompt_token_ids)
                self.waiting_for_fsm.append((seq, self.structured.compile_async(params)))
            else:
                self.scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks (nothing happens if it has finished already)."""
        request = self.requests.pop(request_id, None)
        compiling = {seq.seq_id for seq, _ in self.waiting_for_fsm}
        for seq in request.sequences if request is not None else ():
            seq.state.abort()
            if seq.seq_id in compiling:
                self.waiting_for_fsm = [(s, f) for s, f in self.waiting_for_fsm if s is not seq]
            else:
                self.scheduler.finish(seq)

    @property
    def prefix_cache_stats(self):
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the device and in the host tier; refused (False) while
        requests hold blocks."""
        return (not self.has_unfinished_requests() and self.kv_cache_manager.reset_prefix_cache()
                and (self.connector is None or self.connector.reset_cache()))

    def has_unfinished_requests(self) -> bool:
        """Work left: requests, steps in flight, or host-tier copies not yet heard back."""
        return (self.scheduler.has_unfinished() or bool(self.batch_queue)
                or self._connector_busy() or bool(self.waiting_for_fsm))

    def _connector_busy(self) -> bool:
        """Transfers to start or to hear back from: finished requests whose KV is still being sent,
        or the connector's own (stores in flight)."""
        return self.connector is not None and (bool(self.scheduler.sending) or self.connector.has_pending_work())

    def step(self) -> list[Request]:
        """Launch a step if the queue has room; then, unless that leaves the queue short of
        full, process the oldest step's tokens. Returns the requests that got new output (read
        their deltas) or finished."""
        failed_compiles = self._admit_compiled()
        # A constrained sequence's next mask needs the token its step in flight samples.
        constrained_in_flight = any(c for _, _, c in self.batch_queue)
        if len(self.batch_queue) < self.max_steps_in_flight and not constrained_in_flight:
            if self.proposer is not None:
                self._propose_drafts()
            out = self.scheduler.schedule()
            # A step with no tokens still runs while host-tier copies are pending: it sends the new
            # jobs and hears which ones finished.
            if out.scheduled or self._connector_busy() or self.scheduler.loading:
                self.batch_queue.append(self._launch(out))
                if len(self.batch_queue) < self.max_steps_in_flight and not self.batch_queue[-1][2]:
                    return failed_compiles  # launch the next step before waiting for this one
        if not self.batch_queue:
            if self.waiting_for_fsm and not self.scheduler.has_unfinished():  # only compiles to wait for
                wait([self.waiting_for_fsm[0][1]], timeout=0.01)
            return failed_compiles
        out, future, _ = self.batch_queue.popleft()
        result = future.result()
        failed = []
        if result.kv_connector_output is not None:
            failed = self.scheduler.update_from_kv_connector(result.kv_connector_output)
        if result.prompt_logprobs is not None:  # before the first token's output goes out
            prompt_logprobs.record(result.prompt_logprobs, {s.seq_id: s for s, _ in out.scheduled},
                                   self.tokenizer.decode)
        touched = self._update_from_output(out, result.sampled)
        for seq in failed:  # kv_load_failure_policy "fail": the request ends with an error
            seq.state.abort("error")
            self.scheduler.finish(seq)
            if seq.request not in touched:
                touched.append(seq.request)
        if not out.scheduled:  # a step that only polled transfers: do not spin on the cores
            time.sleep(0.001)
        return touched + [r for r in failed_compiles if r not in touched]

    def _admit_compiled(self) -> list[Request]:
        """Queue the sequences whose grammar has compiled; end those whose compile failed (the
        API server compiled the same constraint already, so this is not expected)."""
        if not self.waiting_for_fsm:
            return []
        still, failed = [], []
        for seq, future in self.waiting_for_fsm:
            if not future.done():
                still.append((seq, future))
            elif future.exception() is not None:
                seq.state.abort("error")
                failed.append(seq.request)
                if seq.request.finished:
                    self.requests.pop(seq.request.request_id, None)
            else:
                seq.grammar = future.result()
                self.scheduler.add(seq)
        self.waiting_for_fsm = still
        return list(dict.fromkeys(failed))

    def _launch(self, out: SchedulerOutput) -> tuple[SchedulerOutput, object, bool]:
        """Send the step to the executor, with the grammars' bitmask for the rows they constrain:
        filled while the forward runs when the model runs on another thread, else before."""
        plans, row, constrained = [], 0, False
        for (seq, _), samples, drafts in zip(out.scheduled, out.samples, out.spec_token_ids):
            if samples:
                if seq.grammar is not None:
                    # a sequence still reasoning gets no mask, but its token decides the next mask
                    constrained = True
                    if seq.reasoning_ended:
                        plans.append((seq.grammar, row, drafts))
                row += len(drafts) + 1
        fill_later = self.executor.runs_elsewhere
        grammar = self.structured.grammar_output(plans, fill_later)
        if grammar is not None and not fill_later:
            self.structured.fill(grammar)
        future = self.executor.execute_batch(self._batch_entries(out), out.finished_seq_ids,
                                             out.kv_connector_metadata, grammar, [s.seq_id for s in out.preempted])
        if grammar is not None and fill_later:
            self.structured.fill(grammar)
        return out, future, constrained

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
            if seq.grammar is not None and seq.spec_token_ids:  # only drafts the grammar accepts
                # (none while reasoning: a draft past </think> would skip the grammar's first mask)
                seq.spec_token_ids = seq.grammar.validate_tokens(seq.spec_token_ids) if seq.reasoning_ended else []

    def _batch_entries(self, out: SchedulerOutput) -> list[SequenceBatchEntry]:
        kv, entries, rows = self.kv_cache_manager, [], {}
        for (seq, n), samples, drafts in zip(out.scheduled, out.samples, out.spec_token_ids):
            start = seq.num_computed_tokens - n  # the scheduler has advanced it already
            n -= len(drafts)
            known = seq.token_ids[start:start + n]
            # The one unknown input a step can have: the token the previous step samples for it.
            prev_row = self._last_rows[seq.seq_id] if len(known) < n else None
            row = self._sampling_row(seq, prev_row is not None) if samples else None
            if samples:  # rows of the sampled tensor: only the sequences that sample
                rows[seq.seq_id] = len(rows)
            entry = SequenceBatchEntry(known, start, kv.get_block_ids(seq.seq_id), row, prev_row, seq.seq_id, drafts)
            if samples:
                entry.min_tokens_left = seq.request.params.min_tokens - len(seq.state.token_ids)
            entry.prompt_logprobs = prompt_logprobs.spec_for(seq, start, n)  # part 15: if its request asks
            if self.uses_draft_model:  # the known tokens its KV cache lacks (see _advance_draft)
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
        words = getattr(params, "bad_words_token_ids", None)
        if words and not history:  # a multi-token bad word compares the last tokens only
            history = list(state.token_ids[max(0, len(state.token_ids) - max(len(w) for w in words) + 1):])
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
                if seq.grammar is not None and not seq.finished:
                    if seq.reasoning_ended:
                        self._advance_grammar(seq, token)
                    else:  # the reasoning's tokens are not the grammar's; </think> ends it
                        seq.reasoning_ended = token == self.reasoning_tags.end_id
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
    def _advance_grammar(seq: Sequence, token: int) -> None:
        """The mask allowed only tokens the grammar accepts, so a rejection is a bug; a grammar
        that has accepted its end (EOS, even with ignore_eos) ends the sequence."""
        if not seq.grammar.accept_tokens(seq.seq_id, [token]):
            seq.state.abort("error")
        elif seq.grammar.is_terminated():
            seq.state.abort("stop")

    @staticmethod
    def _one(host: SamplerOutput, i: int) -> SamplerOutput:
        if host.logprobs is None:
            return SamplerOutput([host.token_ids[i]])
        return SamplerOutput([host.token_ids[i]], [host.logprobs[i]], [host.ranks[i]], [host.top_logprobs[i]])

    def _advance_draft(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """How far the draft model's KV cache is valid after this step. Its passes computed the
        known tokens and drafts 0..k-2 as inputs, so it holds the accepted run except, when all k
        were accepted, the last draft: the next catch-up pass computes that one."""
        if not self.uses_draft_model:
            return
        known_end = seq.num_computed_tokens - num_drafts  # before the rejected drafts roll back
        seq.num_draft_computed = known_end + (min(num_accepted, num_drafts - 1) if num_drafts else 0)

    def generate(self, core_requests: list[EngineCoreRequest]) -> list[RequestOutput]:
        """Run the requests to the end. With async scheduling, this thread becomes the worker
        (it runs the model) and the engine core steps on a second thread."""
        requests = [self.add_request(r) for r in core_requests]
        if self.max_steps_in_flight == 1:
            self._run_to_end()
        else:
            run_overlapped(self.executor, self._run_to_end)
        return [r.output() for r in requests]

    def shutdown(self) -> None:
        """End the executor's worker processes, if any."""
        self.structured.shutdown()
        self.executor.shutdown()

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
