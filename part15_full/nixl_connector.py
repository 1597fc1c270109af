"""NixlConnector (the course's, over TCP): the decode engine pulls a prefill engine's KV blocks by id.

    prefill engine (P)                                   decode engine (D)
    request with do_remote_decode: prefill, 1 token      request with do_remote_prefill + P's params
    request_finished: keep the blocks (delay the free)   get_num_new_matched_tokens: the prompt but its
      -> kv_transfer_params: engine id, block ids,         last token, asynchronously; blocks allocated,
         host, port, request id, expiry                     the request waits (WAITING_FOR_REMOTE_KVS)
    worker: a side channel serves its held blocks ◀──── worker: handshake (engine id, block size,
      "handshake" / "read" (block ids) / "done"            layout, TP size), read, copy into its blocks,
    "done" (or the expiry) frees them: finished_sending    "done": finished_recving -> it runs the last
                                                           prompt token and decodes

Only the workers touch KV tensors: each rank serves and pulls its own heads (rank r to remote rank r;
both engines must have the same TP size and layout, which the handshake checks). A read that fails
(P died, its blocks expired, a timeout) is reported as failed and handled by
`kv_load_failure_policy`: recompute the prompt locally, or fail the request. A read that arrives
before P's workers have heard which blocks to hold gets "wait" and is retried.

vLLM's NixlConnector has the same shape and moves the blocks with RDMA (NIXL over UCX, libfabric),
the decode GPU reading the prefill GPU's memory with no CPU copy; here the bytes travel through a
ZeroMQ socket and host memory. NIXL (`pip install nixl`, CUDA only) and LMCache plug into vLLM as
connectors of their own (`NixlConnector`, `LMCacheConnectorV1`): the scheduler's contract above is
the part they share with this one.

In vLLM: vllm/distributed/kv_transfer/kv_connector/v1/nixl/ (v0.33.0: pull_scheduler.py,
pull_worker.py; the side channel's handshake; kv_transfer_params in request_finished), and
docs/features/nixl_connector_usage.md."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist
import zmq

from .config import KVTransferConfig
from .kv_connector import KVConnectorBase, KVConnectorOutput, KVConnectorRole

DEFAULT_EXPIRY_S = 120.0  # blocks of a prefill nobody reads are freed after this (vLLM: a lease)
DEFAULT_TIMEOUT_S = 30.0  # a read that gets no answer for this long fails


@dataclass
class RecvJob:
    seq_id: str  # the decode engine's sequence
    remote_request_id: str  # the prefill engine's
    host: str
    port: int
    engine_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class NixlMetadata:
    recvs: list[RecvJob] = field(default_factory=list)
    sends: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # seq_id -> (block ids, expiry)


class NixlConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, *, rank: int = 0,
                 tp_size: int = 1, device: torch.device | None = None, worker_info: dict | None = None, **_):
        super().__init__(config, role, block_size)
        extra = config.kv_connector_extra_config
        self.expiry_s = float(extra.get("blocks_expiry_s", DEFAULT_EXPIRY_S))
        self.timeout_s = float(extra.get("transfer_timeout_s", DEFAULT_TIMEOUT_S))
        self.rank, self.tp_size, self.device = rank, tp_size, device
        if tp_size > 1 and not config.kv_port:
            raise ValueError("NixlConnector at tensor_parallel_size > 1 needs a fixed kv_port (rank r serves on "
                             "kv_port + r)")
        self.meta = NixlMetadata()
        self.loading: set[str] = set()  # request ids with a remote prefill in flight (scheduler)
        self.worker_info = worker_info or {}

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = seq.request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or not self.config.is_consumer:
            return 0, False
        if seq.state.index > 0:  # the request's first sequence pulls; the others find it cached after
            return (None, False) if seq.request.request_id in self.loading else (0, False)
        # Every prompt token but the last, which this engine computes (its logits are the first sample).
        return max(len(seq.request.prompt_token_ids) - 1 - num_computed_tokens, 0), True

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        p = seq.request.kv_transfer_params
        first = seq.num_computed_tokens // self.block_size
        last = -(-(seq.num_computed_tokens + num_external_tokens) // self.block_size)
        self.meta.recvs.append(RecvJob(seq.seq_id, p["remote_request_id"], p["remote_host"], int(p["remote_port"]),
                                       p["remote_engine_id"], list(p["remote_block_ids"][first:last]),
                                       block_ids[first:last]))
        self.loading.add(seq.request.request_id)

    def build_connector_meta(self, scheduler_output) -> NixlMetadata | None:
        meta, self.meta = self.meta, NixlMetadata()
        return meta if meta.recvs or meta.sends else None

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = seq.request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or not self.config.is_producer or seq.state.finish_reason == "abort":
            return False, None
        expiry = time.time() + self.expiry_s
        self.meta.sends[seq.seq_id] = (block_ids, expiry)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
                      "remote_block_ids": block_ids, "remote_host": self.config.kv_ip,
                      "remote_port": self.worker_info["port"], "remote_request_id": seq.seq_id,
                      "remote_blocks_expiry_time": expiry, "tp_size": self.tp_size}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for seq_id in output.finished_recving | output.failed_recving:
            self.loading.discard(seq_id.rsplit("-", 1)[0])  # seq ids are "<request id>-<index>"

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        super().register_kv_caches(k_cache, v_cache)
        self.layout = {"engine_id": self.config.engine_id, "block_size": self.block_size,
                       "shape": list(k_cache.shape[2:]), "num_layers": k_cache.shape[0],
                       "dtype": str(k_cache.dtype), "tp_size": self.tp_size}
        self.lock = threading.Lock()
        self.held: dict[str, tuple[list[int], float]] = {}  # seq_id -> (block ids, expiry): readable
        self.sent: set[str] = set()  # read and released, or expired: to report
        self.gone: set[str] = set()  # ids no longer held (a late read gets an error, not "wait")
        self.recv_done: set[str] = set()
        self.recv_failed: set[str] = set()
        self.bytes_received = self.blocks_received = 0  # what this worker pulled, for the lesson's counters
        self.pull_seconds = 0.0
        self.ctx = zmq.Context()
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        if self.config.kv_port:
            self.port = self.config.kv_port + self.rank
            self.server.bind(f"tcp://{self.config.kv_ip}:{self.port}")
        else:
            self.port = self.server.bind_to_random_port(f"tcp://{self.config.kv_ip}")
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._serve, name="kv-side-channel", daemon=True),
                        threading.Thread(target=self._pull, name="kv-puller", daemon=True)]
        for t in self.threads:
            t.start()

    def info(self) -> dict:
        return {"port": self.port - self.rank}  # rank 0's; rank r serves on port + r

    def bind_connector_metadata(self, metadata: NixlMetadata | None) -> None:
        self.metadata = metadata
        if metadata:
            with self.lock:
                self.held.update(metadata.sends)

    def start_load_kv(self) -> None:
        for job in self.metadata.recvs if self.metadata else ():
            self.jobs.put(job)  # pulled on the puller thread: this step does not wait

    def get_finished(self) -> KVConnectorOutput:
        now = time.time()
        with self.lock:
            for seq_id, (_, expiry) in list(self.held.items()):
                if now > expiry:  # nobody read them in time: free them anyway
                    del self.held[seq_id]
                    self.gone.add(seq_id)
                    self.sent.add(seq_id)
            out = KVConnectorOutput(self.sent, self.recv_done, self.recv_failed)
            self.sent, self.recv_done, self.recv_failed = set(), set(), set()
        if self.tp_size > 1:  # done when every rank is done: report only what all ranks report
            out = self._agree(out)
        return out

    def _agree(self, out: KVConnectorOutput) -> KVConnectorOutput:
        """Every rank reports the same: what all ranks have finished (a load failed on any rank fails)."""
        self.unreported = [have | new for have, new in zip(getattr(self, "unreported", (set(), set(), set())),
                                                            (out.finished_sending, out.finished_recving,
                                                             out.failed_recving))]
        ranks: list = [None] * self.tp_size
        dist.all_gather_object(ranks, self.unreported)
        sending = set.intersection(*[r[0] for r in ranks])
        settled = set.intersection(*[r[1] | r[2] for r in ranks])  # every rank is done with these loads
        failed = settled & set().union(*[r[2] for r in ranks])
        self.unreported = [self.unreported[0] - sending, self.unreported[1] - settled, self.unreported[2] - settled]
        return KVConnectorOutput(sending, settled - failed, failed)

    def shutdown(self) -> None:
        self.stopping.set()
        self.jobs.put(None)
        for t in getattr(self, "threads", ()):
            t.join(timeout=5)
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)

    # ---- the prefill side's side channel ------------------------------------------------------

    def _serve(self) -> None:
        k_cache, v_cache = self.kv_caches
        while not self.stopping.is_set():
            if not self.server.poll(100):
                continue
            identity, kind, payload = self.server.recv_multipart()
            msg = msgspec.msgpack.decode(payload) if payload else {}
            if kind == b"handshake":
                self.server.send_multipart([identity, b"ok", msgspec.msgpack.encode(self.layout)])
            elif kind == b"read":
                with self.lock:
                    held = self.held.get(msg["request_id"])
                    gone = msg["request_id"] in self.gone
                if held is None:
                    self.server.send_multipart([identity, b"gone" if gone else b"wait", b""])
                elif not set(msg["block_ids"]) <= set(held[0]):
                    self.server.send_multipart([identity, b"gone", b""])
                else:  # the blocks are held for this request: nobody writes them
                    ids = torch.tensor(msg["block_ids"], device=k_cache.device)
                    k, v = (c[:, ids].contiguous().cpu() for c in (k_cache, v_cache))
                    self.server.send_multipart([identity, b"ok", k.view(torch.uint8).numpy().tobytes(),
                                                v.view(torch.uint8).numpy().tobytes()])
            elif kind == b"done":
                with self.lock:
                    if self.held.pop(msg["request_id"], None) is not None:
                        self.gone.add(msg["request_id"])
                        self.sent.add(msg["request_id"])
                self.server.send_multipart([identity, b"ok", b""])

    # ---- the decode side's puller -------------------------------------------------------------

    def _pull(self) -> None:
        peers: dict[tuple[str, int], zmq.Socket] = {}
        while (job := self.jobs.get()) is not None:
            try:
                self._pull_one(job, peers)
                done = self.recv_done
            except Exception:  # noqa: BLE001: P gone, a timeout, a mismatch: the policy decides
                done = self.recv_failed
                sock = peers.pop((job.host, job.port + self.rank), None)
                if sock is not None:
                    sock.close(linger=0)
            with self.lock:
                done.add(job.seq_id)

    def _pull_one(self, job: RecvJob, peers: dict) -> None:
        start = time.perf_counter()
        k_cache, v_cache = self.kv_caches
        address = (job.host, job.port + self.rank)
        sock = peers.get(address)
        if sock is None:
            sock = peers[address] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            layout = msgspec.msgpack.decode(self._ask(sock, b"handshake", {})[0])
            mine = dict(self.layout, engine_id=job.engine_id)
            if layout != mine:
                raise ValueError(f"the remote engine's KV layout {layout} differs from this one's {mine}")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._ask(sock, b"read", {"request_id": job.remote_request_id, "block_ids": job.remote_block_ids},
                              deadline)
            if reply is not None:
                break
            time.sleep(0.005)  # its workers have not heard yet which blocks to hold
        shape = (k_cache.shape[0], len(job.remote_block_ids), *k_cache.shape[2:])
        ids = torch.tensor(job.local_block_ids, device=k_cache.device)
        for cache, data in zip((k_cache, v_cache), reply):
            blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(k_cache.dtype).view(shape)
            cache.index_copy_(1, ids, blocks.to(cache.device))
            self.bytes_received += len(data)
        self.blocks_received += len(job.local_block_ids)
        self.pull_seconds += time.perf_counter() - start
        self._ask(sock, b"done", {"request_id": job.remote_request_id}, deadline)

    def _ask(self, sock: zmq.Socket, kind: bytes, msg: dict, deadline: float | None = None):
        """Send a request, wait for its answer; None for "wait"; raises for "gone" or a timeout."""
        sock.send_multipart([kind, msgspec.msgpack.encode(msg)])
        left = (deadline or time.monotonic() + self.timeout_s) - time.monotonic()
        if left <= 0 or not sock.poll(left * 1000):
            raise TimeoutError(f"no answer from the prefill engine within {self.timeout_s} s")
        status, *frames = sock.recv_multipart()
        if status == b"wait":
            return None
        if status != b"ok":
            raise RuntimeError(f"the prefill engine no longer holds these blocks ({status.decode()})")
        return frames
