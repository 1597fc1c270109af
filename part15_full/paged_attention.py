"""The paged attention backend: K/V live in fixed-size blocks of one preallocated pool, and each
sequence reaches its blocks through a block table.

Layout. Per layer, k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Viewed flat as [num_blocks * block_size, KV, D], token slot `s` is row s, where
s = block_id * block_size + position % block_size (see kv_cache_manager.compute_slot_mapping).

A step's batch is flattened: the new tokens of sequence i are rows
query_start_loc[i] : query_start_loc[i+1] of q/k/v, and they are the *last* q_len tokens of that
sequence (positions seq_len - q_len .. seq_len - 1). So one metadata object describes decode
(q_len == 1), a fresh prefill (q_len == seq_len) and a prefill on top of cached context
(1 < q_len < seq_len) alike.

A KV connector (part 13) may hook every layer: `wait_for_layer_load` before the layer reads its cache
(a layer-by-layer loader overlaps the transfer with the layers before), `save_kv_layer` once the layer
has written it.

Three backends hold the pool and compute the same maths, and one is picked at start-up
(`get_attention_backend`), as vLLM picks one of vllm/v1/attention/backends/: `TritonAttention`
(triton_kernels.py, the GPU's), `CpuAttention` (cpu/attention.py: a C kernel that reads the
blocks in place, the CPU's) and `TorchAttention` below (the reference every other one is tested
against, and the fallback where neither fits). A backend's `bind_step(metadata)` gives the step's
attention for every layer, with whatever it derives from the metadata worked out once: the graph
runner calls that, and `forward` (the modules' call) goes through it too."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.attention import sdpa, softcapped_attention
from shared.config import ModelConfig
from shared.device import kv_cache_zeros
from shared.forward_context import AttentionBackend

from .attention_metadata import PagedAttentionMetadata
from .block_utils import cdiv
from .platforms import Platform, current_platform


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new k, v [T, KV, D] in their slots of k_cache, v_cache [N, block_size, KV, D]."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # .view (not reshape): a copy would silently drop the writes.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens reached through block_ids [..., n]: [..., length, KV, D].
    index_select copies whole blocks as rows, about 2x faster on CPU than cache[block_ids]."""
    blocks = cache.index_select(0, block_ids.flatten())
    return blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])[..., :length, :, :]


@dataclass
class _ReferencePlan:
    """What the torch path derives from the metadata: the same for every layer of a step, so it
    is worked out once, on the first layer, and reused by the other layers."""
    decode_rows: torch.Tensor | None  # rows of q that are decode tokens (one per sequence)
    decode_tables: torch.Tensor | None  # their block tables, cut to the longest of them
    decode_len: int
    decode_idx: torch.Tensor | None  # their sequences' indices in the batch
    decode_mask: torch.Tensor | None  # [Bd, decode_len]: True where a key exists
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (first row, q_len, seq_len, blocks)


def _reference_plan(metadata: PagedAttentionMetadata, block_size: int) -> _ReferencePlan:
    if metadata._plan is not None:
        return metadata._plan
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    device = metadata.seq_lens.device
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    rows = idx = tables = mask = None
    max_len = 0
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=device)
        idx = torch.tensor(decode, device=device)
        max_len = max(seq_lens[i] for i in decode)
        tables = metadata.block_tables[idx, :cdiv(max_len, block_size)].long()
        mask = torch.arange(max_len, device=device)[None, :] < metadata.seq_lens[idx][:, None]
    prefills = [(starts[i], n, seq_lens[i], metadata.block_tables[i, :cdiv(seq_lens[i], block_size)].long())
                for i, n in enumerate(q_lens) if n > 1]
    metadata._plan = _ReferencePlan(rows, tables, max_len, idx, mask, prefills)
    return metadata._plan


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        metadata: PagedAttentionMetadata, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the new tokens q [T, H, D] over everything each sequence has in the
    cache (this step's K/V must already be stored). GQA when H is a multiple of KV. -> [T, H, D]
    `window`: a token at position i sees keys i - window < j <= i only (a sliding-window layer);
    `softcap`: tanh-capped scores (shared/attention.py)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = _reference_plan(metadata, k_cache.shape[1])

    # Decode sequences (one new token each) go together: one gather of their blocks, padded to
    # the longest, a mask hiding each one's padding, and one batched SDPA call. The query heads
    # that share a KV head go in as rows of one query, [Bd, KV, H / KV, D], so each K/V head is
    # read once per group rather than once per query head (1.7x faster than enable_gqa here).
    if plan.decode_rows is not None:
        k = gather_blocks(k_cache, plan.decode_tables, plan.decode_len).transpose(1, 2)  # [Bd, KV, L, D]
        v = gather_blocks(v_cache, plan.decode_tables, plan.decode_len).transpose(1, 2)
        qd = q[plan.decode_rows]
        qd4 = qd.view(qd.shape[0], k.shape[1], -1, qd.shape[-1])
        mask = plan.decode_mask
        if window is not None:  # and not older than the window: keys j > seq_len - 1 - window
            mask = mask & (torch.arange(plan.decode_len, device=q.device)[None, :]
                           >= metadata.seq_lens[plan.decode_idx][:, None] - window)
        if softcap is None:
            o = F.scaled_dot_product_attention(qd4, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        else:
            o = softcapped_attention(qd4, k, v, mask[:, None, None, :], scale, softcap)
        out[plan.decode_rows] = o.reshape(qd.shape)

    # Longer queries one sequence at a time: gather its blocks; the causal mask is offset by the
    # context already cached (q_start), which sdpa() handles.
    for start, q_len, seq_len, tables in plan.prefills:
        k, v = gather_blocks(k_cache, tables, seq_len), gather_blocks(v_cache, tables, seq_len)
        out[start:start + q_len] = sdpa(q[start:start + q_len], k, v, scale, q_start=seq_len - q_len,
                                        window=window, softcap=softcap)
    return out


class AttentionCGSupport(enum.IntEnum):
    """Which batches a backend can run inside a FULL CUDA graph, where every host decision (a grid
    size, a plan read from the metadata) is fixed at capture: any batch (ALWAYS), batches whose
    sequences all have the same query length (UNIFORM_BATCH), or none (NEVER: it plans on the host)."""
    NEVER = 0
    UNIFORM_BATCH = 2
    ALWAYS = 3


class PagedAttention(AttentionBackend):
    """Owns the block-pool KV tensors of every layer; per layer it stores this step's K/V in their
    slots, then attends through the block tables. A backend subclasses it with `attend`."""
    cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, scale: float | None = None,
                 sliding_windows: tuple[int | None, ...] | None = None, logit_softcap: float | None = None):
        device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: padded reads of never-written slots then meet finite numbers
        # (NaN garbage times a zero attention weight would still be NaN). On the CPU the zeros are
        # the OS's untouched pages: a block takes RAM only once written (kv_cache_zeros).
        self.k_cache = kv_cache_zeros(shape, dtype, device)
        self.v_cache = kv_cache_zeros(shape, dtype, device)
        self.block_size = block_size
        self.scale = head_dim ** -0.5 if scale is None else scale
        # Each layer's window (None: full causal attention), as the model's config lays them out
        # (Gemma: five sliding layers to one global), and Gemma 2's cap on the scores.
        self.windows = tuple(sliding_windows) if sliding_windows else (None,) * num_layers
        self.logit_softcap = logit_softcap
        self.kv_connector = None  # part 13: its per-layer hooks (set by ModelRunner.register_kv_connector)

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               metadata: PagedAttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v [T, KV, D] in their slots of the layer's pool, then attend: q [T, H, D] -> [T, H, D],
        written into `out` when given (a CUDA graph's piece reads its output at a fixed address)."""
        raise NotImplementedError

    def bind_step(self, metadata: PagedAttentionMetadata):
        """The step's attention, (layer_idx, q, k, v, out=None) -> out, for every layer of the step."""
        connector = self.kv_connector  # part 13: a connector may load or save layer by layer
        if connector is None:
            return lambda layer_idx, q, k, v, out=None: self.attend(layer_idx, q, k, v, metadata, out)

        def step(layer_idx, q, k, v, out=None):
            connector.wait_for_layer_load(layer_idx)
            out = self.attend(layer_idx, q, k, v, metadata, out)
            connector.save_kv_layer(layer_idx, self.k_cache[layer_idx], self.v_cache[layer_idx], metadata)
            return out
        return step

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: PagedAttentionMetadata) -> torch.Tensor:
        return self.bind_step(metadata)(layer_idx, q, k, v)


class TorchAttention(PagedAttention):
    """The reference: gather + SDPA (paged_attention_ref)."""

    def attend(self, layer_idx, q, k, v, metadata, out=None):
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
        reshape_and_cache_ref(k, v, k_cache, v_cache, metadata.slot_mapping)
        result = paged_attention_ref(q, k_cache, v_cache, metadata, self.scale, self.windows[layer_idx],
                                     self.logit_softcap)
        return result if out is None else out.copy_(result)


class TritonAttention(PagedAttention):
    """The GPU's: triton_kernels.py (also runs on a CPU under TRITON_INTERPRET=1, as the tests do).
    Its grid is sized by the batch's longest query, so a FULL graph holds only uniform batches."""
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def attend(self, layer_idx, q, k, v, metadata, out=None):
        # Imported on first use: importing triton is slow, and a CPU run never needs it.
        from . import triton_kernels

        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
        triton_kernels.reshape_and_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        return triton_kernels.paged_attention(q, k_cache, v_cache, metadata, self.scale, out,
                                              window=self.windows[layer_idx], softcap=self.logit_softcap)


def attention_options(cfg: ModelConfig, layer_range: tuple[int, int] | None = None) -> dict:
    """What a backend takes from the model's config beyond its shapes: the score scale, each layer's
    sliding window (None: full causal attention; a pipeline stage's layers only) and the scores'
    soft-cap (Gemma 2)."""
    windows = cfg.layer_windows[slice(*layer_range) if layer_range else slice(None)]
    return dict(scale=cfg.attention_scale, sliding_windows=windows, logit_softcap=cfg.attn_logit_softcap)


def get_attention_backend(num_layers: int, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device | str,
                          use_triton: bool | None = None, scale: float | None = None,
                          sliding_windows: tuple[int | None, ...] | None = None,
                          logit_softcap: float | None = None, platform: Platform | None = None) -> PagedAttention:
    """The backend for this device and model, chosen once: Triton on a GPU (or when asked), else the
    platform's own (on a CPU the C kernel where it is built and the shapes fit it, cpu/README.md), else
    the torch reference."""
    device = torch.device(device)
    args = (num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    kwargs = dict(scale=scale, sliding_windows=sliding_windows, logit_softcap=logit_softcap)
    if use_triton if use_triton is not None else device.type == "cuda":
        return TritonAttention(*args, **kwargs)
    platform = platform or current_platform(device)
    return platform.attention_backend(*args, num_heads=num_heads, **kwargs) or TorchAttention(*args, **kwargs)
