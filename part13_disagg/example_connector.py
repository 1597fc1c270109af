"""ExampleConnector: KV blocks shared through a directory (vLLM's example connector, formerly
SharedStorageConnector). The simplest connector that can move KV between engines:

* **save**: every full prompt block a step computes is written after that step, one safetensors
  file per block named by its chained block hash (part 07's chain, from a fixed root, so any
  process, and the same server after a restart, names the same prefix the same way), from
  `save_kv_layer` (each layer hands over its blocks as soon as it has written them) and
  `wait_for_save` (the file is written once every layer has);
* **load**: at admission, the files of the blocks after the device's prefix hit are found on disk
  (`get_num_new_matched_tokens` says how many, synchronously) and read into the sequence's blocks
  by `start_load_kv`, before the forward, so the step that admits the sequence already computes only
  what follows.

A shared file system (NFS, a fuse mount of object storage) makes it a cross-machine KV store; it is
slow and unbounded (nothing is ever evicted): an example, not a product.

    --kv-transfer-config '{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'

In vLLM: vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py (v0.33.0; one folder per
prompt hash, one file per layer); examples/offline_inference/disaggregated-prefill-v1/."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import KVTransferConfig
from .kv_cache_utils import BlockHasher, make_none_hash
from .kv_connector import KVConnectorBase, KVConnectorRole


@dataclass
class ExampleMetadata:
    loads: list[tuple[list[bytes], list[int]]] = field(default_factory=list)  # (block hashes, block ids)
    saves: list[tuple[list[bytes], list[int]]] = field(default_factory=list)


class ExampleConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, *, rank: int = 0,
                 kv_cache_manager=None, **_):
        super().__init__(config, role, block_size)
        self.kv = kv_cache_manager  # the scheduler half's: which blocks a sequence holds
        self.path = Path(config.kv_connector_extra_config.get("shared_storage_path", "/tmp/kv_example"))
        self.path.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        # Its own chain, from a fixed root: the engine's may be private to the process (part 07).
        self.hasher = BlockHasher(block_size, make_none_hash("example-connector"))
        self.hashes: dict[str, list[bytes]] = {}  # seq_id -> its block hashes
        self.num_saved: dict[str, int] = {}  # seq_id -> leading prompt blocks already on disk
        self.meta = ExampleMetadata()
        self.layer_blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _file(self, block_hash: bytes, rank: int | None = None) -> Path:
        return self.path / f"{block_hash.hex()}.rank{self.rank if rank is None else rank}.safetensors"

    def _block_hashes(self, seq) -> list[bytes]:
        view = self.hashes.setdefault(seq.seq_id, [])
        holder = _HashView(view, seq)
        self.hasher.hash_new_full_blocks(holder)
        return view

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        hashes = self._block_hashes(seq)[:(seq.num_tokens - 1) // self.block_size]  # the last token: computed
        n = 0
        for h in hashes[num_computed_tokens // self.block_size:]:
            if not self._file(h, rank=0).exists():
                break
            n += 1
        return n * self.block_size, False

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        first, n = seq.num_computed_tokens // self.block_size, num_external_tokens // self.block_size
        if n:
            self.meta.loads.append((self._block_hashes(seq)[first:first + n], block_ids[first:first + n]))
        self.num_saved[seq.seq_id] = first + n  # these are on disk already

    def build_connector_meta(self, scheduler_output) -> ExampleMetadata | None:
        for seq, _ in scheduler_output.scheduled:  # prompt blocks full once this step has run
            end = min(seq.num_computed_tokens, len(seq.request.prompt_token_ids)) // self.block_size
            start = self.num_saved.get(seq.seq_id, 0)
            if end > start:
                hashes = self._block_hashes(seq)[start:end]
                blocks = self.kv.get_block_ids(seq.seq_id)[start:end]
                todo = [(h, b) for h, b in zip(hashes, blocks) if not self._file(h, rank=0).exists()]
                if todo:
                    self.meta.saves.append(([h for h, _ in todo], [b for _, b in todo]))
                self.num_saved[seq.seq_id] = end
        meta, self.meta = self.meta, ExampleMetadata()
        return meta if meta.loads or meta.saves else None

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.hashes.pop(seq.seq_id, None)
        self.num_saved.pop(seq.seq_id, None)
        return False, None  # its saves were written by the step that computed them

    # ---- worker side ------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        if not self.metadata:
            return
        k_cache, v_cache = self.kv_caches
        for hashes, block_ids in self.metadata.loads:  # synchronous: done before the forward
            for h, b in zip(hashes, block_ids):
                data = load_file(str(self._file(h)), device=str(k_cache.device))
                k_cache[:, b] = data["k"]
                v_cache[:, b] = data["v"]

    def save_kv_layer(self, layer_idx: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata) -> None:
        """This layer's blocks to save, copied as soon as the layer has written them."""
        if self.metadata and self.metadata.saves:
            ids = torch.tensor([b for _, blocks in self.metadata.saves for b in blocks], device=k_cache.device)
            self.layer_blocks[layer_idx] = (k_cache[ids].cpu(), v_cache[ids].cpu())

    def wait_for_save(self) -> None:
        if not self.metadata or not self.metadata.saves:
            return
        layers = sorted(self.layer_blocks)
        k = torch.stack([self.layer_blocks[i][0] for i in layers], dim=1)  # [blocks, layers, ...]
        v = torch.stack([self.layer_blocks[i][1] for i in layers], dim=1)
        hashes = [h for hs, _ in self.metadata.saves for h in hs]
        for i, h in enumerate(hashes):
            final = self._file(h)
            tmp = final.with_suffix(f".tmp{os.getpid()}")
            save_file({"k": k[i].contiguous(), "v": v[i].contiguous()}, str(tmp))
            os.replace(tmp, final)  # atomic: a reader never sees half a file
        self.layer_blocks.clear()


class _HashView:
    """What BlockHasher reads of a sequence, with the connector's own hash list."""

    def __init__(self, hashes: list[bytes], seq):
        self.block_hashes, self.token_ids, self.request = hashes, seq.token_ids, seq.request
