"""The scheduler's side of the host KV tier: what to swap, load and store each step, and what to
do when the workers report a transfer done.

Two uses of one pool of host blocks (offload_manager.py keeps its books):

* **Swap on preemption** (`--preemption-mode swap`, vLLM V0's swap space). A victim's device blocks
  are copied to host blocks reserved for it (partial blocks included: they are the request's, not a
  prefix anyone else could reuse), its device blocks go back to the pool at once, and it waits in
  the swapped queue with its progress intact. When blocks free up it comes back before new prompts:
  fresh device blocks, a load from its host blocks, and it resumes where it stopped. When the host
  tier has no room, it is recomputed as before.
* **Offloaded prefix blocks** (vLLM V1's OffloadingConnector). Every full prompt block a step
  computes is stored to the host tier under its chained block hash (part 07), once. A new request
  whose prefix is partly missing from the device cache asks the host tier for the blocks that follow
  the device hit; those are loaded instead of computed.

Every transfer is a job with an id (one counter for loads, one for stores); the workers run each
kind in order and report how many they have finished, so "done" is a count. What a job must keep
alive until then: a load's device blocks belong to a sequence that waits (it is in
`Scheduler.loading`, and an abort there only marks it); a store's device blocks get one more holder
(`BlockPool.touch`) so no one reuses them mid-copy; host blocks being read are pinned, host blocks
being written are invisible until complete.

In vLLM: vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py (v0.11.0: the
scheduler side's lookups, prepare_store of newly full blocks, request_finished delaying the free
while stores are in flight; v0.33.0 splits it into offloading/{scheduler,worker}.py), and V0's swap
in vllm/core/scheduler.py (PreemptionMode.SWAP, the swapped queue, v0.8.5)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .block_pool import KVCacheBlock
from .kv_cache_manager import KVCacheManager
from .offload_manager import CPUOffloadingManager
from .offload_worker import OffloadMetadata, OffloadOutput, TransferJob
from .request import Sequence


@dataclass
class OffloadStats:
    """vLLM's meanings: bytes and seconds moved each way (the workers' copies), host-tier queries
    and hits in tokens, swaps out and in, and how full the host tier is."""
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_time_s: float = 0.0
    store_time_s: float = 0.0
    bytes_swapped_out: int = 0
    swap_out_time_s: float = 0.0
    host_queries: int = 0  # prompt tokens past the device hit, asked of the host tier
    host_hits: int = 0  # of those, found there and loaded
    swaps_out: int = 0
    swaps_in: int = 0
    swap_fallbacks: int = 0  # preemptions that wanted to swap but found no host room: recomputed
    host_usage: float = 0.0


@dataclass
class _Load:
    seq: Sequence
    host_block_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)  # a prefix load: unpin these when done
    num_computed_tokens: int = 0  # where the sequence stands once the load is in


class OffloadScheduler:
    def __init__(self, num_host_blocks: int, kv_cache_manager: KVCacheManager, eviction_policy: str = "lru"):
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.manager = CPUOffloadingManager(num_host_blocks, self.block_size, eviction_policy)
        self.meta = OffloadMetadata()  # the next step's jobs
        self.loads: deque[tuple[int, _Load]] = deque()  # (job id, what it is for), in order
        self.stores: deque[tuple[int, list[bytes], list[KVCacheBlock]]] = deque()
        self.next_load_id = self.next_store_id = 0
        self.loads_done = self.stores_done = 0
        self.stats = OffloadStats()

    # ---- swap ------------------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> bool:
        """Copy a victim's blocks to reserved host blocks (before this step's forward); False if the
        host tier has no room (then it is recomputed)."""
        device = self.kv.get_block_ids(seq.seq_id)
        host = self.manager.reserve_blocks(len(device)) if device else None
        if host is None:
            self.stats.swap_fallbacks += 1
            return False
        self.meta.swap_outs.append(TransferJob(-1, device, host))
        seq.host_block_ids = host
        self.stats.swaps_out += 1
        return True

    def swap_in(self, seq: Sequence) -> None:
        """Load a swapped sequence's blocks into the device blocks just allocated for it."""
        self._load(seq, seq.host_block_ids, self.kv.get_block_ids(seq.seq_id),
                   _Load(seq, seq.host_block_ids, num_computed_tokens=seq.num_computed_tokens))
        seq.host_block_ids = None
        self.stats.swaps_in += 1

    def drop_swapped(self, seq: Sequence) -> None:
        """A swapped sequence aborted: give its host blocks back (and its copy, if not yet sent)."""
        host = seq.host_block_ids
        self.meta.swap_outs = [j for j in self.meta.swap_outs if j.dst_block_ids is not host]
        self.manager.release_blocks(host)
        seq.host_block_ids = None

    # ---- prefix blocks ------------------------------------------------------------------------

    def lookup(self, seq: Sequence, num_device_blocks: int) -> int:
        """How many blocks after the device hit the host tier holds, leaving at least the last
        token to compute (its logits are needed). No side effects but recency."""
        full = (seq.num_tokens - 1) // self.block_size
        if not self.kv.enable_caching or full <= num_device_blocks:
            return 0
        self.kv.block_hasher.hash_new_full_blocks(seq)
        hashes = seq.block_hashes[num_device_blocks:full]
        self.manager.touch(hashes)
        hits = self.manager.lookup(hashes)
        return hits

    def load_prefix(self, seq: Sequence, num_device_blocks: int, num_host_blocks: int) -> None:
        """Load host blocks [num_device_blocks, + num_host_blocks) into the sequence's device blocks."""
        hashes = seq.block_hashes[num_device_blocks:num_device_blocks + num_host_blocks]
        spec = self.manager.prepare_load(hashes)
        device = self.kv.get_block_ids(seq.seq_id)[num_device_blocks:num_device_blocks + num_host_blocks]
        end = (num_device_blocks + num_host_blocks) * self.block_size
        self._load(seq, spec.block_ids, device, _Load(seq, spec.block_ids, hashes, end))

    def record_lookup(self, seq: Sequence, num_device_blocks: int, num_host_blocks: int) -> None:
        """Host-tier counters in tokens, once per request, when it is admitted (part 07 counts the
        device's; a resumed preempted request counts in neither)."""
        if self.kv.enable_caching and not seq.num_preemptions:
            self.stats.host_queries += seq.num_tokens - num_device_blocks * self.block_size
            self.stats.host_hits += num_host_blocks * self.block_size

    def store_computed_prompt_blocks(self, seq: Sequence) -> None:
        """After a step is scheduled: its newly computed full prompt blocks go to the host tier (vLLM's
        default, offload_prompt_only). Their device blocks get a holder until the copy is done."""
        if not self.kv.enable_caching:
            return
        end = min(seq.num_computed_tokens, len(seq.request.prompt_token_ids)) // self.block_size
        start = seq.num_offloaded_blocks
        if end <= start:
            return
        self.kv.block_hasher.hash_new_full_blocks(seq)
        seq.num_offloaded_blocks = end
        wanted = seq.block_hashes[start:end]
        out = self.manager.prepare_store(wanted)
        if out is None or not out.block_hashes_to_store:
            return
        index = {h: i for i, h in enumerate(seq.block_hashes)}
        blocks = self.kv.req_to_blocks[seq.seq_id]
        device = [blocks[index[h]] for h in out.block_hashes_to_store]
        self.kv.block_pool.touch(device)
        self.meta.stores.append(TransferJob(self.next_store_id, [b.block_id for b in device], out.store_spec.block_ids))
        self.stores.append((self.next_store_id, out.block_hashes_to_store, device))
        self.next_store_id += 1

    # ---- each step ----------------------------------------------------------------------------

    def _load(self, seq: Sequence, host: list[int], device: list[int], load: _Load) -> None:
        self.meta.loads.append(TransferJob(self.next_load_id, host, device))
        self.loads.append((self.next_load_id, load))
        self.next_load_id += 1

    def build_metadata(self) -> OffloadMetadata | None:
        """This step's jobs, for the workers (None when there are none)."""
        meta, self.meta = self.meta, OffloadMetadata()
        return meta or None

    @property
    def busy(self) -> bool:
        """Jobs to send or to hear back from: the engine keeps stepping (even with no tokens)."""
        return bool(self.meta or self.loads or self.stores)

    def update(self, out: OffloadOutput, on_loaded: Callable[[_Load], None]) -> None:
        """Apply what the workers finished: stores become loadable host blocks and release their
        device blocks; each finished load hands its sequence back (`on_loaded`)."""
        s = self.stats
        s.bytes_loaded += out.bytes_loaded
        s.bytes_stored += out.bytes_stored
        s.load_time_s += out.load_time_s
        s.store_time_s += out.store_time_s
        s.bytes_swapped_out += out.bytes_swapped_out
        s.swap_out_time_s += out.swap_out_time_s
        while self.stores and self.stores[0][0] < out.stores_done:
            _, hashes, device = self.stores.popleft()
            self.manager.complete_store(hashes)
            self.kv.block_pool.free_blocks(device)
        while self.loads and self.loads[0][0] < out.loads_done:
            _, load = self.loads.popleft()
            if load.block_hashes:
                self.manager.complete_load(load.block_hashes)
            else:  # a swap-in: its reserved host blocks are free again
                self.manager.release_blocks(load.host_block_ids)
            on_loaded(load)
        s.host_usage = self.manager.usage
