"""The scheduler's half of the OffloadingConnector (part 12's host KV tier, now behind part 13's
connector interface): what to swap, load and store each step, and what to do when the workers report
a transfer done. Part 12's behaviour is unchanged; only who calls what moved: the scheduler asks every
connector the same questions (get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, update_connector_output), and this one answers them with the host tier.

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

from .block_pool import KVCacheBlock
from .config import KVTransferConfig
from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from .offload_manager import CPUOffloadingManager
from .offload_worker import OffloadMetadata, TransferJob
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


class OffloadScheduler(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, *,
                 kv_cache_manager: KVCacheManager, worker_info: dict, **_):
        super().__init__(config, role, block_size)
        self.kv = kv_cache_manager
        policy = config.kv_connector_extra_config.get("eviction_policy", "lru")
        self.manager = CPUOffloadingManager(worker_info["num_host_blocks"], self.block_size, policy)
        self.meta = OffloadMetadata()  # the next step's jobs
        self.loads: dict[str, _Load] = {}  # seq_id -> its load in flight
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
        self._load(seq, seq.host_block_ids, self.kv.get_block_ids(seq.seq_id), _Load(seq, seq.host_block_ids))
        seq.host_block_ids = None
        self.stats.swaps_in += 1

    def drop_swapped(self, seq: Sequence) -> None:
        """A swapped sequence aborted: give its host blocks back (and its copy, if not yet sent)."""
        host = seq.host_block_ids
        self.meta.swap_outs = [j for j in self.meta.swap_outs if j.dst_block_ids is not host]
        self.manager.release_blocks(host)
        seq.host_block_ids = None

    # ---- prefix blocks ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after the device hit the host tier holds, in whole blocks, leaving at
        least the last token to compute (its logits are needed); loaded asynchronously. No side
        effects but recency."""
        full = (seq.num_tokens - 1) // self.block_size
        num_device_blocks = num_computed_tokens // self.block_size
        if not self.kv.enable_caching or full <= num_device_blocks:
            return 0, False
        self.kv.block_hasher.hash_new_full_blocks(seq)
        hashes = seq.block_hashes[num_device_blocks:full]
        self.manager.touch(hashes)
        return self.manager.lookup(hashes) * self.block_size, True

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Admitted (its num_computed_tokens is the device hit): count the lookup, and load the host
        blocks found after the hit into the device blocks allocated for them."""
        n_dev, n_host = seq.num_computed_tokens // self.block_size, num_external_tokens // self.block_size
        self.record_lookup(seq, n_dev, n_host)
        if n_host:
            hashes = seq.block_hashes[n_dev:n_dev + n_host]
            spec = self.manager.prepare_load(hashes)
            self._load(seq, spec.block_ids, block_ids[n_dev:n_dev + n_host], _Load(seq, spec.block_ids, hashes))

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
        self.meta.loads.append(TransferJob(self.next_load_id, host, device, seq.seq_id))
        self.loads[seq.seq_id] = load
        self.next_load_id += 1

    def build_connector_meta(self, scheduler_output) -> OffloadMetadata | None:
        """This step's jobs, for the workers (None when there are none): the swaps and loads decided
        while scheduling, and the stores of the prompt blocks this step computes."""
        for seq, _ in scheduler_output.scheduled:
            self.store_computed_prompt_blocks(seq)
        meta, self.meta = self.meta, OffloadMetadata()
        return meta or None

    def has_pending_work(self) -> bool:
        """Jobs to send or to hear back from: the engine keeps stepping (even with no tokens)."""
        return bool(self.meta or self.loads or self.stores)

    def reset_cache(self) -> bool:
        return self.manager.reset_cache()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Apply what the workers finished: stores become loadable host blocks and release their
        device blocks; finished loads unpin (prefix) or release (swap) their host blocks. (The
        scheduler moves the sequences, from `finished_recving`.)"""
        out, s = output.extra, self.stats
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
        for seq_id in output.finished_recving:
            load = self.loads.pop(seq_id)
            if load.block_hashes:
                self.manager.complete_load(load.block_hashes)
            else:  # a swap-in: its reserved host blocks are free again
                self.manager.release_blocks(load.host_block_ids)
        s.host_usage = self.manager.usage
