"""ModelRunner: owns the model and the paged KV pool on the device, and runs one forward pass
over a flattened batch of sequences: no padding, each sequence contributes its new tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.device import resolve_device, resolve_dtype
from shared.forward_context import set_forward_context
from shared.weights import load_config, load_model, resolve_model_path

from .config import EngineConfig
from .kv_cache_manager import num_blocks_for_budget
from .attention_metadata import PagedAttentionMetadata
from .paged_attention import PagedAttention

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class SequenceBatchEntry:
    """One sequence's share of a step: its new tokens, how many tokens it already has in the
    cache, and its block table."""
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)
        cfg = load_config(self.model_path)
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings,
                                                             DEFAULT_MAX_MODEL_LEN),
                                 cfg.max_position_embeddings)
        self.model = load_model(self.model_path, self.device, self.dtype, self.max_model_len,
                                config.load_format)
        self.model_config = c = self.model.config
        self.block_size = config.block_size
        self.num_blocks = num_blocks_for_budget(config.kv_cache_memory_mb * 2**20, c.num_hidden_layers,
                                                c.num_key_value_heads, c.head_dim, self.block_size, self.dtype)
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory_mb={config.kv_cache_memory_mb} holds fewer than 2 blocks")
        self.attn = PagedAttention(c.num_hidden_layers, self.num_blocks, self.block_size,
                                   c.num_key_value_heads, c.head_dim, self.dtype, self.device,
                                   use_triton=config.use_triton)

    @torch.inference_mode()
    def forward(self, batch: list[SequenceBatchEntry]) -> torch.Tensor:
        """Run every sequence's new tokens in one pass; return the logits of each sequence's
        last token: [len(batch), V]."""
        ids, positions, seq_lens, query_lens = [], [], [], []
        for e in batch:
            start, n = e.num_computed_tokens, len(e.token_ids)
            ids += e.token_ids
            positions += range(start, start + n)
            seq_lens.append(start + n)
            query_lens.append(n)
        meta = PagedAttentionMetadata.build([e.block_ids for e in batch], seq_lens, query_lens,
                                            self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with set_forward_context(self.attn, meta):
            hidden = self.model(input_ids, pos)
        last = meta.query_start_loc[1:].long() - 1  # each sequence samples from its last token
        return self.model.compute_logits(hidden[last])
