"""The KV connector: one interface for everything that moves KV blocks in or out of the engine's pool.

A connector has two halves, as in vLLM V1 (`KVConnectorBase_V1`): one in the scheduler (it decides
and keeps the books) and one in every worker (it owns the copies and sees the KV tensors). They talk
only through each step: the scheduler half builds a metadata object that travels to the workers
with the step (part 09's seam), and the worker half reports which transfers finished in the step's
output.

    scheduler half                                          worker half
    get_num_new_matched_tokens(seq, computed)               register_kv_caches(k, v)
      -> (tokens beyond the device hit, async?)             bind_connector_metadata(meta)
    update_state_after_alloc(seq, block_ids, tokens)        start_load_kv()          before the forward
    build_connector_meta(scheduler_output) -> meta ───────▶ wait_for_layer_load(i)   in layer i
    request_finished(seq, block_ids)                        save_kv_layer(i, k, v)   in layer i
      -> (free later?, kv_transfer_params)                  wait_for_save()          after the forward
    update_connector_output(output) ◀────────────────────── get_finished() -> KVConnectorOutput

The scheduler's side of the contract: a sequence whose external tokens arrive asynchronously waits
(WAITING_FOR_REMOTE_KVS, here `Scheduler.loading`) until a step reports it in `finished_recving`;
the blocks of a finished sequence whose connector asked to free them later are freed when a step
reports it in `finished_sending`; a load that failed is handled by `kv_load_failure_policy`.

Three connectors implement it (offload_scheduler.py with offload_worker.py, example_connector.py,
nixl_connector.py). They import this module and it imports none of them: kv_connector_factory.py
builds one by its name (`make_connector`, imported here for the engine and the workers). The
configuration, `--kv-transfer-config` with vLLM's JSON and field names, is config.py's KVTransferConfig.

In vLLM: vllm/distributed/kv_transfer/kv_connector/v1/base.py (KVConnectorBase_V1, KVConnectorRole,
KVConnectorMetadata), vllm/v1/worker/kv_connector_model_runner_mixin.py (the worker's calls around a
step) and vllm/model_executor/layers/attention/kv_transfer_utils.py (the per-layer calls)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import KVTransferConfig
from .kv_connector_factory import make_connector


class KVLoadFailed(RuntimeError):
    """A request's KV could not be loaded and kv_load_failure_policy is "fail": the client gets a 503."""


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorOutput:
    """What the workers report after a step: sequences whose KV finished leaving (their blocks may
    be freed) or arriving (they may run), and loads that failed. `extra`: the connector's own."""
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    extra: Any = None


class KVConnectorBase:
    """The interface; a connector overrides what it uses. The defaults do nothing and match nothing."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int):
        self.config, self.role, self.block_size = config, role, block_size

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens after the first `num_computed_tokens` (the device hit) this connector can
        supply, and whether they arrive asynchronously (the sequence then waits). None: ask again
        at a later step. No side effects: the scheduler may not admit the sequence after all."""
        return 0, False

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        """The sequence was admitted with its blocks: remember what to load into which."""

    def build_connector_meta(self, scheduler_output) -> Any:
        """This step's work for the worker halves; resets the per-step state."""
        return None

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A sequence finished: (keep its blocks until a step reports it sent?, kv_transfer_params
        for the API response)."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The connector's own bookkeeping of a step's report (the scheduler handles the id sets)."""

    def has_pending_work(self) -> bool:
        """Transfers of its own still to send or hear back from (the engine keeps stepping)."""
        return False

    def reset_cache(self) -> bool:
        """Forget what it caches (a cold start for benchmarks); False if it cannot now."""
        return True

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.kv_caches = (k_cache, v_cache)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.metadata = metadata

    def clear_connector_metadata(self) -> None:
        self.metadata = None

    def start_load_kv(self) -> None:
        """Before the forward: start (or, for a synchronous connector, do) this step's loads."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """In layer `layer_idx`, before its attention reads the cache: a layer-by-layer loader
        waits here for that layer only, so the transfer overlaps the layers before it."""

    def save_kv_layer(self, layer_idx: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata) -> None:
        """In layer `layer_idx`, after its K/V are written: a layer-by-layer saver starts here."""

    def wait_for_save(self) -> None:
        """After the forward: the step's saves are started (or done, for a synchronous connector)."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def info(self) -> dict:
        """What the scheduler half must know of this worker half (rank 0's is sent at start-up)."""
        return {}

    def shutdown(self) -> None:
        pass


def resolve_kv_transfer_config(config) -> KVTransferConfig | None:
    """An engine's connector: `--kv-transfer-config`, or `--kv-offloading-size`, which is shorthand for
    the OffloadingConnector (as vLLM's `_post_init_kv_transfer_config` makes it)."""
    kv = KVTransferConfig.from_cli(config.kv_transfer_config)
    if config.kv_offloading_size:
        if kv is not None:
            raise ValueError("give --kv-offloading-size or --kv-transfer-config, not both")
        kv = KVTransferConfig("OffloadingConnector", "kv_both", kv_connector_extra_config={
            "cpu_bytes_to_use": int(config.kv_offloading_size * 2**30),
            "eviction_policy": config.kv_offloading_eviction_policy})
    return kv

