"""StructuredOutputManager: where the engine meets the grammar backends.

Three jobs, placed where vLLM places them:

1. **Refuse early.** `validate(params)` compiles the constraint in the API server, so a malformed
   schema or regex is a 400 before anything is queued (InputProcessor calls it). Compiled grammars
   are cached by the backend, so the engine's own compile of the same constraint is a look-up.
2. **Compile off the step.** The engine submits each structured sequence's compile to a small
   thread pool and holds the sequence back (vLLM's WAITING_FOR_FSM) until its grammar is ready;
   the other requests keep stepping meanwhile.
3. **Mask while the forward runs.** For a step, `grammar_output(...)` names the logits rows that a
   grammar constrains and allocates their bitmask; `fill(...)` computes the rows. The engine calls
   `fill` right after launching the step when the model runs on another thread (the bitmask is
   built while the forward pass runs, and the model runner waits for it just before sampling), and
   before launching otherwise (the model in the engine's thread, or in worker processes that must
   receive it with the step).

With speculative decoding (ngram), a sequence's drafts are first cut to the longest prefix its
grammar accepts (`validate_tokens`); its k + 1 rows then hold the masks after 0..k drafts,
computed by accepting the drafts one by one and rolling them back.

In vLLM: vllm/v1/structured_output/__init__.py (StructuredOutputManager: grammar_init on a thread
pool, grammar_bitmask), vllm/v1/core/sched/scheduler.py (get_grammar_bitmask, WAITING_FOR_FSM),
vllm/v1/core/sched/output.py (GrammarOutput), vllm/v1/worker/gpu_model_runner.py (sample_tokens
applies it)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.errors import InvalidRequestError
from shared.tokenizer import Tokenizer

from ..config import STRUCTURED_OUTPUTS_BACKENDS
from .backend_types import StructuredOutputBackend, StructuredOutputGrammar, StructuredOutputOptions
from .bitmask import FULL_MASK, bitmask_width

COURSE_OPTIONS = (StructuredOutputOptions.REGEX, StructuredOutputOptions.CHOICE)


@dataclass
class _RowPlan:
    """One constrained sequence of the step: its first logits row and the drafts behind it."""
    grammar: StructuredOutputGrammar
    row: int
    drafts: list[int]


@dataclass
class GrammarOutput:
    """A step's constraints: logits row `indices[i]` may only take the tokens set in `bitmask[i]`.
    In-process, `ready` is set once the rows are filled; a worker process gets them filled."""
    indices: list[int]
    bitmask: torch.Tensor  # int32 [len(indices), ceil(vocab / 32)]
    ready: threading.Event | None = field(default=None, repr=False)
    plans: list[_RowPlan] = field(default_factory=list, repr=False)  # what fill() computes from

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.wait()

    def __getstate__(self) -> dict[str, Any]:  # to worker processes: filled already, no Event
        return {"indices": self.indices, "bitmask": self.bitmask, "ready": None, "plans": []}


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {backend!r}")
        self.backend_name = "xgrammar" if backend == "auto" else backend
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.fill_seconds, self.rows_filled = 0.0, 0  # what the masks cost (notebook 15)

    @property
    def backend(self) -> StructuredOutputBackend:
        """Built on first use: xgrammar's tokenizer tables take a moment, and most servers never
        see a structured request."""
        with self._lock:
            if self._backend is None:
                hf = self.tokenizer.hf  # the transformers tokenizer: both backends read its vocabulary
                if hf is None:
                    raise InvalidRequestError("structured outputs need a tokenizer; this model has none",
                                              "structured_outputs")
                if self.backend_name == "xgrammar":
                    from .backend_xgrammar import XgrammarBackend
                    self._backend = XgrammarBackend(hf, self.vocab_size, self.eos_token_ids)
                else:
                    from .backend_course import CourseBackend
                    self._backend = CourseBackend(hf, self.vocab_size, self.eos_token_ids)
            return self._backend

    def compile(self, params) -> StructuredOutputGrammar:
        """One sequence's grammar for its request's constraint; InvalidRequestError if it cannot be."""
        option, spec = params.structured_outputs.key()
        if self.backend_name == "course" and option not in COURSE_OPTIONS:
            raise InvalidRequestError(f"the course backend compiles regex and choice constraints, not "
                                      f"{option.name.lower()}; start the server with --structured-outputs-backend "
                                      f"xgrammar", "structured_outputs")
        try:
            return self.backend.compile_grammar(option, spec)
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def validate(self, params) -> None:
        if params.structured_outputs is not None:
            self.compile(params)

    def compile_async(self, params) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool.submit(self.compile, params)

    # -- per step ---------------------------------------------------------------------------------

    def grammar_output(self, plans: list[tuple[StructuredOutputGrammar, int, list[int]]],
                       fill_later: bool) -> GrammarOutput | None:
        """The step's GrammarOutput for (grammar, first logits row, drafts) per constrained
        sequence, unfilled; None when no sequence of the step is constrained."""
        if not plans:
            return None
        rows = [_RowPlan(g, r, list(d)) for g, r, d in plans]
        indices = [p.row + j for p in rows for j in range(len(p.drafts) + 1)]
        bitmask = torch.full((len(indices), bitmask_width(self.vocab_size)), FULL_MASK, dtype=torch.int32)
        return GrammarOutput(indices, bitmask, threading.Event() if fill_later else None, rows)

    def fill(self, out: GrammarOutput) -> None:
        """Compute the rows (each sequence's mask now, then after each of its drafts)."""
        start = time.perf_counter()
        try:
            i = 0
            for plan in out.plans:
                g = plan.grammar
                g.fill_bitmask(out.bitmask, i)
                accepted = 0
                for j, token in enumerate(plan.drafts, start=1):
                    if g.is_terminated() or not g.accept_tokens("", [token]):
                        break  # drafts were cut to what the grammar accepts: not expected
                    accepted += 1
                    g.fill_bitmask(out.bitmask, i + j)
                if accepted:
                    g.rollback(accepted)
                i += len(plan.drafts) + 1
        finally:
            self.fill_seconds += time.perf_counter() - start
            self.rows_filled += len(out.indices)
            if out.ready is not None:
                out.ready.set()

    def shutdown(self) -> None:
        """Idempotent: an engine's owner and its server may both shut it down."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            backend, self._backend = self._backend, None
        if backend is not None:
            backend.destroy()
