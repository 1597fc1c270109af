"""The worker's half of the OffloadingConnector (part 12's host KV tier behind part 13's connector
interface): the host blocks themselves, and the copies between them and the device pool.

The host pool has the device pool's layout, [layers, host blocks, block size, KV heads, head dim],
for K and for V (pinned memory on CUDA, so copies can run asynchronously; plain memory on a CPU,
where the "device" pool is the engine's KV tensor and a copy is a memcpy). Each step the scheduler's
side sends three lists of jobs (OffloadMetadata), each a list of (source block, destination block)
pairs:

* **swap-outs** (device -> host), done before the step's forward: the scheduler has already handed
  the victim's device blocks to other sequences, and this forward may overwrite them. On CUDA the
  copy runs on its own stream and the compute stream waits for it on the device, not the host.
* **loads** (host -> device), started before the forward and run alongside it, into device blocks
  no running sequence touches; the sequence that needs them waits (in the scheduler) until the load
  is reported done. A load gates only its own request.
* **stores** (device -> host), started after the forward (which wrote the blocks) and run while the
  next steps compute; the scheduler keeps the blocks from being reused until the store is done. A
  step never waits for a store.

Completions are counted in order (jobs of one kind run one after the other): finished loads are
reported by the sequence they were for (`finished_recving`), stores as a count. With tensor
parallelism every rank copies its own heads, and a job is done when every rank has done it (the
smallest count, one all-reduce per step).

In vLLM: vllm/v1/kv_offload/worker/cpu_gpu.py (v0.11.0: CpuGpuOffloadingHandler, a d2h and an h2d
stream, one event per job) and vllm/v1/kv_offload/cpu/gpu_worker.py (v0.33.0); V0's swap ran in
vllm/worker/cache_engine.py (swap_in / swap_out, v0.8.5)."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import KVTransferConfig
from .kv_connector import KVConnectorBase, KVConnectorOutput, KVConnectorRole


@dataclass
class TransferJob:
    job_id: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    req_id: str = ""  # a load's sequence


@dataclass
class OffloadMetadata:
    """What the scheduler's side asks of the workers in one step."""
    swap_outs: list[TransferJob] = field(default_factory=list)  # device -> host, before the forward
    loads: list[TransferJob] = field(default_factory=list)  # host -> device, asynchronous
    stores: list[TransferJob] = field(default_factory=list)  # device -> host, after the forward

    def __bool__(self) -> bool:
        return bool(self.swap_outs or self.loads or self.stores)


@dataclass
class OffloadOutput:
    """How far the workers are: stores done so far, in order, and what the copies cost since the last report."""
    stores_done: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_time_s: float = 0.0
    store_time_s: float = 0.0
    bytes_swapped_out: int = 0
    swap_out_time_s: float = 0.0


class _Copier:
    """One direction's copies, in order, off the main thread: a thread on the CPU, a stream and one
    event per job on CUDA (polled, never waited on)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done = 0
        self.bytes = 0
        self.seconds = 0.0
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.events: list[tuple[torch.cuda.Event, int, float]] = []
        else:
            self.jobs: queue.SimpleQueue = queue.SimpleQueue()
            self.lock = threading.Lock()
            self.thread = threading.Thread(target=self._run, name="kv-copy", daemon=True)
            self.thread.start()

    def submit(self, copy, nbytes: int, after_compute: bool) -> None:
        if self.cuda:
            if after_compute:  # the forward wrote the source blocks: copy after it, on the device
                self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                copy()
                event = torch.cuda.Event()
                event.record()
            self.events.append((event, nbytes, time.perf_counter()))
        else:
            self.jobs.put((copy, nbytes))

    def _run(self) -> None:
        while (item := self.jobs.get()) is not None:
            copy, nbytes = item
            start = time.perf_counter()
            copy()
            with self.lock:
                self.done += 1
                self.bytes += nbytes
                self.seconds += time.perf_counter() - start

    def poll(self) -> tuple[int, int, float]:
        """(jobs done so far, bytes and seconds since the last poll)."""
        if self.cuda:
            while self.events and self.events[0][0].query():
                _, nbytes, start = self.events.pop(0)
                self.done += 1
                self.bytes += nbytes
                self.seconds += time.perf_counter() - start  # an upper bound: polled once a step
            nbytes, seconds, self.bytes, self.seconds = self.bytes, self.seconds, 0, 0.0
            return self.done, nbytes, seconds
        with self.lock:
            nbytes, seconds, self.bytes, self.seconds = self.bytes, self.seconds, 0, 0.0
            return self.done, nbytes, seconds

    def close(self) -> None:
        if not self.cuda:
            self.jobs.put(None)
            self.thread.join(timeout=10)


class OffloadWorker(KVConnectorBase):
    """Plugged into a ModelRunner through its KV-connector hooks (part 09's seam)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, *, device: torch.device,
                 tp_size: int, bytes_per_block: int, **_):
        super().__init__(config, role, block_size)
        # The size is over all ranks, as vLLM's --kv-offloading-size (cpu_bytes_to_use) is.
        per_rank = config.kv_connector_extra_config["cpu_bytes_to_use"] // tp_size
        self.num_host_blocks, self.device = per_rank // bytes_per_block, device
        if self.num_host_blocks < 1:
            raise ValueError(f"kv_offloading_size of {per_rank * tp_size / 2**30:.3g} GiB holds no KV block")
        self.load_ids: list[str] = []  # the sequences of the loads submitted, in order
        self.loads_reported = 0
        self.meta: OffloadMetadata | None = None
        self.loader, self.storer = _Copier(device), _Copier(device)
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.swapped_bytes, self.swap_seconds = 0, 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def register_kv_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.device_kv = (k_cache, v_cache)
        shape = (k_cache.shape[0], self.num_host_blocks, *k_cache.shape[2:])
        pin = self.device.type == "cuda"
        self.host_kv = tuple(torch.zeros(shape, dtype=k_cache.dtype, pin_memory=pin) for _ in range(2))
        self.block_bytes = 2 * k_cache[:, 0].nbytes  # K and V of one block, every layer

    def bind_connector_metadata(self, meta: OffloadMetadata | None) -> None:
        self.meta = meta

    def start_load_kv(self) -> None:
        meta = self.meta
        if not meta:
            return
        start = time.perf_counter()
        for job in meta.swap_outs:  # before the forward, which may reuse these device blocks
            copy = self._copier(self.device_kv, self.host_kv, job)
            if self.swap_stream is not None:  # ordered on the device: the host does not wait
                compute = torch.cuda.current_stream()
                self.swap_stream.wait_stream(compute)
                with torch.cuda.stream(self.swap_stream):
                    copy()
                compute.wait_stream(self.swap_stream)
            else:
                copy()
            self.swapped_bytes += len(job.src_block_ids) * self.block_bytes
        if meta.swap_outs:
            self.swap_seconds += time.perf_counter() - start
        for job in meta.loads:
            self.load_ids.append(job.req_id)
            self.loader.submit(self._copier(self.host_kv, self.device_kv, job),
                               len(job.src_block_ids) * self.block_bytes, after_compute=False)

    def wait_for_save(self) -> None:
        if self.meta:
            for job in self.meta.stores:  # the forward has written these blocks: copy them out now
                self.storer.submit(self._copier(self.device_kv, self.host_kv, job),
                                   len(job.src_block_ids) * self.block_bytes, after_compute=True)

    def get_finished(self) -> KVConnectorOutput:
        loads, lb, lt = self.loader.poll()
        stores, sb, st = self.storer.poll()
        if self.world > 1:  # a job is done when every rank has done it
            done = torch.tensor([loads, stores], dtype=torch.long, device=self.device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            loads, stores = done.tolist()
        finished = set(self.load_ids[self.loads_reported:loads])
        self.loads_reported = loads
        extra = OffloadOutput(stores, lb, sb, lt, st, self.swapped_bytes, self.swap_seconds)
        self.swapped_bytes, self.swap_seconds = 0, 0.0
        return KVConnectorOutput(finished_recving=finished, extra=extra)

    def clear_connector_metadata(self) -> None:
        self.meta = None

    def info(self) -> dict:
        return {"num_host_blocks": self.num_host_blocks}

    def shutdown(self) -> None:
        self.loader.close()
        self.storer.close()

    @staticmethod
    def _copier(src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor], job: TransferJob):
        """The copy of one job's blocks, every layer, K and V (a function, to run where it is sent)."""
        @torch.inference_mode()
        def copy() -> None:
            s = torch.tensor(job.src_block_ids, dtype=torch.long, device=src[0].device)
            d = torch.tensor(job.dst_block_ids, dtype=torch.long, device=dst[0].device)
            for a, b in zip(src, dst):
                b.index_copy_(1, d, a.index_select(1, s).to(b.device, non_blocking=True))
        return copy
