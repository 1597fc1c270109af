"""ModelRunner: owns the model and the paged KV pool on the device, and runs one step over a
flattened batch of sequences (no padding, each sequence contributes its new tokens): forward
pass, then sampling.

Async scheduling splits a step in two: `prepare_inputs` (host work: token ids, positions, paged
attention metadata, sampling rows) and `execute_model` (device work). A sequence whose input is
the token the previous step sampled names that step's row instead of a token id, and
`execute_model` copies the id across on the device: no round trip through the host."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from shared.device import resolve_device, resolve_dtype
from shared.forward_context import set_forward_context
from shared.sampler import SampledBatch, Sampler, SamplingRow
from shared.weights import load_config, load_model, resolve_model_path

from .config import EngineConfig
from .kv_cache_manager import num_blocks_for_budget
from .attention_metadata import PagedAttentionMetadata
from .paged_attention import PagedAttention

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class SequenceBatchEntry:
    """One sequence's share of a step: its new tokens, how many tokens it already has in the
    cache, its block table and how it samples. When its last new token is the one the previous
    step sampled for it (not yet on the host), `token_ids` lacks it and `prev_row` names the
    previous step's row that holds it."""
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingRow
    prev_row: int | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + (self.prev_row is not None)


@dataclass
class ModelInput:
    """Everything one step needs on the device, built on the host by prepare_inputs."""
    input_ids: torch.Tensor  # [T]; placeholder slots hold 0 until execute_model fills them
    positions: torch.Tensor  # [T]
    metadata: PagedAttentionMetadata
    logits_indices: torch.Tensor  # [B]: the row of each sequence's last token, which samples
    placeholder_slots: torch.Tensor | None  # rows of input_ids to fill from the previous step
    placeholder_prev_rows: torch.Tensor | None  # ...with these rows of its sampled ids
    rows: list[SamplingRow]
    prev_rows: list[int | None]  # per sequence, as in SequenceBatchEntry


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
        self.sampler = Sampler()
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.timeline: list[tuple[float, float]] | None = None  # (start, end) of each step, when on

    def prepare_inputs(self, batch: list[SequenceBatchEntry]) -> ModelInput:
        """The host half of a step: flatten the batch into tensors on the device."""
        ids, positions, seq_lens, query_lens, slots, prev = [], [], [], [], [], []
        for e in batch:
            start, n = e.num_computed_tokens, e.num_new_tokens
            ids += e.token_ids
            if e.prev_row is not None:
                slots.append(len(ids))
                prev.append(e.prev_row)
                ids.append(0)
            positions += range(start, start + n)
            seq_lens.append(start + n)
            query_lens.append(n)
        meta = PagedAttentionMetadata.build([e.block_ids for e in batch], seq_lens, query_lens,
                                            self.block_size, self.device)

        def tensor(data):
            return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

        return ModelInput(tensor(ids), tensor(positions), meta, meta.query_start_loc[1:].long() - 1,
                          tensor(slots) if slots else None, tensor(prev) if prev else None,
                          [e.sampling for e in batch], [e.prev_row for e in batch])

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> SampledBatch:
        """The device half: fill in the previous step's tokens, run the model, sample. The
        sampled ids stay on the device (the next step reads them there)."""
        start = time.perf_counter()
        input_ids = inp.input_ids
        if inp.placeholder_slots is not None:
            input_ids[inp.placeholder_slots] = self.prev_sampled_token_ids[inp.placeholder_prev_rows]
        with set_forward_context(self.attn, inp.metadata):
            hidden = self.model(input_ids, inp.positions)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        sampled = self.sampler.sample(logits, self._complete_histories(inp))
        self.prev_sampled_token_ids = sampled.token_ids
        if self.timeline is not None:
            self.timeline.append((start, time.perf_counter()))
        return sampled

    def _complete_histories(self, inp: ModelInput) -> list[SamplingRow]:
        """Penalties count a sequence's generated tokens, and the newest one may still be the
        previous step's placeholder. Read those few ids back (vLLM patches them on the device;
        a host read costs a sync on a GPU, only for rows with penalties)."""
        rows = inp.rows
        fix = [i for i, r in enumerate(rows) if inp.prev_rows[i] is not None and r.params.has_penalties]
        if not fix:
            return rows
        ids = self.prev_sampled_token_ids[[inp.prev_rows[i] for i in fix]].tolist()
        rows = list(rows)
        for i, tok in zip(fix, ids):
            rows[i] = dataclasses.replace(rows[i], output_token_ids=rows[i].output_token_ids + [tok])
        return rows
