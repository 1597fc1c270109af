"""Each sequence's sampling parameters kept across steps, and a step's as tensors.

Why. The shared sampler (parts 01-14) reads a list of per-row objects: every step it builds
tensors from Python lists (temperatures, top-k, top-p, token histories) and indexes device tensors
with lists. On a GPU each of those is a copy from pageable memory, which makes the host wait for
the step's forward: with sampling on, async scheduling (part 05) then overlaps nothing.

How. A sequence's parameters are written once, into numpy arrays at its row of the persistent batch
(the row `input_batch.BlockTable` gives it), when it first samples; a step takes its sampling rows'
columns with one numpy gather, packed into one float buffer (`FLOATS`, top-k and the greedy flag
included), copied to the device once. What varies per step and per row (tokens banned until
min_tokens and single-token bad words, allowed_token_ids, logit_bias, the histories penalties count,
the last tokens multi-token bad words compare) goes in padded index arrays built with numpy, each one
copy. Only what the host decides on (is every row greedy? does any row use top-p?) stays
on the host, read from the same arrays. The one token the host cannot know, a history's newest
token still in flight under async scheduling, is patched in on the device from the previous step's
sampled ids (`prev_fix`).

In vLLM v0.33.0: vllm/v1/worker/gpu_input_batch.py (InputBatch's per-request sampling arrays,
written in add_request) and vllm/v1/sample/metadata.py (SamplingMetadata)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

# The packed float buffer's rows. top_k (< 2**24, exact in float32) and greedy (0 or 1) ride along,
# so a step's parameters are one copy.
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
          "top_k", "greedy")
ROW = {name: i for i, name in enumerate(FLOATS)}


@dataclass
class SamplingMetadata:
    """One step's sampling, for its S sampling rows in batch order. Tensors are on the host until
    `to_device`; the plain fields are what the host decides on."""
    params: torch.Tensor  # [len(FLOATS), S] float32
    all_greedy: bool
    all_random: bool
    top_k_p: bool  # some non-greedy row uses top-k, top-p or min-p
    max_top_k: int  # every non-greedy row has a top-k: the largest (0: some row has none)
    generators: list[tuple[int, torch.Generator]]  # (row, its generator): seeded non-greedy rows
    num_top: list[int] | None  # logprobs each row asked for (None: no row asked)
    ban_rows: torch.Tensor | None = None  # [Sb] rows with tokens banned (min_tokens not reached)
    ban_ids: torch.Tensor | None = None  # [Sb, w]: their ids (a short list repeats its first id)
    bias_rows: torch.Tensor | None = None  # [Sl] rows with a logit_bias
    bias_ids: torch.Tensor | None = None  # [Sl, w] (padded as ban_ids)
    bias_vals: torch.Tensor | None = None  # [Sl, w]
    penalties: bool = False  # some row has a penalty
    pen_rows: torch.Tensor | None = None  # [P] the rows with penalties (None: every row)
    repetition: bool = False  # some penalized row has a repetition penalty
    frequency_presence: bool = False  # ...a frequency or presence penalty
    seen_ids: torch.Tensor | None = None  # [P, W]: prompt and output ids (repetition), padded with the first
    output_ids: torch.Tensor | None = None  # [P, Lo]: output ids (frequency, presence), padded with the vocab size
    prev_fix: torch.Tensor | None = None  # [4, F]: pen row, its columns in output_ids and seen_ids, previous row
    allowed_rows: torch.Tensor | None = None  # [Sa] rows with allowed_token_ids: every other id is banned
    allowed_ids: torch.Tensor | None = None  # [Sa, w] (padded as ban_ids)
    # Bad words of two or more tokens (one-token words are in ban_ids): one entry per (row, word). The
    # word's last token is banned when the row's last P output tokens equal its prefix, right-aligned
    # (-1 in the prefix: no token to compare; -2 in the tail: the output is shorter than that).
    bad_rows: torch.Tensor | None = None  # [Nb]
    bad_prefix: torch.Tensor | None = None  # [Nb, P]
    bad_tail: torch.Tensor | None = None  # [Nb, P]
    bad_last: torch.Tensor | None = None  # [Nb]
    bad_prev: torch.Tensor | None = None  # [2, Nf]: entries whose newest token is in flight, their previous row

    def row(self, name: str) -> torch.Tensor:
        return self.params[ROW[name]]

    def to_device(self, device: torch.device) -> SamplingMetadata:
        """Each tensor copied once, from pinned memory without waiting (a CPU's are already there)."""
        if device.type != "cpu":
            for f in fields(self):
                value = getattr(self, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(self, f.name, to_device(value, device))
        return self


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: copied from pinned memory (torch's
    caching host allocator keeps the pinned block until the copy is done). From pageable memory
    the copy would wait for the device first."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class SamplingState:
    """Sampling parameters by persistent row (see the module's docstring)."""

    def __init__(self, num_rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.params = np.zeros((len(FLOATS), num_rows), dtype=np.float32)
        self.penalized = np.zeros(num_rows, dtype=bool)
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.written = np.zeros(num_rows, dtype=bool)
        self.generators: dict[int, torch.Generator] = {}

    def grow(self, num_rows: int) -> None:
        extra = num_rows - self.written.shape[0]
        self.params = np.concatenate([self.params, np.zeros((len(FLOATS), extra), dtype=np.float32)], axis=1)
        self.penalized = np.concatenate([self.penalized, np.zeros(extra, dtype=bool)])
        self.num_logprobs = np.concatenate([self.num_logprobs, np.full(extra, -1, dtype=np.int64)])
        self.written = np.concatenate([self.written, np.zeros(extra, dtype=bool)])

    def write(self, row: int, sampling) -> None:
        """A sequence's parameters into its row, on its first sampling step (`sampling`: a SamplingRow)."""
        p = sampling.params
        values = dict(temperature=1.0 if p.greedy else p.temperature,  # greedy rows never divide
                      top_p=p.top_p, min_p=p.min_p, repetition_penalty=p.repetition_penalty,
                      frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                      top_k=min(p.top_k, self.vocab_size), greedy=float(p.greedy))
        self.params[:, row] = [values[name] for name in FLOATS]
        self.penalized[row] = p.has_penalties
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        if sampling.generator is not None and not p.greedy:
            self.generators[row] = sampling.generator
        self.written[row] = True

    def remove(self, row: int) -> None:
        self.written[row] = False
        self.generators.pop(row, None)

    def metadata(self, rows: np.ndarray, entries: list) -> SamplingMetadata:
        """The step's SamplingMetadata for its sampling `entries` (SequenceBatchEntry), at `rows`."""
        params = self.params[:, rows]
        greedy = params[ROW["greedy"]] > 0.5
        random = ~greedy
        top_k = params[ROW["top_k"]][random]
        # numpy's booleans: a host decision on host arrays (no tensor is read)
        top_k_p = (top_k > 0).any() or (params[ROW["top_p"]][random] < 1.0).any() or (params[ROW["min_p"]][random] > 0.0).any()
        logprobs = self.num_logprobs[rows]
        meta = SamplingMetadata(
            torch.from_numpy(params), all_greedy=greedy.all(), all_random=not greedy.any(),
            top_k_p=top_k_p, max_top_k=int(top_k.max()) if len(top_k) and (top_k > 0).all() else 0,
            generators=[(i, self.generators[int(r)]) for i, r in enumerate(rows) if int(r) in self.generators]
            if self.generators else [],
            num_top=[max(int(n), 0) for n in logprobs] if (logprobs >= 0).any() else None)
        banned = [(i, (*e.sampling.banned_token_ids, *words)) for i, e in enumerate(entries)
                  if (words := [w[0] for w in _bad_words(e) if len(w) == 1]) or e.sampling.banned_token_ids]
        if banned:
            meta.ban_rows, meta.ban_ids = _padded(banned, np.int64)
        bias = [(i, list(e.sampling.params.logit_bias)) for i, e in enumerate(entries) if e.sampling.params.logit_bias]
        if bias:
            meta.bias_rows, meta.bias_ids = _padded(bias, np.int64)
            meta.bias_vals = _padded([(i, list(entries[i].sampling.params.logit_bias.values())) for i, _ in bias],
                                     np.float32)[1]
        allowed = [(i, list(ids)) for i, e in enumerate(entries)
                   if (ids := getattr(e.sampling.params, "allowed_token_ids", None))]
        if allowed:
            meta.allowed_rows, meta.allowed_ids = _padded(allowed, np.int64)
        if any(len(w) > 1 for e in entries for w in _bad_words(e)):
            _bad_word_prefixes(meta, entries)
        pen = np.flatnonzero(self.penalized[rows])
        if len(pen):
            self._penalties(meta, pen, [entries[i] for i in pen], params)
        return meta

    def _penalties(self, meta: SamplingMetadata, pen: np.ndarray, entries: list, params: np.ndarray) -> None:
        """The penalized rows' histories, padded with the vocabulary size (a column that is dropped);
        a token still in flight gets a padding column, filled on the device from `prev_fix`."""
        meta.penalties = True
        meta.pen_rows = None if len(pen) == len(params[0]) else torch.from_numpy(pen)
        meta.repetition = (params[ROW["repetition_penalty"]][pen] != 1.0).any()
        meta.frequency_presence = (params[ROW["frequency_penalty"]][pen] != 0.0).any() or \
            (params[ROW["presence_penalty"]][pen] != 0.0).any()
        outputs = [e.sampling.output_token_ids for e in entries]
        prompts = [e.sampling.prompt_token_ids for e in entries]
        fix = [(j, len(out), len(p) + len(out), e.prev_row)
               for j, (p, out, e) in enumerate(zip(prompts, outputs, entries)) if e.prev_row is not None]
        extra = 1 if fix else 0  # a column for the token in flight
        if meta.frequency_presence:  # counted over the vocabulary: padded with an id past it
            meta.output_ids = _fill(outputs, max(len(out) for out in outputs) + extra, self.vocab_size)
        if meta.repetition:  # read and written where they are: padded with a row's own first id
            seen = [p + out for p, out in zip(prompts, outputs)]
            meta.seen_ids = _fill(seen, max(len(s) for s in seen) + extra, None)
        if fix:
            meta.prev_fix = torch.from_numpy(np.array(fix, dtype=np.int64).T.copy())


def _bad_words(entry) -> list[list[int]]:
    return getattr(entry.sampling.params, "bad_words_token_ids", None) or []


def _bad_word_prefixes(meta: SamplingMetadata, entries: list) -> None:
    """Multi-token bad words against each row's last output tokens; a token in flight gets the last
    column, filled on the device from the previous step's sampled ids (`bad_prev`)."""
    items = [(i, w, e) for i, e in enumerate(entries) for w in _bad_words(e) if len(w) > 1]
    width = max(len(w) for _, w, _ in items) - 1
    prefix = np.full((len(items), width), -1, dtype=np.int64)
    tail = np.full((len(items), width), -2, dtype=np.int64)
    inflight = []
    for j, (i, word, e) in enumerate(items):
        prefix[j, width - len(word) + 1:] = word[:-1]
        out = list(e.sampling.output_token_ids)
        if e.prev_row is not None:
            out.append(-2)  # placeholder: the device writes the token in flight here
            inflight.append((j, e.prev_row))
        out = out[-width:]
        if out:
            tail[j, width - len(out):] = out
    meta.bad_rows = torch.from_numpy(np.array([i for i, _, _ in items], dtype=np.int64))
    meta.bad_prefix, meta.bad_tail = torch.from_numpy(prefix), torch.from_numpy(tail)
    meta.bad_last = torch.from_numpy(np.array([w[-1] for _, w, _ in items], dtype=np.int64))
    if inflight:
        meta.bad_prev = torch.from_numpy(np.array(inflight, dtype=np.int64).T.copy())


def _fill(lists: list[list[int]], width: int, pad: int | None) -> torch.Tensor:
    """[len(lists), width] ids, each row padded with `pad` (None: the row's first id)."""
    out = np.full((len(lists), max(width, 1)), 0 if pad is None else pad, dtype=np.int64)
    for i, ids in enumerate(lists):
        out[i, :len(ids)] = ids
        if pad is None:
            out[i, len(ids):] = ids[0]
    return torch.from_numpy(out)


def _padded(items: list[tuple[int, list]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, [n, w] values) from (row, values) pairs; a short list repeats its first value, so a
    write through the padding writes what the first one did."""
    width = max(len(v) for _, v in items)
    values = np.array([list(v) + [v[0]] * (width - len(v)) for _, v in items], dtype=dtype)
    return torch.from_numpy(np.array([i for i, _ in items], dtype=np.int64)), torch.from_numpy(values)
