"""A step's inputs from state kept across steps: persistent buffers filled with numpy.

Why. The simple runner of parts 04-14 builds every step from scratch: Python lists per sequence
(token ids, positions, each token's slot, each sequence's padded block table), then a fresh tensor
per list, copied to the device from pageable memory. At a few hundred sequences a step that is
milliseconds of host work, every step, for a step whose kernels on a GPU take well under one; and a
copy from pageable memory makes the host wait for the device.

How. Everything a step's inputs need lives in arrays allocated once, at the engine's limits
(`max_num_batched_tokens` tokens, `max_num_seqs` sequences): host arrays (pinned on a GPU, so their
copies are asynchronous) and, on a GPU, device arrays at fixed addresses. A step fills the host
arrays with numpy, whole arrays at a time, and the model runner copies each once (`to_device`),
on the thread that runs the step, so a copy never overtakes the step before it. Host arrays come in
sets used in turn (`NUM_SETS`): while step N runs, step N+1 fills another set, and a set is
refilled only once the copies that read it last are done (an event per set: a copy from pinned
memory runs while the host goes on). On a CPU the host arrays are the step's tensors.

The device arrays are also the CUDA graphs' static inputs (graph_runner.py): there is one device set,
at fixed addresses, and a step's tensors are views of it, so a replay copies nothing. With graphs,
each step also writes the padding past its end (KV slots -1, sequences of length 0 with no queries)
up to the largest captured size, so a replay padded up to any captured size reads a valid batch.
The block table a kernel reads is a view of the persistent `[max_num_seqs, max_blocks_per_seq]`
buffer: its row stride never changes, so Triton, which specializes a kernel on its integer
arguments, never builds another variant in the middle of a run.

Each running sequence keeps a row of a persistent block table, `[max_num_seqs, max_blocks_per_seq]`
(`BlockTable`): a row is written only where it changes (the blocks a step adds), rewritten when the
sequence comes back from preemption with new blocks, and freed when it finishes. A token's slot is
then one numpy expression over the whole step: `table[row, pos // block_size] * block_size + pos %
block_size`.

In vLLM v0.33.0: vllm/v1/worker/gpu_input_batch.py (InputBatch, CachedRequestState),
vllm/v1/worker/block_table.py (BlockTable: append_row, add_row, compute_slot_mapping),
vllm/v1/utils.py (CpuGpuBuffer: the same host and device pair) and vllm/v1/worker/gpu_model_runner.py (_prepare_inputs: the
np.repeat / cumsum "arange trick"; prepare_inputs_event, waited on before the pinned arrays are refilled)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention_metadata import PAD_SLOT_ID, PagedAttentionMetadata
from .sampling_metadata import SamplingMetadata, SamplingState

# Sets of host arrays, used in turn. At most two steps are in flight, so step N + 3 reuses step N's set
# after N has ended; the third set covers a tensor-parallel rank whose input thread prepares a step
# while its main thread still samples the step two before.
NUM_SETS = 3


class BlockTable:
    """Each sequence's block ids in one row of a table kept across steps (see the module's docstring).
    A row is taken on a sequence's first step and given back when its blocks are (it finished, was
    aborted or preempted: `remove`); the table grows if it runs out of rows."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int):
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: the lowest row first

    def row(self, seq_id: str, block_ids: list[int]) -> int:
        """The sequence's row, brought up to `block_ids` (its whole list): a sequence's blocks only
        grow while it holds them, so only those past the row's count are written."""
        row = self.row_of.get(seq_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self.row_of[seq_id] = self._free.pop()
        n, have = len(block_ids), int(self.num_blocks[row])
        if n > have:
            self.table[row, have:n] = block_ids[have:]
            self.num_blocks[row] = n
        elif n < have:  # not expected (blocks are freed with the row), but never stale
            self.table[row, :have] = 0
            self.table[row, :n] = block_ids
            self.num_blocks[row] = n
        return row

    def remove(self, seq_id: str) -> int | None:
        """Give the sequence's row back (returned; None if it had none)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.table[row, :self.num_blocks[row]] = 0  # padding reads the null block, as a fresh row's
            self.num_blocks[row] = 0
            self._free.append(row)
            self._free.sort(reverse=True)
        return row

    def _grow(self) -> None:
        rows = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free = list(range(2 * rows - 1, rows - 1, -1))


@dataclass
class StepInputs:
    """A step's tensors: views of one set's host arrays until `InputBatch.to_device`, then of the
    device arrays."""
    input_ids: torch.Tensor  # [T]; placeholder slots hold 0 until the runner fills them
    positions: torch.Tensor  # [T]
    metadata: PagedAttentionMetadata
    logits_indices: torch.Tensor  # [S]: the last token's row of each sequence that samples
    placeholder_slots: torch.Tensor | None  # rows of input_ids to fill from the previous step's sampled ids
    placeholder_prev_rows: torch.Tensor | None  # ...with these rows of them
    sampling: SamplingMetadata | None  # of the S sequences that sample (None: none does)
    host_set: int  # which set of host arrays holds it


class InputBatch:
    """Builds each step's inputs (ModelRunner.prepare_inputs) from the persistent block table and
    sampling state into one of the sets of host arrays; `to_device` copies them into the device
    arrays on the thread that runs the step. `pad_to`: (tokens, sequences) of the largest CUDA
    graph, whose padding every step writes (None: no graphs)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, vocab_size: int, pad_to: tuple[int, int] | None = None):
        self.block_size, self.device, self.max_blocks, self.pad_to = block_size, device, max_blocks_per_seq, pad_to
        self.block_table = BlockTable(max_seqs, max_blocks_per_seq)
        self.sampling = SamplingState(max_seqs, vocab_size)
        self._sets: list[_StepArrays] = []
        self._device: _StepArrays | None = None
        self._copied: list = [None] * NUM_SETS  # per host set: the event its last copies recorded
        self._next = 0
        self._size(max(max_tokens, pad_to[0] if pad_to else 0), max_seqs)

    def _size(self, max_tokens: int, max_seqs: int) -> None:
        """(Re)allocate the arrays for steps of up to max_tokens tokens and max_seqs sequences."""
        if self._device is not None and self.pad_to is not None:  # graphs read the device arrays' addresses
            raise RuntimeError(f"a step of {max_tokens} tokens and {max_seqs} sequences exceeds the engine's limits")
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.arange = np.arange(max(max_tokens, max_seqs + 1), dtype=np.int64)
        host = torch.device("cpu")
        self._sets = [_StepArrays(max_tokens, max_seqs, self.max_blocks, host, pin=self.device.type == "cuda")
                      for _ in range(NUM_SETS)]
        # A device set apart from the host sets on a GPU, and for graphs on any device: a graph reads
        # fixed addresses, which the host sets, used in turn, are not.
        static = self.device.type != "cpu" or self.pad_to is not None
        self._device = _StepArrays(max_tokens, max_seqs, self.max_blocks, self.device, pin=False) if static else None

    @property
    def device_arrays(self) -> _StepArrays:
        """The arrays every step's device tensors are views of (graph_runner.py's static buffers)."""
        return self._device

    def prepare(self, batch, freed_seq_ids=()) -> StepInputs:
        """The step's inputs, as host tensors (the device's own on a CPU without graphs)."""
        table = self.block_table
        self.free(freed_seq_ids)
        num_seqs = len(batch)
        ids, slots, prev, last, sampling_rows, sampling_entries = [], [], [], [], [], []
        new = np.empty(num_seqs, dtype=np.int64)
        computed = np.empty(num_seqs, dtype=np.int64)
        rows = np.empty(num_seqs, dtype=np.int64)
        for i, e in enumerate(batch):  # the one loop over sequences: their token ids and rows
            start = len(ids)
            ids += e.token_ids
            if e.prev_row is not None:
                slots.append(len(ids))
                prev.append(e.prev_row)
                ids.append(0)
            drafts = e.draft_token_ids
            ids += drafts
            new[i], computed[i] = len(ids) - start, e.num_computed_tokens
            rows[i] = row = table.row(e.seq_id, e.block_ids)
            if e.sampling is not None:  # the newest token's row, and one per draft
                last += range(len(ids) - 1 - len(drafts), len(ids))
                if row >= len(self.sampling.written):
                    self.sampling.grow(table.table.shape[0])
                if not self.sampling.written[row]:  # its first sampling step: its parameters into its row
                    self.sampling.write(row, e.sampling)
                sampling_rows.append(row)
                sampling_entries.append(e)
        num_tokens = len(ids)
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            self._size(max(num_tokens, 2 * self.max_tokens), max(num_seqs, self.max_seqs))
        which = self._next
        self._next = (self._next + 1) % NUM_SETS
        if self._copied[which] is not None:  # the copies that read this set last must be done
            self._copied[which].synchronize()
            self._copied[which] = None
        arrays = self._sets[which]
        # Positions: each sequence's computed count, then 0, 1, ... over its new tokens (vLLM's
        # arange trick: one repeat and one subtraction for the whole step).
        ends = np.cumsum(new)
        host = arrays.np
        positions = host["positions"][:num_tokens]
        np.subtract(self.arange[:num_tokens], np.repeat(ends - new - computed, new), out=positions)
        token_rows = np.repeat(rows, new)
        bs = self.block_size
        slot = host["slot_mapping"][:num_tokens]
        np.add(table.table[token_rows, positions // bs].astype(np.int64) * bs, positions % bs, out=slot)
        seq_lens = host["seq_lens"][:num_seqs]
        np.add(computed, new, out=seq_lens, casting="unsafe")
        starts = host["query_start_loc"][:num_seqs + 1]
        starts[0] = 0
        starts[1:] = ends
        width = int(table.num_blocks[rows].max()) if num_seqs else 0
        host["block_tables"][:num_seqs, :width] = table.table[rows, :width]
        if self.pad_to is not None:  # the padding a replay at any captured size reads
            pad_tokens, pad_seqs = self.pad_to
            host["slot_mapping"][num_tokens:pad_tokens] = PAD_SLOT_ID
            host["seq_lens"][num_seqs:pad_seqs] = 0
            host["query_start_loc"][num_seqs + 1:pad_seqs + 1] = num_tokens  # (a padding row's blocks are never read)
        host["input_ids"][:num_tokens] = ids
        host["logits_indices"][:len(last)] = last
        t = arrays.tensors(num_tokens, num_seqs, width, len(last))
        metadata = PagedAttentionMetadata(t["slot_mapping"], t["block_tables"], t["seq_lens"], t["query_start_loc"],
                                          int(new.max()) if num_seqs else 0,
                                          int(seq_lens.max()) if num_seqs else 0)
        placeholders = (None, None)
        if slots:
            host["placeholder_slots"][:len(slots)] = slots
            host["placeholder_prev_rows"][:len(prev)] = prev
            placeholders = (arrays.placeholder_slots[:len(slots)], arrays.placeholder_prev_rows[:len(prev)])
        sampling = None
        if sampling_rows:
            sampling = self.sampling.metadata(np.array(sampling_rows, dtype=np.int64), sampling_entries)
        return StepInputs(t["input_ids"], t["positions"], metadata, t["logits_indices"], *placeholders, sampling, which)

    def free(self, seq_ids) -> None:
        """Rows of sequences that finished, were aborted or preempted (their blocks went back to the pool)."""
        for seq_id in seq_ids:
            row = self.block_table.remove(seq_id)
            if row is not None:
                self.sampling.remove(row)

    def to_device(self, step) -> None:
        """The step's host tensors (a StepInputs, or the ModelInput that carries its fields) copied
        into the device arrays, in place: one non-blocking copy each, from pinned memory, on the
        thread that runs the step (the copies queue behind the step before). With graphs, the copies
        reach to the largest captured size, padding included."""
        dev = self._device
        if dev is None:
            return
        host = self._sets[step.host_set]
        num_tokens, num_seqs = step.input_ids.shape[0], step.metadata.num_seqs
        pad_tokens, pad_seqs = self.pad_to or (num_tokens, num_seqs)
        n, r = max(num_tokens, pad_tokens), max(num_seqs, pad_seqs)

        def copy(name, length):
            return getattr(dev, name)[:length].copy_(getattr(host, name)[:length], non_blocking=True)
        meta = step.metadata
        step.metadata = PagedAttentionMetadata(
            copy("slot_mapping", n)[:num_tokens], copy("block_tables", num_seqs)[:, :meta.block_tables.shape[1]],
            copy("seq_lens", r)[:num_seqs], copy("query_start_loc", r + 1)[:num_seqs + 1],
            meta.max_query_len, meta.max_seq_len)
        step.input_ids, step.positions = copy("input_ids", num_tokens), copy("positions", num_tokens)
        step.logits_indices = copy("logits_indices", step.logits_indices.shape[0])
        if step.placeholder_slots is not None:
            step.placeholder_slots = copy("placeholder_slots", step.placeholder_slots.shape[0])
            step.placeholder_prev_rows = copy("placeholder_prev_rows", step.placeholder_prev_rows.shape[0])
        if step.sampling is not None:
            step.sampling = step.sampling.to_device(self.device)
        self._copied[step.host_set] = self._record()

    def _record(self):
        """An event marking the copies just queued (None where copies are synchronous: a CPU's)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event


class _StepArrays:
    """One set of a step's arrays, allocated once at the engine's limits."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, pin: bool):
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device, pin_memory=pin)
        # One slot more than a step can use: a step's ids and positions are then always views shorter than
        # their array, so torch.compile's guards never single out the step that fills it (a view as long
        # as its base gets a graph of its own).
        self.input_ids, self.positions = zeros(max_tokens + 1, dtype=torch.long), zeros(max_tokens + 1, dtype=torch.long)
        self.slot_mapping = zeros(max_tokens + 1, dtype=torch.long).fill_(PAD_SLOT_ID)
        self.logits_indices = zeros(max_tokens, dtype=torch.long)
        self.seq_lens, self.query_start_loc = zeros(max_seqs + 1, dtype=torch.int32), zeros(max_seqs + 2, dtype=torch.int32)
        # [max_seqs + 1, max_blocks]: a step reads its first rows and columns, at a row stride that never changes
        self.block_tables = zeros(max_seqs + 1, max_blocks, dtype=torch.int32)
        self.placeholder_slots, self.placeholder_prev_rows = zeros(max_seqs, dtype=torch.long), zeros(max_seqs, dtype=torch.long)
        # numpy views of a host set's arrays, made once (a .numpy() call costs a microsecond or two a step)
        self.np = {} if device.type != "cpu" else {k: v.numpy() for k, v in vars(self).items()}
        self._shape: tuple[int, ...] | None = None
        self._views: dict[str, torch.Tensor] = {}

    def tensors(self, num_tokens: int, num_seqs: int, width: int, num_logits: int) -> dict[str, torch.Tensor]:
        """The step's views of the arrays; the last shape's are kept (decode steps repeat it, and seven
        views cost about ten microseconds)."""
        shape = (num_tokens, num_seqs, width, num_logits)
        if shape != self._shape:
            self._shape, self._views = shape, {
                "input_ids": self.input_ids[:num_tokens], "positions": self.positions[:num_tokens],
                "slot_mapping": self.slot_mapping[:num_tokens], "logits_indices": self.logits_indices[:num_logits],
                "seq_lens": self.seq_lens[:num_seqs], "query_start_loc": self.query_start_loc[:num_seqs + 1],
                "block_tables": self.block_tables[:num_seqs, :width]}
        return self._views
