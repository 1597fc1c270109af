"""The request router of a data-parallel serving layer: which engine gets this request?

With data parallelism, N engine processes each hold a full copy of the model and their own KV
cache, and one API server in front of them picks an engine for every new request. The engines
publish their queue lengths (waiting, running); the router turns those into a choice:

    round_robin   cycle over the live engines (blind to load and to cache contents)
    least_loaded  lowest load score 4 * waiting + running (a waiting request still owes its
                  whole prefill, so it counts more than one that is already decoding)
    cache_aware   send a request to the engine that already caches its prompt's prefix, unless
                  that would overload one engine; a prefix-cache hit skips that part of prefill

The cache-aware router cannot see the engines' caches; it remembers which block hashes it sent
where (an approximate, router-side copy, bounded by an LRU). Block hashes chain (part 07), so
the same hashes mean the same tokens after the same prefix, and any process using the same
hash seed computes them without talking to the engines.

In vLLM: vllm/v1/engine/core_client.py (DPLBAsyncMPClient.get_core_engine_for_request).
In SGLang: sgl-router's cache_aware policy (a radix tree of text per worker, same thresholds)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .config import ROUTING_POLICIES

BlockHash = bytes


@dataclass
class EngineLoad:
    """One engine's queue lengths, as last reported by it (so possibly a little stale)."""
    waiting: int = 0
    running: int = 0

    @property
    def score(self) -> int:
        return 4 * self.waiting + self.running  # vLLM's load score


class Router:
    """Picks an engine index for each request. Subclasses implement `_choose`."""

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.dead: set[int] = set()

    def route(self, block_hashes: list[BlockHash], loads: list[EngineLoad]) -> int:
        if len(loads) != self.num_engines:
            raise ValueError(f"expected {self.num_engines} loads, got {len(loads)}")
        live = [e for e in range(self.num_engines) if e not in self.dead]
        if not live:
            raise RuntimeError("no engine is alive")
        return self._choose(block_hashes, loads, live)

    def forget(self, engine: int) -> None:
        """The engine died: never route there again and drop what we knew about it."""
        self.dead.add(engine)

    def _choose(self, block_hashes: list[BlockHash], loads: list[EngineLoad], live: list[int]) -> int:
        raise NotImplementedError


class RoundRobinRouter(Router):
    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0

    def _choose(self, block_hashes, loads, live) -> int:
        # The first live engine at or after the cursor: a dead engine is skipped, not retried.
        engine = next((e for e in live if e >= self._next), live[0])
        self._next = engine + 1
        return engine


class LeastLoadedRouter(Router):
    """Lowest score wins. Ties go to the first tied engine at or after a rotating cursor, not
    to the lowest index: loads are reported with a delay, so a burst of requests sees the same
    (e.g. all-zero) loads, and lowest-index would pile the whole burst onto engine 0. vLLM rotates
    its scan start the same way, and also bumps the chosen engine's local waiting count until the
    next stats report (here the caller owns `loads`, so that is the caller's job)."""

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0

    def _choose(self, block_hashes, loads, live) -> int:
        best = min(loads[e].score for e in live)
        tied = [e for e in live if loads[e].score == best]
        engine = next((e for e in tied if e >= self._next), tied[0])
        self._next = engine + 1
        return engine


class CacheAwareRouter(Router):
    """SGLang's cache-aware rule over block hashes instead of a radix tree of text.

    1. Imbalanced (max - min score > balance_abs_threshold AND max > balance_rel_threshold * min,
       among live engines): least-loaded. Both must hold: a small absolute gap is noise, and a
       large absolute gap between two busy engines is a small relative one.
    2. Best prefix match >= cache_threshold of the request's blocks: the longest match (ties:
       lower score). Below that a hit saves too little prefill to be worth a queue.
    3. Otherwise least-loaded, ties to the engine remembering fewer blocks, so new prefixes
       spread over the caches (SGLang picks the smallest tree outright; here load comes first).
    In every case the request's hashes are recorded under the chosen engine: it will cache them."""

    def __init__(self, num_engines: int, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_blocks_per_engine: int = 100_000) -> None:
        super().__init__(num_engines)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks_per_engine = max_blocks_per_engine
        # Per engine, an LRU of block hashes: oldest first, so popitem(last=False) evicts.
        self.blocks: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_engines)]

    def prefix_match(self, engine: int, block_hashes: list[BlockHash]) -> int:
        """Leading blocks of the request this engine (probably) caches. Stop at the first miss:
        an engine's KV for block i is useless without blocks 0..i-1, and a later hash present
        without its parent only means an eviction happened."""
        known, n = self.blocks[engine], 0
        for h in block_hashes:
            if h not in known:
                break
            n += 1
        return n

    def _choose(self, block_hashes, loads, live) -> int:
        score = {e: loads[e].score for e in live}
        hi, lo = max(score.values()), min(score.values())
        imbalanced = hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo
        engine = None
        if block_hashes and not imbalanced:
            match = {e: self.prefix_match(e, block_hashes) for e in live}
            if max(match.values()) / len(block_hashes) >= self.cache_threshold:
                engine = min(live, key=lambda e: (-match[e], score[e], e))
        if engine is None:
            engine = min(live, key=lambda e: (score[e], len(self.blocks[e]), e))
        self._record(engine, block_hashes)
        return engine

    def _record(self, engine: int, block_hashes: list[BlockHash]) -> None:
        known = self.blocks[engine]
        # Reversed, so a prompt's first block ends up most recent and its tail is evicted first:
        # evicting a prefix's head would make the rest of it unmatchable (the engine's own
        # block pool frees blocks tail-first for the same reason).
        for h in reversed(block_hashes):
            known[h] = None
            known.move_to_end(h)  # refresh a hash that was already there
        while len(known) > self.max_blocks_per_engine:
            known.popitem(last=False)

    def forget(self, engine: int) -> None:
        super().forget(engine)
        self.blocks[engine].clear()


def make_router(policy: str, num_engines: int) -> Router:
    classes = {"round_robin": RoundRobinRouter, "least_loaded": LeastLoadedRouter,
               "cache_aware": CacheAwareRouter}
    if policy not in classes:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(ROUTING_POLICIES)}")
    return classes[policy](num_engines)
