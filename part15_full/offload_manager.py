"""The host KV tier's bookkeeping: which block hashes sit in host memory, and in which host block.

The device KV pool is small and fast; host memory is large and slow (a PCIe copy away). When the
device pool runs out, part 07's prefix cache drops blocks that a later request may want again,
and a preempted request throws its whole KV away and recomputes it. A second, host tier keeps
those blocks one copy away instead of one prefill away: full blocks are copied out, keyed by the
same chained block hashes as part 07 (a hash names a prefix, so a hit is a valid prefix whatever
request stored it), and copied back when a request's prefix is found there.

This file is the scheduler's side only: it decides, it never copies. The copies run asynchronously
on the worker, so every operation comes in two halves:

* `prepare_store` allocates host blocks and returns where to write; the blocks are "being stored"
  (ref_cnt -1) until `complete_store`. Until then they are invisible to `lookup` (the bytes are not
  there yet) and cannot be evicted (the copy would land in a block someone else owns). A failed
  store frees them again.
* `prepare_load` pins the blocks (ref_cnt += 1) and returns where to read; `complete_load` unpins.
  A pinned block is never evicted: its bytes are being read into the device.

When the host tier is full, `prepare_store` evicts idle ready blocks in the order of its
`CachePolicy` (LRU or ARC, see cache_policy.py), or refuses (None) if that cannot free enough
blocks; the offload is best effort, the device copy is still there. `reserve_blocks` serves a
different client, swap-on-preemption: a preempted request's blocks are partial and not hash-keyed,
so they take host blocks outside the cache (evicting cached ones if needed) and give them back
with `release_blocks` once swapped in.

In vLLM: vllm/v1/kv_offload/base.py (OffloadingManager, LoadStoreSpec, PrepareStoreOutput,
OffloadingEvent) and vllm/v1/kv_offload/cpu/manager.py (CPUOffloadingManager) in v0.33.0, where
keys also carry a KV-group index and lookup is per block; the 2025 design is in v0.11.0:
vllm/v1/kv_offload/abstract.py and lru_manager.py. vLLM V1 has no swap tier (V0 had one: swap_space,
v0.8.5: vllm/core/block_manager.py and vllm/worker/cache_engine.py); reserve/release is ours."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .cache_policy import BlockHash, BlockStatus, CachePolicy, make_cache_policy


@dataclass
class LoadStoreSpec:
    block_ids: list[int]
    medium: str  # "CPU" (host blocks) or "GPU" (device blocks): where block_ids point

    def __post_init__(self):
        if self.medium not in ("CPU", "GPU"):
            raise ValueError(f"medium must be 'CPU' or 'GPU', got {self.medium!r}")


@dataclass
class PrepareStoreOutput:
    block_hashes_to_store: list[BlockHash]  # the asked-for blocks not already in the tier
    store_spec: LoadStoreSpec  # where to write them, in the same order
    block_hashes_evicted: list[BlockHash]  # dropped from the tier to make room


@dataclass
class OffloadingEvent:
    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool  # False: now stored and loadable; True: no longer in the tier


@dataclass
class OffloadingStats:
    queries: int = 0  # blocks asked about by lookup
    hits: int = 0  # of those, found ready
    stored_blocks: int = 0  # stores completed successfully
    evictions: int = 0  # blocks evicted to make room (a reset is not counted)


class OffloadingManager(ABC):
    """The scheduler side of one offload tier; hashes passed in are a request's, in prefix order."""

    @abstractmethod
    def lookup(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks are in the tier and ready to load."""

    @abstractmethod
    def prepare_load(self, block_hashes: list[BlockHash]) -> LoadStoreSpec:
        """Pin ready blocks against eviction and say where to read them."""

    @abstractmethod
    def touch(self, block_hashes: list[BlockHash]) -> None:
        """Record a use of these blocks for the eviction order."""

    @abstractmethod
    def complete_load(self, block_hashes: list[BlockHash]) -> None:
        """Unpin blocks whose load has finished."""

    @abstractmethod
    def prepare_store(self, block_hashes: list[BlockHash]) -> PrepareStoreOutput | None:
        """Allocate host blocks for those not yet offloaded, or None if there is no room."""

    @abstractmethod
    def complete_store(self, block_hashes: list[BlockHash], success: bool = True) -> None:
        """Make stored blocks loadable, or free them if the copy failed."""

    def take_events(self) -> list[OffloadingEvent]:
        return []


class CPUOffloadingManager(OffloadingManager):
    def __init__(self, num_blocks: int, block_size: int, eviction_policy: str = "lru",
                 enable_events: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.policy: CachePolicy = make_cache_policy(eviction_policy, num_blocks)
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.reserved: set[int] = set()  # host blocks lent to swapped-out requests
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.stats = OffloadingStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding something: cached (idle ones included) or reserved."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def _emit(self, block_hashes: list[BlockHash], removed: bool) -> None:
        if self.events is not None and block_hashes:
            self.events.append(OffloadingEvent(list(block_hashes), self.block_size, "CPU", removed))

    def _evict(self, n: int, protected: set[BlockHash]) -> list[BlockHash] | None:
        """Free n host blocks by eviction; None (nothing changed) if the policy cannot."""
        evicted = self.policy.evict(n, protected) if n > 0 else []
        if evicted is None:
            return None
        self.free_block_ids.extend(block.block_id for _, block in evicted)
        self.stats.evictions += len(evicted)
        keys = [key for key, _ in evicted]
        self._emit(keys, removed=True)
        return keys

    def lookup(self, block_hashes):
        hits = 0
        for key in block_hashes:
            block = self.policy.get(key)
            if block is None or not block.is_ready:  # a block being stored has no bytes yet
                break
            hits += 1
        self.stats.queries += len(block_hashes)
        self.stats.hits += hits
        return hits

    def prepare_load(self, block_hashes):
        blocks = [self.policy.get(key) for key in block_hashes]
        if any(b is None or not b.is_ready for b in blocks):  # check all before pinning any
            raise ValueError("prepare_load of a block that is not offloaded and ready")
        for block in blocks:
            block.ref_cnt += 1
        return LoadStoreSpec([b.block_id for b in blocks], "CPU")

    def touch(self, block_hashes):
        self.policy.touch(block_hashes)

    def complete_load(self, block_hashes):
        for key in block_hashes:
            block = self.policy.get(key)
            if block is None or block.ref_cnt <= 0:
                raise ValueError("complete_load of a block that is not being loaded")
            block.ref_cnt -= 1

    def prepare_store(self, block_hashes):
        # Already stored or being stored: skip. dict.fromkeys drops repeats, keeping the order.
        to_store = [k for k in dict.fromkeys(block_hashes) if self.policy.get(k) is None]
        # The request's own blocks that are already here must still be here after this call.
        evicted = self._evict(len(to_store) - self.num_free_blocks, set(block_hashes))
        if evicted is None:
            return None
        block_ids = [self.free_block_ids.pop() for _ in to_store]
        for key, block_id in zip(to_store, block_ids):
            self.policy.insert(key, BlockStatus(block_id))  # ref_cnt -1: being stored
        return PrepareStoreOutput(to_store, LoadStoreSpec(block_ids, "CPU"), evicted)

    def complete_store(self, block_hashes, success=True):
        stored = []
        for key in block_hashes:
            block = self.policy.get(key)
            if block is None or block.is_ready:  # not being stored (a repeat, stored earlier)
                continue
            if success:
                block.ref_cnt = 0  # ready and idle: loadable, and evictable
                stored.append(key)
            else:
                self.policy.remove(key)
                self.free_block_ids.append(block.block_id)
        self.stats.stored_blocks += len(stored)
        self._emit(stored, removed=False)

    def reserve_blocks(self, n: int) -> list[int] | None:
        """Take n host blocks outside the cache (to swap out a preempted request), evicting idle
        cached blocks if the free list is short; None (nothing changed) if that is impossible."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} blocks")
        if self._evict(n - self.num_free_blocks, set()) is None:
            return None
        block_ids = [self.free_block_ids.pop() for _ in range(n)]
        self.reserved.update(block_ids)
        return block_ids

    def release_blocks(self, block_ids: list[int]) -> None:
        if not self.reserved.issuperset(block_ids) or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"release of host blocks that are not reserved: {block_ids}")
        self.reserved.difference_update(block_ids)
        self.free_block_ids.extend(block_ids)

    def reset_cache(self) -> bool:
        """Drop every cached block if all are ready and unpinned; else change nothing, return False.
        Reserved (swapped-out) blocks are not cache and stay."""
        entries = list(self.policy.items())
        if any(block.ref_cnt != 0 for _, block in entries):
            return False
        self.policy.clear()
        self.free_block_ids.extend(block.block_id for _, block in entries)
        self._emit([key for key, _ in entries], removed=True)
        return True

    def take_events(self):
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events
