"""Eviction policies of the host KV tier: which offloaded block to drop when the host is full.

The host tier holds KV blocks keyed by their block hash (part 07). Each entry is a `BlockStatus`:
the host block id that holds the bytes and a reference count, where ref_cnt -1 means "being
stored" (the copy from the device has not finished, the bytes are not there yet), 0 means "ready
and idle" and n > 0 means "ready, and n loads are reading it". Only ready idle blocks may be
evicted: dropping a block mid-load would hand a request garbage, and dropping one mid-store would
let the copy land in a block that someone else now owns.

A policy decides two things at once, the order it keeps blocks in and which one goes first, so
both live in one object (`CachePolicy`):

* LRU keeps one list in recency order and drops the least recently used idle block. Its weakness
  is a *scan*: a burst of blocks used once (a long one-off document) pushes out everything older,
  including a small hot set (a shared system prompt) that is re-read all the time.
* ARC (Megiddo and Modha, 2003) keeps two lists: T1 for blocks seen once, T2 for blocks seen at
  least twice. It also remembers the keys (not the bytes) of blocks it recently dropped, in the
  ghost lists B1 (dropped from T1) and B2 (dropped from T2). A request for a key in B1 says "T1 was
  too small", so the target size of T1 grows; a key in B2 says the opposite. A scan only churns
  T1, and the hot set, once promoted to T2, survives it.

`evict(n, protected)` is atomic: it either finds n idle, unprotected blocks and removes them, or
returns None and changes nothing, so a caller never has to undo half an eviction.

In vLLM: vllm/v1/kv_offload/cpu/policies/base.py (CachePolicy, BlockStatus), cpu/policies/lru.py,
cpu/policies/arc.py and cpu/policies/factory.py (v0.33.0); in the 2025 design the policy lived
inside the manager (v0.11.0: vllm/v1/kv_offload/lru_manager.py; ARC came as arc_manager.py in
PR #27039). One difference from vLLM's arc.py: there a key found in a ghost list is re-inserted in
T1; we follow the paper and insert it in T2, since it has now been asked for twice."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

BlockHash = bytes


@dataclass
class BlockStatus:
    block_id: int  # the host block that holds (or will hold) the bytes
    ref_cnt: int = -1  # -1: being stored; 0: ready and idle; n > 0: n loads reading it

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


Evicted = list[tuple[BlockHash, BlockStatus]]


def _idle(entries: Iterable[tuple[BlockHash, BlockStatus]], protected: set[BlockHash]) -> Iterator:
    """The evictable entries of `entries`, oldest first: ready, unpinned, not protected."""
    return ((k, b) for k, b in entries if b.ref_cnt == 0 and k not in protected)


class CachePolicy(ABC):
    """Order and replacement of the host tier's blocks; the ref counts are the caller's."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # host blocks; ARC sizes its ghost lists and target with it

    @abstractmethod
    def get(self, key: BlockHash) -> BlockStatus | None:
        """The resident entry for `key` (ghosts are not resident), or None."""

    @abstractmethod
    def insert(self, key: BlockHash, block: BlockStatus) -> None:
        """Add a block that has just been allocated (it is usually still being stored)."""

    @abstractmethod
    def remove(self, key: BlockHash) -> None:
        """Drop a resident block without remembering it (a failed store)."""

    @abstractmethod
    def touch(self, keys: Iterable[BlockHash]) -> None:
        """Record a use of `keys`, a request's blocks in prefix order."""

    @abstractmethod
    def evict(self, n: int, protected: set[BlockHash]) -> Evicted | None:
        """Remove n idle blocks not in `protected` and return them, or return None and change
        nothing if there are fewer than n such blocks."""

    @abstractmethod
    def items(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        """Every resident (key, block)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, ghosts and adaptive state included."""

    def __len__(self) -> int:
        return sum(1 for _ in self.items())


class LRUCachePolicy(CachePolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.blocks: OrderedDict[BlockHash, BlockStatus] = OrderedDict()  # LRU first, MRU last

    def get(self, key):
        return self.blocks.get(key)

    def insert(self, key, block):
        self.blocks[key] = block

    def remove(self, key):
        self.blocks.pop(key, None)

    def touch(self, keys):
        # Reversed: the first block of a prefix ends up most recent. Leading blocks are shared by
        # more requests (every longer prompt starts with them), so they should outlive the tail.
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n, protected):
        victims = []
        for entry in _idle(self.blocks.items(), protected):
            if len(victims) == n:
                break
            victims.append(entry)
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.blocks[key]
        return victims

    def items(self):
        return iter(list(self.blocks.items()))

    def clear(self):
        self.blocks.clear()


class ARCCachePolicy(CachePolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1: OrderedDict[BlockHash, BlockStatus] = OrderedDict()  # seen once, LRU first
        self.t2: OrderedDict[BlockHash, BlockStatus] = OrderedDict()  # seen twice or more
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()  # keys recently evicted from T1
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()  # keys recently evicted from T2
        self.target_t1_size = 0.0  # ARC's p: how many resident blocks T1 should hold

    def get(self, key):
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key, block):
        was_ghost = key in self.b1 or key in self.b2
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        # A key that comes back after being evicted has been asked for twice: it is frequent.
        (self.t2 if was_ghost else self.t1)[key] = block

    def remove(self, key):
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys):
        for key in reversed(list(keys)):  # reversed: see LRUCachePolicy.touch
            if key in self.t1:
                block = self.t1.pop(key)
                # A block still being stored was only just inserted, not used a second time.
                (self.t2 if block.is_ready else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:  # T1 dropped it too early: give T1 more room
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + step, float(self.capacity))
                self.b1.move_to_end(key)
            elif key in self.b2:  # T2 dropped it too early: give T2 more room
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - step, 0.0)
                self.b2.move_to_end(key)

    def evict(self, n, protected):
        # Choose all n victims before touching anything, so that a None leaves no trace.
        t1_idle, t2_idle = _idle(self.t1.items(), protected), _idle(self.t2.items(), protected)
        t1_size, victims = len(self.t1), []  # victims: (key, block, from_t1)
        while len(victims) < n:
            # T1 above its target gives up its oldest idle block; otherwise T2 does. If the
            # preferred list has no idle block left, the other one must.
            order = [(t1_idle, True), (t2_idle, False)]
            if t1_size <= self.target_t1_size:
                order.reverse()
            for it, from_t1 in order:
                entry = next(it, None)
                if entry is not None:
                    victims.append((*entry, from_t1))
                    t1_size -= from_t1
                    break
            else:
                return None
        for key, _, from_t1 in victims:
            del (self.t1 if from_t1 else self.t2)[key]
            (self.b1 if from_t1 else self.b2)[key] = None
        for ghosts in (self.b1, self.b2):  # a ghost list never remembers more than the capacity
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [(key, block) for key, block, _ in victims]

    def items(self):
        return iter([*self.t1.items(), *self.t2.items()])

    def clear(self):
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0


CACHE_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


def make_cache_policy(name: str, capacity: int) -> CachePolicy:
    """The policy called `name` ("lru" or "arc") for a host tier of `capacity` blocks."""
    try:
        return CACHE_POLICIES[name](capacity)
    except KeyError:
        known = sorted(CACHE_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {known}") from None
