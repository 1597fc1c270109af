"""Engine configuration of this stage. The server's command-line flags are derived from it.

Every technique of the course is one or a few fields here. Some combinations cannot work together
(swap preemption and a draft model's KV cache, a host tier given twice, expert parallelism without
tensor-parallel ranks to put experts on, ...); `validate()` finds all of them at once and names the
flags, before any process is started or any weight is read, so a bad command line fails in a
second instead of after a model load. Every entry point calls it first: the server's main (with
--headless), LLMEngine (and with it the offline LLM and AsyncLLM) and the engine-core clients
(core_client.py). What depends on the loaded model (its context length) the engine checks once it
knows it. `summary()` is the effective configuration the server prints at start-up: what each
default resolved to on this device.

In vLLM: vllm/engine/arg_utils.py (EngineArgs: the flags, create_engine_config) and the
__post_init__/verify methods of vllm/config/ (VllmConfig and its parts), which refuse invalid
combinations; vLLM logs the resolved config as "Initializing a V1 LLM engine ... with config: ..."."""
from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from . import envs  # the switch registry (no engine code): the CUDA-graph stand-in for tests

if TYPE_CHECKING:
    import torch

# The choices that the engine's modules implement, named here (engine.py, router.py, quantization.py,
# structured_output/manager.py import them from here): checking a command line imports no engine code,
# and the configuration depends on nothing of the engine.
SPECULATIVE_METHODS = ("ngram", "draft_model")
ROUTING_POLICIES = ("round_robin", "least_loaded", "cache_aware")
QUANTIZATION_METHODS = ("int8", "int4", "gptq")  # gptq: read from the checkpoint, never applied online
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "course")
SCHEDULING_POLICIES = ("fcfs", "priority")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # reasoning_parsers.py's
# Names whose classes sit in registries of their own, cache_policy.CACHE_POLICIES and
# kv_connector_factory.py (tests/test_part15_server.py holds the lists equal).
KV_OFFLOADING_EVICTION_POLICIES = ("lru", "arc")
KV_CONNECTORS = ("OffloadingConnector", "ExampleConnector", "SharedStorageConnector", "NixlConnector")

# The default token budget per step with chunked prefill. Smaller chunks bound the pause a long
# prompt imposes on running streams; larger ones pay the per-step cost (a full read of the
# weights) fewer times. On the course's 2-core CPU a step costs about 54 ms + 2.4 ms per token
# (notebook 06): 1024 tokens keeps a 3k-token prompt's stall under half of an unchunked one while
# costing a burst of 32 prompts about four extra steps.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


DEFAULT_KV_CACHE_MEMORY_MB = 1024  # the KV pool on a CPU, where no profiling pass sizes it


def batch_defaults_for(memory_bytes: int, name: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of a CUDA device: vLLM's OpenAI-server defaults
    (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults). A GPU of 70 GiB or more other than an
    A100 (H100, H200, MI300x) keeps 1024 sequences in a batch with 8192 tokens a step: enough decodes
    in one step to fill it, and a step's prefill budget that bounds the pause running streams see.
    vLLM keeps A100s at the smaller budget, which measured faster there (its PR #17885)."""
    big = memory_bytes >= 70 * 2**30 and "a100" not in name.lower()
    return (1024, 8192) if big else (256, 2048)


def batch_defaults(device: str | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for the device: on a CPU 64 sequences and the chunked
    prefill budget (DEFAULT_MAX_NUM_BATCHED_TOKENS); on CUDA batch_defaults_for the GPU."""
    import torch

    from shared.device import resolve_device

    try:
        dev = resolve_device(device)
    except (RuntimeError, ValueError):  # a bad --device: validate() names it
        dev = torch.device("cpu")
    if dev.type != "cuda":
        return 64, DEFAULT_MAX_NUM_BATCHED_TOKENS
    try:
        props = torch.cuda.get_device_properties(dev)
        return batch_defaults_for(props.total_memory, props.name)
    except (RuntimeError, AssertionError):
        return batch_defaults_for(0, "")


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "local HF folder or hub id "
                                                      "(default: the embedded SmolLM2-135M-Instruct)"})
    device: str | None = field(default=None, metadata={"help": "cuda or cpu (default: cuda if available)"})
    dtype: str | None = field(default=None, metadata={"help": "float32, bfloat16, float16 "
                                                      "(default: bf16 on cuda, fp32 on cpu)"})
    quantization: str | None = field(default=None, metadata={
        "help": "store the linear layers' weights in fewer bits: int8 (per output channel) or int4 (per "
                "group of --quantization-group-size inputs), quantized as the checkpoint loads; a GPTQ "
                "checkpoint is read as GPTQ whatever this says (default: the checkpoint's format)"})
    quantization_group_size: int = field(default=128, metadata={
        "help": "int4: inputs sharing a scale (32, 64, 128); a last group that the inputs end inside is "
                "padded with zero weights"})
    quantize_lm_head: bool = field(default=False, metadata={
        "help": "quantize the LM head too (never a tied one: it is the embedding)"})
    load_format: str = field(default="auto", metadata={"help": "auto: the checkpoint's weights; dummy: "
                                                       "random weights, only config.json is read "
                                                       "(benchmarks of shapes without weights)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the "
                                                              "model's, at most 8192)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory_mb: int | None = field(default=None, metadata={
        "help": "memory budget of the KV block pool, in MiB (default: 1024 on cpu; on cuda what "
                "--gpu-memory-utilization leaves once the weights and a profiling step's peak are counted)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "cuda: the fraction of the GPU's memory this engine may use, KV cache included"})
    max_num_seqs: int | None = field(default=None, metadata={
        "help": "most sequences in one batch (default: 64 on cpu; on cuda vLLM's server defaults, 1024 "
                "on a GPU of 70 GiB or more other than an A100, else 256)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget of one step (default with chunked prefill: 1024 on cpu; on cuda 8192 on a "
                "GPU of 70 GiB or more other than an A100, else 2048; without chunked prefill: max_model_len)"})
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
                "ExampleConnector, NixlConnector; the course's NixlConnector has vLLM's name and handshake "
                "shape but sends KV blocks over ZeroMQ through host memory, not NIXL/RDMA), "
                "kv_role (kv_producer, kv_consumer, kv_both), "
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
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "split the model's layers into this many stages, each of --tensor-parallel-size processes, "
                "with as many steps in flight (pipeline.py)"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "MoE models: put whole experts on the tensor-parallel ranks (expert parallelism: "
                "all-to-all dispatch and combine) instead of splitting every expert"})
    distributed_executor_backend: str | None = field(default=None, metadata={
        "help": "uni: the model in the engine's process; mp: one worker process per rank "
                "(default: mp when tensor_parallel_size or pipeline_parallel_size > 1)"})
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
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "deepseek_r1 or qwen3: the chat API returns the model's <think> text as message.reasoning, "
                "and a structured-output grammar constrains only what follows </think>"})
    structured_outputs_backend: str = field(default="auto", metadata={
        "help": "who compiles response_format / structured_outputs constraints: xgrammar (every kind, "
                "vLLM's default), course (this course's own FSM: regex and choice), auto (xgrammar)"})
    compilation_mode: str | None = field(default=None, metadata={
        "help": "torch.compile of the model: none, attention_op (one graph with attention as an opaque op, "
                "where vLLM splits its graph) or full (default: attention_op on cuda, none on cpu)"})
    compilation_config: str | dict | None = field(default=None, metadata={
        "help": "CUDA graphs, as JSON with vLLM's fields: cudagraph_mode (NONE, PIECEWISE, FULL, "
                "FULL_DECODE_ONLY, FULL_AND_PIECEWISE; default on cuda: FULL_DECODE_ONLY over the torch.compiled "
                "forward, FULL_AND_PIECEWISE with --compilation-mode none), "
                "cudagraph_capture_sizes (default 1, 2, 4, 8, 16, ... up to max_cudagraph_capture_size), "
                "max_cudagraph_capture_size (default min(2 x max_num_seqs x (1 + k), 512))"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "run the model eagerly: no torch.compile, no CUDA graphs"})
    use_triton: bool | None = field(default=None, metadata={"help": "Triton kernels (default: on "
                                                            "cuda) or the torch reference"})
    # Requests and their defaults (request_fields.py, generation_config.py)
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs: waiting requests in arrival order, the newest running one preempted first; priority: "
                "by (priority, arrival), lower first, the running one with the largest preempted first "
                "(a request's `priority` field; non-zero needs this)"})
    seed: int | None = field(default=0, metadata={
        "help": "seed of the random state unseeded requests sample from: the same requests in the same "
                "order sample the same tokens on every start (a request's own seed wins)"})
    generation_config: str = field(default="auto", metadata={
        "help": "request defaults: auto (the model's generation_config.json: temperature, top_p, top_k, "
                "min_p, repetition_penalty, max_new_tokens), vllm (none), or a folder holding a "
                "generation_config.json; a request's own value wins"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template file (or the template itself) used instead of the tokenizer's"})

    def __post_init__(self) -> None:
        # The batch limits scale with the device (batch_defaults); set here, so every reader sees numbers.
        if self.max_num_seqs is None or (self.max_num_batched_tokens is None and self.enable_chunked_prefill):
            seqs, tokens = batch_defaults(self.device)
            self.max_num_seqs = self.max_num_seqs or seqs
            if self.max_num_batched_tokens is None and self.enable_chunked_prefill:
                self.max_num_batched_tokens = tokens

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if flag in parser._option_string_actions:  # a bench's own --seed serves both, as in vLLM's bench
                continue
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

    @property
    def world_size(self) -> int:
        """The model's processes: TP ranks in each of PP stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self, headless: bool = False) -> None:
        """Raise ValueError listing every invalid setting or combination, each with its flags. It reads
        the configuration and changes nothing, so a second call answers as the first. `headless`: this
        host runs engines for an API server elsewhere (--headless); the engine cores a client starts get
        their host's share of engines written into data_parallel_size_local and data_parallel_start_rank
        (core_client.start_engines), so an engine's own call needs no flag."""
        problems = list(_problems(self, headless))
        if problems:
            raise ValueError("invalid configuration:\n  - " + "\n  - ".join(problems))

    def _cudagraph_summary(self, device, max_step_tokens: int | None) -> str:
        """The mode and sizes the model runner resolves the same way (before it lowers the mode for
        the model and backend, which it logs)."""
        try:
            graphs = CompilationConfig.from_cli(self.compilation_config)
            compiled = resolve_compilation_mode(self.compilation_mode, self.enforce_eager, device,
                                                graphs.splits_forward()) != "none"
        except (ValueError, TypeError):
            return "(invalid --compilation-config)"
        q = 1 + (self.num_speculative_tokens if self.speculative_method else 0)
        mode, sizes = graphs.resolve(device.type == "cuda", self.enforce_eager, compiled, self.max_num_seqs,
                                     max_step_tokens or 2**31 - 1, q)
        return mode.name + (f" at {len(sizes)} sizes, {sizes[0]}..{sizes[-1]} tokens" if sizes else "")

    def summary(self, max_model_len: int | None = None, num_blocks: int | None = None) -> str:
        """The effective configuration, one line per concern: what each default resolved to here.
        max_model_len and num_blocks are known once the model is loaded (None: not shown)."""
        from shared.device import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        dtype = str(resolve_dtype(self.dtype, device)).removeprefix("torch.")
        on = {True: "on", False: "off"}
        chunk = self.max_num_batched_tokens or (DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill
                                                else max_model_len)
        spec = "off"
        if self.speculative_method == "ngram":
            spec = f"ngram, k={self.num_speculative_tokens}, n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        elif self.speculative_method == "draft_model":
            spec = f"draft_model, k={self.num_speculative_tokens}, " + (
                self.speculative_model or f"self-draft of {self.speculative_draft_layers} layers")
        kv_transfer = "off"
        if self.kv_offloading_size:
            kv_transfer = f"host tier {self.kv_offloading_size:g} GiB ({self.kv_offloading_eviction_policy})"
        elif self.kv_transfer_config:
            kv = KVTransferConfig.from_cli(self.kv_transfer_config)
            kv_transfer = f"{kv.kv_connector} ({kv.kv_role})"
        backend = self.distributed_executor_backend or ("mp" if self.world_size > 1 else "uni")
        engines = (f"{self.data_parallel_size} engine-core processes, routing {self.routing_policy}"
                   if self.data_parallel_size > 1 else "1 engine core, " +
                   ("in a process of its own" if self.multiprocess_engine_core else "in the server's process"))
        budget = self.kv_cache_memory_mb or (None if device.type == "cuda" else DEFAULT_KV_CACHE_MEMORY_MB)
        pool = (f"{budget} MiB" if budget else f"{self.gpu_memory_utilization:g} of the GPU's memory, less the rest") \
            + (f" = {num_blocks} blocks" if num_blocks else ", blocks")
        lines = [
            ("model", f"{self.model or 'the embedded SmolLM2-135M-Instruct'} (load_format {self.load_format}"
                      + (f", max_model_len {max_model_len})" if max_model_len else ")")),
            ("device, dtype", f"{device.type}, {dtype}; quantization {self.quantization or 'none'}"
                              + (f" (group {self.quantization_group_size})" if self.quantization == "int4" else "")),
            ("KV cache", f"{pool} of {self.block_size} tokens; prefix caching {on[self.enable_prefix_caching]}"),
            ("scheduling", f"max_num_seqs {self.max_num_seqs}, step budget {chunk} tokens; chunked prefill "
                           f"{on[self.enable_chunked_prefill]}, continuous batching {on[self.continuous_batching]}, "
                           f"async scheduling {on[self.async_scheduling and not self.speculative_method]}, "
                           f"preemption {self.preemption_mode}, policy {self.scheduling_policy}"),
            ("speculative", spec),
            ("parallelism", f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} ({backend}), expert parallel "
                            f"{on[self.enable_expert_parallel]}; DP {self.data_parallel_size}: {engines}"),
            ("KV transfer", kv_transfer),
            ("structured out", self.structured_outputs_backend),
            ("kernels", f"enforce_eager {on[self.enforce_eager]}, Triton "
                        f"{on[self.use_triton if self.use_triton is not None else device.type == 'cuda']}, "
                        f"CUDA graphs {self._cudagraph_summary(device, chunk)}"),
        ]
        return "effective configuration:\n" + "\n".join(f"  {k:<15} {v}" for k, v in lines)


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


COMPILATION_MODES = ("none", "attention_op", "full")  # --compilation-mode (compilation.py)


def resolve_compilation_mode(mode: str | None, enforce_eager: bool, device: torch.device,
                             split_for_graphs: bool = False) -> str:
    """The mode in effect. Default: attention_op on CUDA; none on CPU, where notebook 15 measured
    the compiled model's decode no faster than eager (ITL p50 219 against 211 ms; its throughput
    within the run's spread) while every start pays the compile. None, too, when the CUDA-graph
    mode asked for splits the forward at attention itself (`split_for_graphs`, piecewise.py)."""
    if mode is not None and mode not in COMPILATION_MODES:
        raise ValueError(f"compilation_mode must be one of {', '.join(COMPILATION_MODES)}, got {mode!r}")
    if enforce_eager:
        return "none"
    return mode or ("attention_op" if device.type == "cuda" and not split_for_graphs else "none")


# --compilation-config (part 15): CUDA graphs, vLLM's JSON and field names (vllm/config/compilation.py).
class CUDAGraphMode(enum.Enum):
    """How a step's forward replays: NONE (eager), PIECEWISE (the pieces between attention calls are
    graphs, attention runs eagerly between them: any batch), FULL (one graph over the whole forward,
    attention included: the batches the attention kernel can replay at fixed shapes). The two
    tuple modes are (decode batches, mixed batches): FULL_DECODE_ONLY runs mixed batches eagerly,
    FULL_AND_PIECEWISE (vLLM's default) replays them piecewise."""
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if isinstance(self.value, tuple) else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if isinstance(self.value, tuple) else self

    def has_piecewise(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's capture sizes up to max_size: 1, 2, 4, then every 8 below 256, then every 16."""
    sizes = [1, 2, 4] + list(range(8, min(max_size + 1, 256), 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


@dataclass
class CompilationConfig:
    """`--compilation-config '{"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}'`.
    Unset fields get vLLM's defaults in `resolve`; unknown fields are refused, not ignored."""
    cudagraph_mode: str | None = None  # a CUDAGraphMode name (default: see resolve)
    cudagraph_capture_sizes: list[int] | None = None  # default: default_capture_sizes(max size)
    max_cudagraph_capture_size: int | None = None  # default: min(max_num_seqs * (1 + k) * 2, 512)

    @classmethod
    def from_cli(cls, value: str | dict | CompilationConfig | None) -> CompilationConfig:
        if isinstance(value, CompilationConfig):
            return value
        data = {} if value is None else json.loads(value) if isinstance(value, str) else dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(known)} (torch.compile itself: "
                             f"--compilation-mode)")
        config = cls(**data)
        if config.cudagraph_mode is not None and config.cudagraph_mode not in CUDAGraphMode.__members__:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGraphMode.__members__)}, "
                             f"got {config.cudagraph_mode!r}")
        sizes = config.cudagraph_capture_sizes
        if sizes is not None and (not isinstance(sizes, list) or not all(isinstance(n, int) and n > 0 for n in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a list of positive integers, got {sizes!r}")
        if config.max_cudagraph_capture_size is not None and config.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be positive, got {config.max_cudagraph_capture_size}")
        return config

    def splits_forward(self) -> bool:
        """The mode asked for replays pieces split at attention (piecewise.py), which the whole-forward
        torch.compile of --compilation-mode cannot go with."""
        return self.cudagraph_mode is not None and CUDAGraphMode[self.cudagraph_mode].has_piecewise()

    def resolve(self, on_cuda: bool, enforce_eager: bool, compiled: bool, max_num_seqs: int,
                max_num_batched_tokens: int, uniform_decode_query_len: int = 1) -> tuple[CUDAGraphMode, list[int]]:
        """The mode and the capture sizes in effect. No graphs without CUDA or with --enforce-eager.
        `compiled`: the model is torch.compiled whole (--compilation-mode attention_op or full), which
        the piecewise split cannot go inside, so the default becomes FULL_DECODE_ONLY. Sizes are at
        most the step's token budget; with drafts (uniform_decode_query_len = 1 + k) a FULL decode
        graph's sizes are rounded up to multiples of it."""
        if not on_cuda or enforce_eager:
            return CUDAGraphMode.NONE, []
        default = "FULL_DECODE_ONLY" if compiled else "FULL_AND_PIECEWISE"
        mode = CUDAGraphMode[self.cudagraph_mode or default]
        if mode == CUDAGraphMode.NONE:
            return mode, []
        q = uniform_decode_query_len
        largest = self.max_cudagraph_capture_size or min(max_num_seqs * q * 2, 512)
        largest = min(largest, max_num_batched_tokens)
        sizes = sorted(set(self.cudagraph_capture_sizes or default_capture_sizes(largest)))
        if self.cudagraph_capture_sizes and self.max_cudagraph_capture_size:
            sizes = [n for n in sizes if n <= self.max_cudagraph_capture_size]
        sizes = [n for n in sizes if n <= max_num_batched_tokens]
        if q > 1 and mode.decode_mode() == CUDAGraphMode.FULL:
            sizes = [n for n in sorted({-(-n // q) * q for n in sizes}) if n <= max_num_batched_tokens]
        return (mode, sizes) if sizes else (CUDAGraphMode.NONE, [])


def _problems(c: EngineConfig, headless: bool):
    """Each invalid setting or combination, as a sentence that names the flags to change."""
    import torch

    from shared.device import resolve_dtype

    def one_of(flag: str, value, choices) -> str | None:
        names = ", ".join("unset" if x is None else str(x) for x in choices)
        return None if value in choices else f"{flag} must be one of {names}, got {value!r}"

    checks = [one_of("--load-format", c.load_format, ("auto", "dummy")),
              one_of("--quantization", c.quantization, (None, *QUANTIZATION_METHODS)),
              one_of("--preemption-mode", c.preemption_mode, ("recompute", "swap")),
              one_of("--speculative-method", c.speculative_method, (None, *SPECULATIVE_METHODS)),
              one_of("--kv-offloading-eviction-policy", c.kv_offloading_eviction_policy,
                     KV_OFFLOADING_EVICTION_POLICIES),
              one_of("--distributed-executor-backend", c.distributed_executor_backend, (None, "uni", "mp")),
              one_of("--routing-policy", c.routing_policy, ROUTING_POLICIES),
              one_of("--structured-outputs-backend", c.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS),
              one_of("--reasoning-parser", c.reasoning_parser, (None, *REASONING_PARSERS)),
              one_of("--compilation-mode", c.compilation_mode, (None, *COMPILATION_MODES)),
              one_of("--scheduling-policy", c.scheduling_policy, SCHEDULING_POLICIES)]
    yield from (p for p in checks if p)
    if c.device not in (None, "auto") and c.device.split(":")[0] not in ("cpu", "cuda"):
        yield f"--device must be cpu or cuda, got {c.device!r}"
    elif c.device and c.device.startswith("cuda") and not torch.cuda.is_available():
        yield f"--device {c.device}: no CUDA device is available here"
    try:
        resolve_dtype(c.dtype, torch.device("cpu"))
    except ValueError as e:
        yield f"--dtype: {e}"
    for flag, value, least in (("--block-size", c.block_size, 1), ("--kv-cache-memory-mb", c.kv_cache_memory_mb, 1),
                               ("--max-num-seqs", c.max_num_seqs, 1), ("--max-model-len", c.max_model_len, 1),
                               ("--max-num-batched-tokens", c.max_num_batched_tokens, 1),
                               ("--long-prefill-token-threshold", c.long_prefill_token_threshold, 0),
                               ("--tensor-parallel-size", c.tensor_parallel_size, 1),
                               ("--pipeline-parallel-size", c.pipeline_parallel_size, 1),
                               ("--data-parallel-size", c.data_parallel_size, 1), ("--nnodes", c.nnodes, 1)):
        if value is not None and value < least:
            yield f"{flag} must be at least {least}, got {value}"
    if not 0 < c.gpu_memory_utilization <= 1:
        yield f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}"
    try:
        graphs = CompilationConfig.from_cli(c.compilation_config)
    except (ValueError, TypeError) as e:  # bad JSON, unknown fields, modes
        yield f"--compilation-config: {e}"
    else:
        wants_graphs = graphs.cudagraph_mode not in (None, "NONE")
        on_cuda = c.device.startswith("cuda") if c.device not in (None, "auto") else torch.cuda.is_available()
        if wants_graphs and not c.enforce_eager and not on_cuda and not envs.VLLM_COURSE_GRAPH_STAND_IN:
            yield f"--compilation-config: cudagraph_mode {graphs.cudagraph_mode} needs a CUDA device"
        if graphs.splits_forward() and c.compilation_mode in ("attention_op", "full"):
            yield (f"--compilation-config: cudagraph_mode {graphs.cudagraph_mode} splits the model at attention "
                   f"itself; with --compilation-mode {c.compilation_mode} use FULL_DECODE_ONLY")
    if c.generation_config not in ("auto", "vllm"):
        from pathlib import Path

        if not (Path(c.generation_config) / "generation_config.json").is_file():
            yield f"--generation-config: no generation_config.json in {c.generation_config!r} (or: auto, vllm)"
    if c.chat_template is not None:  # a file, or the template written inline (chat_template.py reads it)
        from pathlib import Path

        if not Path(c.chat_template).expanduser().is_file() and not any(m in c.chat_template for m in ("{{", "{%")):
            yield f"--chat-template: {c.chat_template!r} is neither a file nor a Jinja template"
    if c.quantization_group_size != -1 and c.quantization_group_size < 1:
        yield f"--quantization-group-size must be positive (or -1: per channel), got {c.quantization_group_size}"
    budget = c.max_num_batched_tokens or (DEFAULT_MAX_NUM_BATCHED_TOKENS if c.enable_chunked_prefill else None)
    if budget is not None and budget < c.max_num_seqs:
        yield (f"--max-num-batched-tokens ({budget}) must be at least --max-num-seqs ({c.max_num_seqs}): every "
               f"running sequence may decode in one step")
    if not c.enable_chunked_prefill and c.max_num_batched_tokens and c.max_model_len \
            and c.max_num_batched_tokens < c.max_model_len:
        yield (f"--no-enable-chunked-prefill needs --max-num-batched-tokens ({c.max_num_batched_tokens}) >= "
               f"--max-model-len ({c.max_model_len}): a whole prompt must fit in one step")
    # Speculative decoding (part 08)
    if c.speculative_method and c.num_speculative_tokens < 1:
        yield f"--num-speculative-tokens must be at least 1, got {c.num_speculative_tokens}"
    if c.speculative_model and c.speculative_method != "draft_model":
        yield "--speculative-model needs --speculative-method draft_model"
    if c.speculative_method == "ngram" and not 1 <= c.prompt_lookup_min <= c.prompt_lookup_max:
        yield (f"--prompt-lookup-min and --prompt-lookup-max need 1 <= min <= max, got "
               f"{c.prompt_lookup_min} and {c.prompt_lookup_max}")
    if c.speculative_method == "draft_model" and not c.speculative_model and c.speculative_draft_layers < 1:
        yield f"--speculative-draft-layers must be at least 1, got {c.speculative_draft_layers}"
    # The KV connector and the host tier (parts 12, 13)
    kv = None
    try:
        kv = KVTransferConfig.from_cli(c.kv_transfer_config)
    except (ValueError, TypeError) as e:  # bad JSON, unknown fields, roles, policies
        yield f"--kv-transfer-config: {e}"
    known = KV_CONNECTORS
    factory = sys.modules.get(f"{__package__}.kv_connector_factory")
    if factory is not None:  # loaded already (never imported here): connectors registered in this process count
        known = tuple(factory.KVConnectorFactory.names())
    if kv is not None and kv.kv_connector not in known:
        yield f"--kv-transfer-config: unknown kv_connector {kv.kv_connector!r}; known: {', '.join(known)}"
    if kv is not None and c.kv_offloading_size:
        yield "give --kv-offloading-size or --kv-transfer-config, not both (the first is the OffloadingConnector)"
    if c.kv_offloading_size is not None and c.kv_offloading_size <= 0:
        yield f"--kv-offloading-size must be positive, got {c.kv_offloading_size}"
    host_tier = bool(c.kv_offloading_size) or (kv is not None and kv.kv_connector == "OffloadingConnector")
    if c.preemption_mode == "swap" and not host_tier:
        yield "--preemption-mode swap needs a host tier to swap to: set --kv-offloading-size"
    if c.preemption_mode == "swap" and c.speculative_method == "draft_model":
        yield ("--preemption-mode swap does not swap a draft model's KV cache: use --preemption-mode recompute "
               "with --speculative-method draft_model")
    # Parallelism (parts 09-11)
    backend = c.distributed_executor_backend or ("mp" if c.world_size > 1 else "uni")
    if backend == "uni" and c.world_size > 1:
        yield ("--tensor-parallel-size or --pipeline-parallel-size > 1 needs --distributed-executor-backend mp "
               "(one process per rank)")
    if c.pipeline_parallel_size > 1:  # pipeline.py: what a stage's forward does not carry
        if c.speculative_method == "draft_model":
            yield ("--pipeline-parallel-size > 1 with --speculative-method draft_model: the draft model would run "
                   "on the last stage alone; use ngram drafts or one stage")
        if kv is not None or c.kv_offloading_size:
            yield ("--pipeline-parallel-size > 1 with a KV connector (--kv-transfer-config, --kv-offloading-size): "
                   "the connectors move one stage's layers; use one stage")
    if c.enable_expert_parallel and c.tensor_parallel_size < 2:
        yield ("--enable-expert-parallel puts experts on the tensor-parallel ranks: it needs "
               "--tensor-parallel-size of 2 or more")
    # Data parallelism with each engine's ranks across nodes: a --headless host with --data-parallel-size > 1
    # starts whole engines (headless.py), never another node's share of an engine's ranks, and the engines
    # would all meet at the one --master-port. The nodes are --nnodes, or $NNODES, which the mp backend's
    # ranks read when the flag is unset (parallel_state.ParallelConfig.resolve).
    env_nnodes = os.environ.get("NNODES", "1")
    spans = c.nnodes or (int(env_nnodes) if backend == "mp" and env_nnodes.isdigit() else 1)
    if c.data_parallel_size > 1 and spans > 1:
        source = f"--nnodes {c.nnodes}" if c.nnodes else f"$NNODES={spans}"
        yield (f"--data-parallel-size {c.data_parallel_size} with {source}: each engine's --tensor-parallel-size x "
               f"--pipeline-parallel-size ranks would span nodes, which data parallelism cannot run (a --headless "
               f"host starts whole engines, not another node's ranks of one); keep each engine's ranks on one node "
               f"(--nnodes 1) and spread the engines over the nodes instead: --data-parallel-size-local engines on "
               f"each, --data-parallel-start-rank, --data-parallel-address and --data-parallel-rpc-port, --headless "
               f"on the hosts without the API server")
    if c.nnodes and c.nnodes > 1 and c.world_size % c.nnodes:
        yield (f"--tensor-parallel-size x --pipeline-parallel-size ({c.world_size}) must divide evenly over "
               f"--nnodes ({c.nnodes})")
    if c.nnodes and c.node_rank is not None and not 0 <= c.node_rank < c.nnodes:
        yield f"--node-rank must be in [0, --nnodes={c.nnodes}), got {c.node_rank}"
    local = c.data_parallel_size_local  # unset: all of them, or one on a --headless host
    local = (1 if headless else c.data_parallel_size) if local is None else local
    if not 0 <= local <= c.data_parallel_size:
        yield f"--data-parallel-size-local must be in [0, --data-parallel-size={c.data_parallel_size}], got {local}"
    elif c.data_parallel_start_rank + local > c.data_parallel_size:
        yield (f"--data-parallel-start-rank ({c.data_parallel_start_rank}) + --data-parallel-size-local ({local}) "
               f"exceeds --data-parallel-size ({c.data_parallel_size})")
    if c.data_parallel_size > 1 and (local < c.data_parallel_size or headless) and not c.data_parallel_rpc_port:
        yield ("engines on several hosts need the API server's --data-parallel-address and a fixed "
               "--data-parallel-rpc-port (on the server and on every --headless host)")
    for flag, value in (("--execute-model-timeout-s", c.execute_model_timeout_s),
                        ("--engine-ready-timeout-s", c.engine_ready_timeout_s),
                        ("--engine-heartbeat-timeout-s", c.engine_heartbeat_timeout_s)):
        if value <= 0:
            yield f"{flag} must be positive, got {value}"
