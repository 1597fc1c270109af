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
sets used in turn (`NUM_SETS`): while step N runs, step N+1 fills another set. On a CPU the host
arrays are the step's tensors.

Each running sequence keeps a row of a persistent block table, `[max_num_seqs, max_blocks_per_seq]`
(`BlockTable`): a row is written only where it changes (the blocks a step adds), rewritten when the
sequence comes back from preemption with new blocks, and freed when it finishes. A token's slot is
then one numpy expression over the whole step: `table[row, pos // block_size] * block_size + pos %
block_size`.

In vLLM v0.33.0: vllm/v1/worker/gpu_input_batch.py (InputBatch, CachedRequestState),
vllm/v1/worker/block_table.py (BlockTable: append_row, add_row, compute_slot_mapping),
vllm/v1/utils.py (CpuGpuBuffer: the same host and device pair) and vllm/v1/worker/gpu_model_runner.py (_prepare_inputs: the
np.repeat / cumsum "arange trick")."""
from __future__ import annotations

import numpy as np
import torch

from .attention_metadata import PagedAttentionMetadata

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

    def remove(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.table[row, :self.num_blocks[row]] = 0  # padding reads the null block, as a fresh row's
            self.num_blocks[row] = 0
            self._free.append(row)
            self._free.sort(reverse=True)

    def _grow(self) -> None:
        rows = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free = list(range(2 * rows - 1, rows - 1, -1))


class InputBatch:
    """Builds each step's inputs (ModelRunner.prepare_inputs) from the persistent block table into
    one of two sets of step arrays; on a GPU `to_device` copies them into the device arrays on the
    thread that runs the step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size, self.device, self.max_blocks = block_size, device, max_blocks_per_seq
        self.block_table = BlockTable(max_seqs, max_blocks_per_seq)
        self._sets: list[_StepArrays] = []
        self._device: _StepArrays | None = None
        self._next = 0
        self._size(max_tokens, max_seqs)

    def _size(self, max_tokens: int, max_seqs: int) -> None:
        """(Re)allocate the arrays for steps of up to max_tokens tokens and max_seqs sequences."""
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.arange = np.arange(max(max_tokens, max_seqs + 1), dtype=np.int64)
        host = torch.device("cpu")
        self._sets = [_StepArrays(max_tokens, max_seqs, self.max_blocks, host, pin=self.device.type == "cuda")
                      for _ in range(NUM_SETS)]
        self._device = None if self.device.type == "cpu" else _StepArrays(max_tokens, max_seqs, self.max_blocks,
                                                                           self.device, pin=False)

    def prepare(self, batch, freed_seq_ids=()) -> tuple:
        """(input_ids, positions, metadata, logits_indices, placeholder_slots, placeholder_prev_rows) of
        the step: host tensors, views into this step's arrays (the device's own on a CPU)."""
        table = self.block_table
        for seq_id in freed_seq_ids:  # finished, aborted or preempted: their blocks went back to the pool
            table.remove(seq_id)
        num_seqs = len(batch)
        ids, slots, prev, last = [], [], [], []
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
            rows[i] = table.row(e.seq_id, e.block_ids)
            if e.sampling is not None:  # the newest token's row, and one per draft
                last += range(len(ids) - 1 - len(drafts), len(ids))
        num_tokens = len(ids)
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            self._size(max(num_tokens, 2 * self.max_tokens), max(num_seqs, self.max_seqs))
        arrays = self._sets[self._next]
        self._next = (self._next + 1) % NUM_SETS
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
        tables = host["block_tables"][:num_seqs * width].reshape(num_seqs, width)
        np.take(table.table[:, :width], rows, axis=0, out=tables)
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
        return (t["input_ids"], t["positions"], metadata, t["logits_indices"], *placeholders)

    def to_device(self, input_ids, positions, metadata, logits_indices, placeholder_slots, placeholder_prev_rows):
        """The step's host tensors copied into the device arrays (one non-blocking copy each, from
        pinned memory), on the thread that runs the step: the copies queue behind the step before."""
        dev = self._device
        if dev is None:
            return input_ids, positions, metadata, logits_indices, placeholder_slots, placeholder_prev_rows

        def copy(src, dst):
            out = dst.view(-1)[:src.numel()].view(src.shape)
            return out.copy_(src, non_blocking=True)
        md = PagedAttentionMetadata(copy(metadata.slot_mapping, dev.slot_mapping),
                                    copy(metadata.block_tables, dev.block_tables),
                                    copy(metadata.seq_lens, dev.seq_lens),
                                    copy(metadata.query_start_loc, dev.query_start_loc),
                                    metadata.max_query_len, metadata.max_seq_len)
        slots = None if placeholder_slots is None else copy(placeholder_slots, dev.placeholder_slots)
        prev = None if placeholder_prev_rows is None else copy(placeholder_prev_rows, dev.placeholder_prev_rows)
        return (copy(input_ids, dev.input_ids), copy(positions, dev.positions), md,
                copy(logits_indices, dev.logits_indices), slots, prev)


class _StepArrays:
    """One set of a step's arrays, allocated once at the engine's limits."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, pin: bool):
        def zeros(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin)
        # One slot more than a step can use: a step's ids and positions are then always views shorter than
        # their array, so torch.compile's guards never single out the step that fills it (a view as long
        # as its base gets a graph of its own).
        self.input_ids, self.positions = zeros(max_tokens + 1, torch.long), zeros(max_tokens + 1, torch.long)
        self.slot_mapping, self.logits_indices = zeros(max_tokens, torch.long), zeros(max_tokens, torch.long)
        self.seq_lens, self.query_start_loc = zeros(max_seqs, torch.int32), zeros(max_seqs + 1, torch.int32)
        self.block_tables = zeros(max_seqs * max_blocks, torch.int32)
        self.placeholder_slots, self.placeholder_prev_rows = zeros(max_seqs, torch.long), zeros(max_seqs, torch.long)
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
                "block_tables": self.block_tables[:num_seqs * width].view(num_seqs, width)}
        return self._views
