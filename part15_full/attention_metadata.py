"""The per-step metadata of paged attention: where each new token's K/V go and where each
sequence's blocks are. The model runner builds it on the host once per step; both implementations
of the attention (the torch reference in paged_attention.py and the Triton kernels) read it, so it
lives apart from both.

In vLLM: vllm/v1/attention/backends/utils.py (CommonAttentionMetadata) and each backend's
metadata builder."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_utils import compute_slot_mapping

PAD_SLOT_ID = -1  # slot_mapping entry of a padding token: its K/V are not stored anywhere
NULL_BLOCK_ID = 0  # block-table padding: the pool's reserved, never-written null block


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token (PAD_SLOT_ID: skip)
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids, padded with 0
    seq_lens: torch.Tensor  # [B] int32: tokens of each sequence, this step's new ones included
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts (starts at 0)
    max_query_len: int  # host-side copies, so kernel launches need no device -> host sync
    max_seq_len: int
    # What the torch reference derives from this once per step, reused by every layer.
    _plan: object = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """From per-sequence host lists, in batch order: the block ids of each sequence, its total
        length after this step, and how many of those tokens are new this step."""
        slots: list[int] = []
        for blocks, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
            slots += compute_slot_mapping(blocks, block_size, seq_len - q_len, seq_len)
        width = max((len(b) for b in block_tables), default=0)
        padded = [b + [NULL_BLOCK_ID] * (width - len(b)) for b in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        return cls(slot_mapping=tensor(slots, torch.int64),
                   block_tables=tensor(padded, torch.int32).view(len(padded), width),
                   seq_lens=tensor(seq_lens, torch.int32),
                   query_start_loc=tensor(starts, torch.int32),
                   max_query_len=max(query_lens, default=0),
                   max_seq_len=max(seq_lens, default=0))
