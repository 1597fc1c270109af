"""Engine configuration of this stage. The server's command-line flags are derived from it."""
from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "local HF folder or hub id "
                                                      "(default: the embedded SmolLM2-135M-Instruct)"})
    device: str | None = field(default=None, metadata={"help": "cuda or cpu (default: cuda if available)"})
    dtype: str | None = field(default=None, metadata={"help": "float32, bfloat16, float16 "
                                                      "(default: bf16 on cuda, fp32 on cpu)"})
    load_format: str = field(default="auto", metadata={"help": "auto: the checkpoint's weights; dummy: "
                                                       "random weights, only config.json is read "
                                                       "(benchmarks of shapes without weights)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the "
                                                              "model's, at most 8192)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory_mb: int = field(default=1024, metadata={"help": "memory budget of the KV block "
                                                            "pool, in MiB"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one batch"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget of one step (default: 1024 with chunked prefill, else max_model_len)"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split prompts longer than the step's budget into chunks over several steps "
                "(off: a whole prompt must fit in one step, as in part 05)"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "most tokens of one prompt in one step (0: no limit but the budget)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompt prefixes computed before (off: every prompt is "
                "computed in full, as in part 06)"})
    prefix_caching_hash_seed: str | None = field(default=None, metadata={
        "help": "root of the block-hash chain; fix it so that other processes compute the same "
                "block hashes (default: random, private to this process)"})
    kv_transfer_config: str | dict | None = field(default=None, metadata={
        "help": "a KV connector, as JSON with vLLM's fields: kv_connector (OffloadingConnector, "
                "ExampleConnector, NixlConnector), kv_role (kv_producer, kv_consumer, kv_both), "
                "engine_id, kv_ip, kv_port, kv_connector_extra_config, kv_load_failure_policy "
                "(fail, recompute)"})
    kv_offloading_size: float | None = field(default=None, metadata={
        "help": "GiB of host memory for a second tier of KV blocks (pinned on CUDA), over all "
                "tensor-parallel ranks: preempted requests swap there, prompt prefixes are kept "
                "there (default: no host tier)"})
    kv_offloading_eviction_policy: str = field(default="lru", metadata={
        "help": "which offloaded prefix block the host tier drops first: lru or arc"})
    preemption_mode: str = field(default="recompute", metadata={
        "help": "what happens to a preempted request's KV: recompute (dropped, recomputed later) or "
                "swap (copied to the host tier and back; recompute when the host tier is full)"})
    speculative_method: str | None = field(default=None, metadata={
        "help": "speculative decoding: ngram (prompt lookup) or draft_model (default: none)"})
    num_speculative_tokens: int = field(default=4, metadata={"help": "draft tokens per step (k)"})
    # vLLM's defaults: only a 5-token match is trusted. Shorter ones fire often in open-ended text
    # and are mostly rejected there, which costs compute (notebook 08).
    prompt_lookup_min: int = field(default=5, metadata={"help": "ngram: shortest n-gram to match"})
    prompt_lookup_max: int = field(default=5, metadata={"help": "ngram: longest n-gram to match"})
    speculative_model: str | None = field(default=None, metadata={
        "help": "draft_model: a smaller model with the target's vocabulary (default: the target's "
                "first --speculative-draft-layers layers, a layer-truncated self-draft)"})
    speculative_draft_layers: int = field(default=8, metadata={
        "help": "draft_model without --speculative-model: layers of the self-draft"})
    continuous_batching: bool = field(default=True, metadata={
        "help": "off: admit new requests only when the running batch is empty (static batching)"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "schedule and launch step N+1 before step N's tokens reach the host (off: part 04; "
                "always off with speculative decoding)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "shard the model over this many worker processes (GPUs), Megatron-style"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "MoE models: put whole experts on the tensor-parallel ranks (expert parallelism: "
                "all-to-all dispatch and combine) instead of splitting every expert"})
    distributed_executor_backend: str | None = field(default=None, metadata={
        "help": "uni: the model in the engine's process; mp: one worker process per rank "
                "(default: mp when tensor_parallel_size > 1)"})
    nnodes: int | None = field(default=None, metadata={
        "help": "machines the tensor-parallel group spans (default: $NNODES, else 1)"})
    node_rank: int | None = field(default=None, metadata={
        "help": "this machine's index, 0 runs the engine (default: $NODE_RANK or torchrun's "
                "$GROUP_RANK, else 0)"})
    master_addr: str | None = field(default=None, metadata={
        "help": "rendezvous address: node 0's (default: $MASTER_ADDR, else 127.0.0.1)"})
    master_port: int | None = field(default=None, metadata={
        "help": "rendezvous port (default: $MASTER_PORT, else a free port on one node)"})
    num_threads: int | None = field(default=None, metadata={
        "help": "CPU threads of each worker process (default: the cores divided among the "
                "node's ranks)"})
    execute_model_timeout_s: float = field(default=300.0, metadata={
        "help": "most seconds a step may take in the workers before the engine declares them failed"})
    engine_ready_timeout_s: float = field(default=600.0, metadata={
        "help": "most seconds the workers (and, with data parallelism, the engines) may take to load "
                "the model and say ready"})
    data_parallel_size: int = field(default=1, metadata={
        "help": "engine-core processes behind the API server, each a whole engine (>1: the server "
                "routes requests among them)"})
    data_parallel_size_local: int | None = field(default=None, metadata={
        "help": "how many of them this host starts (default: all; the rest connect from other "
                "hosts with --headless)"})
    data_parallel_start_rank: int = field(default=0, metadata={
        "help": "--headless: the first engine rank this host runs"})
    data_parallel_address: str = field(default="127.0.0.1", metadata={
        "help": "the API server's address for engine traffic (engines on other hosts connect to it)"})
    data_parallel_rpc_port: int | None = field(default=None, metadata={
        "help": "the first of the two ports engines connect to (default: free ports, one host only)"})
    engine_heartbeat_timeout_s: float = field(default=30.0, metadata={
        "help": "an engine core silent this long after it said ready is declared dead (its requests "
                "get a 503)"})
    multiprocess_engine_core: bool = field(default=False, metadata={
        "help": "with one engine: run it in a process of its own behind the API server (vLLM V1's "
                "layout; off: in the server's process, faster on a small CPU)"})
    routing_policy: str = field(default="least_loaded", metadata={
        "help": "round_robin, least_loaded (4 x waiting + running) or cache_aware (longest cached "
                "prefix, unless the load is imbalanced)"})
    use_triton: bool | None = field(default=None, metadata={"help": "Triton kernels (default: on "
                                                            "cuda) or the torch reference"})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs = {"default": f.default if f.default is not MISSING else None, "help": f.metadata.get("help")}
            if "bool" in str(f.type):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                parser.add_argument(flag, type=kind, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)


# --kv-transfer-config (part 13): a KV connector and its role, vLLM's JSON and field names. It is
# configuration, so it lives here and not beside the connectors: reading a command line imports no
# engine code (vLLM: vllm/config/kv_transfer.py).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'`."""
    kv_connector: str
    kv_role: str = "kv_both"  # kv_producer: only prefills for others; kv_consumer: only fetches
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"  # where this engine's workers serve their blocks (NixlConnector)
    kv_port: int = 0  # the first worker's port (rank r: kv_port + r); 0: free ports
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"  # a load that fails: "fail" the request, or "recompute" it

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be fail or recompute, got {self.kv_load_failure_policy!r}")

    @classmethod
    def from_cli(cls, value: str | dict | None) -> KVTransferConfig | None:
        """The flag's JSON (or an already parsed dict); unknown fields are refused, not ignored."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        data = json.loads(value) if isinstance(value, str) else dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "kv_connector" not in data:
            raise ValueError("kv_transfer_config needs kv_connector")
        return cls(**data)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
