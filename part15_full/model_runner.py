"""ModelRunner: owns the model and the paged KV pool on the device, and runs one step over a
flattened batch of sequences (no padding, each sequence contributes its new tokens): forward
pass, then sampling.

Async scheduling splits a step in two: `prepare_inputs` (host work: token ids, positions, paged
attention metadata, sampling rows) and `execute_model` (device work). A sequence whose input is
the token the previous step sampled names that step's row instead of a token id, and
`execute_model` copies the id across on the device: no round trip through the host.

Speculative decoding (part 08): a sequence's step may verify draft tokens. Its entry's tokens are
then its newest token plus k drafts, the model scores all k + 1 positions in the one pass, and the
rejection sampler turns those logits into 1..k+1 tokens. With a draft model, the drafts are sampled
here first (`_propose_on_device`): a catch-up pass of the draft over every token the target computes
this step, then k - 1 one-token passes, and the target's input slots are filled on the device.

Tensor parallelism (part 09): each rank's runner builds the model through its `layers` (a rank's
shards), so it holds only its own heads; its KV pool holds those heads' K/V. Every rank runs the same
steps on the same inputs, gets the same all-gathered logits and samples the same tokens."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from shared.device import resolve_device, resolve_dtype
from shared.forward_context import set_forward_context
from shared.model import LayerFactory
from shared.sampler import SampledBatch, Sampler as RowSampler, SamplingRow
from shared.weights import resolve_model_path

from . import envs
from .compilation import compile_model
from .config import (DEFAULT_KV_CACHE_MEMORY_MB, CompilationConfig, CUDAGraphMode, EngineConfig,
                     resolve_compilation_mode)
from .draft_model import DraftModelProposer, sample_drafts
from .fused_moe import FusedMoE
from .graph_runner import graph_mode_for, make_graph_runner
from .input_batch import InputBatch
from . import prompt_logprobs
from .prompt_logprobs import PromptLogprobsPlan
from .sampler import Sampler
from .sampling_metadata import SamplingMetadata, to_device
from .block_utils import cdiv, num_blocks_for_budget
from .memory_profiling import min_over_ranks, profile_kv_budget
from .model_loader import get_model
from .quantization import get_quant_config
from .kv_connector import KVConnectorRole, make_connector, resolve_kv_transfer_config
from .moe_config import load_configs
from .attention_metadata import NULL_BLOCK_ID, PAD_SLOT_ID, PagedAttentionMetadata
from .paged_attention import TritonAttention, attention_options, get_attention_backend
from .pipeline import PipelineStage, get_pp_indices
from .platforms import current_platform
from .rejection_sampler import RejectionOutput, RejectionSampler, SpecDecodeMetadata
from .runner_messages import ModelRunnerOutput, SequenceBatchEntry
from .structured_output.bitmask import unpack_bitmask
from .structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


def position_row(row: SamplingRow, drafts: list[int], j: int, min_tokens_left: int) -> SamplingRow:
    """The sampling row of position j of a verifying step (row: position 0's): drafts[:j] count as
    generated output (for penalties), and EOS stays banned only while min_tokens is not reached.
    Exactly the row plain decoding would use there."""
    if j == 0:
        return row
    history = row.output_token_ids + drafts[:j] if row.params.has_penalties else row.output_token_ids
    banned = row.banned_token_ids if j < min_tokens_left else ()
    return dataclasses.replace(row, output_token_ids=history, banned_token_ids=banned)


@dataclass
class DraftPass:
    """One forward pass of the draft model: its input, or which sequences feed their previous
    draft back (input_rows: their rows in the previous pass's drafts)."""
    metadata: PagedAttentionMetadata
    positions: torch.Tensor
    input_ids: torch.Tensor | None  # the catch-up pass: known tokens
    input_rows: torch.Tensor | None  # later passes: rows of the previous pass's drafts
    logits_indices: torch.Tensor  # the rows whose logits give a draft
    seqs: list[int]  # which speculating sequences (index into SpecInput) draft in this pass


@dataclass
class SpecInput:
    meta: SpecDecodeMetadata  # per sampling sequence: its drafts (0s until the draft model fills them)
    rows: list[SamplingRow]  # per sampling sequence: its row at the first position
    min_tokens_left: list[int]
    draft_slots: torch.Tensor  # rows of input_ids that hold drafts, sequence-major
    draft_passes: list[DraftPass] | None  # the draft model's passes; None: drafts known already


@dataclass
class ModelInput:
    """Everything one step needs on the device, built on the host by prepare_inputs."""
    input_ids: torch.Tensor  # [T]; placeholder slots hold 0 until execute_model fills them
    positions: torch.Tensor  # [T]
    metadata: PagedAttentionMetadata
    logits_indices: torch.Tensor  # [S]: the last token's row of each sequence that samples
    placeholder_slots: torch.Tensor | None  # rows of input_ids to fill from the previous step
    placeholder_prev_rows: torch.Tensor | None  # ...with these rows of its sampled ids
    rows: list[SamplingRow]  # of the S sequences that sample
    prev_rows: list[int | None]  # of the same S, as in SequenceBatchEntry
    spec: SpecInput | None = None  # some sequence verifies drafts this step, or a draft model runs
    kv_connector_metadata: Any = None  # what a KV connector's scheduler side sends this step (parts 12-13)
    grammar_output: GrammarOutput | None = None  # structured outputs' bitmask (part 15)
    sampling: SamplingMetadata | None = None  # the S rows' sampling as tensors (part 15, sampling_metadata.py)
    host_set: int = 0  # which of InputBatch's host sets holds the step (part 15)
    prompt_logprobs: PromptLogprobsPlan | None = None  # rows that score prompt tokens (part 15)


def set_random_seed(seed: int) -> None:
    """Python's, numpy's and torch's random state (every device's). In vLLM: vllm/utils (set_random_seed)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ModelRunner:
    def __init__(self, config: EngineConfig, layers: LayerFactory | None = None, device: str | None = None,
                 pipeline: PipelineStage | None = None):
        self.config = config
        self.pipeline = pipeline  # this rank's pipeline stage (pipeline.py), None: the whole model
        self.device = resolve_device(device or config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)
        cfg, _ = load_configs(self.model_path)
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings,
                                                             DEFAULT_MAX_MODEL_LEN),
                                 cfg.max_position_embeddings)
        # The registry picks dense or MoE by the checkpoint's architecture (part 11); a rank's
        # experts come from its place in the group (its layers' tp_rank).
        use_triton = config.use_triton if config.use_triton is not None else self.device.type == "cuda"
        # Part 14: the weights' format, for every linear layer (and the experts), through the factory.
        quant = get_quant_config(config.quantization, self.model_path, cfg, config.quantization_group_size,
                                 config.quantize_lm_head)
        layers = layers or LayerFactory()
        layers.quant_config = quant
        if pipeline is not None:  # a stage builds, loads and caches its own layers only
            layers.layer_range = get_pp_indices(cfg.num_hidden_layers, pipeline.pp_rank, pipeline.pp_size)
        # Part 15: the device's own pieces, chosen once (platforms.py; on a CPU the appendix, cpu/README.md):
        # its layers here, its attention backend and graph runner below.
        self.platform = current_platform(self.device)
        layers = self.platform.layers(layers)
        self.model = get_model(self.model_path, self.device, self.dtype, self.max_model_len, config.load_format,
                               layers, config.enable_expert_parallel, use_triton)
        self.model_config = c = self.model.config
        self.block_size = config.block_size
        # The heads this process holds: all of them, or its rank's share (the budget is per rank).
        attn = self.model.layers[self.model.start_layer].self_attn
        stage_layers = self.model.end_layer - self.model.start_layer
        # The largest step: the token budget, or without chunked prefill a whole prompt.
        self.max_step_tokens = config.max_num_batched_tokens or self.max_model_len
        # Part 15: torch.compile's mode, and the CUDA-graph mode and sizes asked for (config.py's
        # CompilationConfig; lowered below to what this model and backend can replay).
        graph_config = CompilationConfig.from_cli(config.compilation_config)
        self.compilation_mode = resolve_compilation_mode(config.compilation_mode, config.enforce_eager, self.device,
                                                         split_for_graphs=graph_config.splits_forward())
        if pipeline is not None:  # a stage runs its layers eagerly: no torch.compile, no CUDA graphs
            self.compilation_mode = "none"
        self.uniform_decode_query_len = 1 + (config.num_speculative_tokens if config.speculative_method else 0)
        asked_mode, self.cudagraph_sizes = graph_config.resolve(
            self.device.type == "cuda" or envs.VLLM_COURSE_GRAPH_STAND_IN, config.enforce_eager,
            self.compilation_mode != "none", config.max_num_seqs, self.max_step_tokens, self.uniform_decode_query_len)
        if config.kv_cache_memory_mb is None and self.device.type == "cuda" and pipeline is not None:
            raise ValueError("pipeline parallelism on a GPU needs --kv-cache-memory-mb (the memory profile "
                             "runs the whole model in one process)")
        if config.kv_cache_memory_mb is None and self.device.type == "cuda":  # what the GPU has left (memory_profiling.py)
            budget = profile_kv_budget(self.model, self.device, self.max_step_tokens, config.max_num_seqs,
                                       self.max_model_len, config.gpu_memory_utilization,
                                       max(self.cudagraph_sizes) if asked_mode != CUDAGraphMode.NONE else 0)
            if layers is not None and layers.tp_size > 1:  # every rank holds the same blocks: the smallest budget
                budget = min_over_ranks(budget, self.device)
        else:
            budget = (config.kv_cache_memory_mb or DEFAULT_KV_CACHE_MEMORY_MB) * 2**20
        self.num_blocks = num_blocks_for_budget(budget, stage_layers,
                                                attn.num_kv_heads, c.head_dim, self.block_size, self.dtype)
        if self.num_blocks < 2:
            raise ValueError(f"a KV budget of {budget / 2**20:.0f} MiB holds fewer than 2 blocks")
        # Part 15: the attention backend for this device and model, chosen once (paged_attention.py).
        self.attn = get_attention_backend(stage_layers, self.num_blocks, self.block_size, attn.num_heads,
                                          attn.num_kv_heads, c.head_dim, self.dtype, self.device, config.use_triton,
                                          **attention_options(c, (self.model.start_layer, self.model.end_layer)),
                                          platform=self.platform)
        # Part 15: torch.compile of the model, attention one opaque op in its graph (compilation.py).
        compile_model(self.model, self.attn, self.compilation_mode)
        self.kv_transfer_config = resolve_kv_transfer_config(config)
        self.sampler = Sampler()  # part 15: from the persistent batch's tensors (sampler.py)
        self.rejection_sampler = RejectionSampler(RowSampler())
        self.drafter = None
        if config.speculative_method == "draft_model":
            self.drafter = DraftModelProposer(
                self.model, config.num_speculative_tokens, self.max_model_len, self.num_blocks,
                self.block_size, self.device, self.dtype, config.speculative_model,
                config.speculative_draft_layers, config.load_format, config.use_triton)
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.kv_connector = None  # register_kv_connector
        self.kv_connector_info: dict = {}  # what the connector's scheduler half must know of it
        if self.kv_transfer_config is not None:  # part 13: the connector's worker half
            rank, size = (layers.tp_rank, layers.tp_size) if layers is not None else (0, 1)
            connector = make_connector(self.kv_transfer_config, KVConnectorRole.WORKER, self.block_size,
                                       device=self.device, rank=rank, tp_size=size,
                                       bytes_per_block=self.attn.nbytes // self.num_blocks)
            self.register_kv_connector(connector)
            self.kv_connector_info = connector.info()
        self.timeline: list[tuple[float, float]] | None = None  # (start, end) of each step, when on
        # Part 15: the runner seam, captured at start-up: every forward of a step goes through it
        # (graph_runner.py), replayed from CUDA graphs where the configuration and the model allow.
        self.cudagraph_mode, reasons = self._cudagraph_mode(asked_mode, layers)
        graphed = self.cudagraph_mode != CUDAGraphMode.NONE
        # Part 15: each step's inputs from state kept across steps (input_batch.py); with graphs, its
        # device arrays are the graphs' static inputs.
        self.input_batch = InputBatch(self.max_step_tokens, config.max_num_seqs,
                                      cdiv(self.max_model_len, self.block_size), self.block_size, self.device,
                                      c.vocab_size, (max(self.cudagraph_sizes), config.max_num_seqs) if graphed else None)
        self._warm_up()
        graphs = None
        if graphed:
            graphs = dict(mode=self.cudagraph_mode, sizes=self.cudagraph_sizes, max_num_seqs=config.max_num_seqs,
                          buffers=self.input_batch.device_arrays, max_model_len=self.max_model_len,
                          uniform_decode_query_len=self.uniform_decode_query_len)
        for reason in reasons:
            logger.info("CUDA graphs: %s, so %s", reason, self.cudagraph_mode.name)
        # A pipeline stage runs its layers through _stage_forward, not a graph runner.
        self.graph_runner = (make_graph_runner(self.model, self.attn, self.device, graphs, self.platform)
                             if pipeline is None else None)
        if config.seed is not None and (layers is None or layers.tp_size == 1):
            # --seed: unseeded rows sample from this state; seeded after start-up's passes, so the same
            # requests give the same tokens on every start (worker.py seeds tensor-parallel ranks).
            set_random_seed(config.seed)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """vLLM's dummy runs: a prefill step, a decode step and a one-token step on dummy inputs (KV
        slots -1: nothing is stored) through the step's own arrays, before any request and before the
        CUDA graphs are captured. torch.compile traces each shape class on first sight (a dimension of
        1 is one of its own) and Triton builds a kernel variant per set of constants and argument
        alignments: here they are built at start-up, not in the middle of a run. A CPU with nothing to
        compile skips it."""
        if (self.compilation_mode == "none" and not isinstance(self.attn, TritonAttention)) or self.pipeline:
            return
        start = time.perf_counter()
        connector, self.attn.kv_connector = self.attn.kv_connector, None  # a dummy step loads and saves nothing
        try:
            for num_seqs, q_len in ((1, 2), (2, 1), (1, 1)):
                seq_ids = [f"warm-up {i}" for i in range(num_seqs)]
                batch = [SequenceBatchEntry([0] * q_len, 0, [NULL_BLOCK_ID], None, seq_id=s) for s in seq_ids]
                step = self.input_batch.prepare(batch)
                step.metadata.slot_mapping.fill_(PAD_SLOT_ID)  # the host's copy: nothing is stored
                self.input_batch.to_device(step)
                with set_forward_context(self.attn, step.metadata):
                    hidden = self.model(step.input_ids, step.positions)
                self.model.compute_logits(hidden)
                self.input_batch.free(seq_ids)
        finally:
            self.attn.kv_connector = connector
        logger.info("warm-up: prefill, decode and one-token steps in %.1f s", time.perf_counter() - start)

    def _cudagraph_mode(self, mode: CUDAGraphMode, layers) -> tuple[CUDAGraphMode, list[str]]:
        """The CUDA-graph mode asked for, lowered to what this model, backend and set-up can replay
        (graph_runner.graph_mode_for)."""
        return graph_mode_for(mode, self.attn.cudagraph_support, piecewise_ok=self.compilation_mode == "none",
                              moe_on_host=any(isinstance(m, FusedMoE) and (m.expert_parallel or not m.use_triton)
                                              for m in self.model.modules()),
                              tensor_parallel=layers is not None and layers.tp_size > 1,
                              kv_connector=self.kv_connector is not None, pipeline=self.pipeline is not None)

    def prepare_inputs(self, batch: list[SequenceBatchEntry], kv_connector_metadata: Any = None,
                       grammar_output: GrammarOutput | None = None, freed_seq_ids: Sequence[str] = ()) -> ModelInput:
        """The host half of a step: the step's tensors from the persistent block table and arrays
        (input_batch.py; `freed_seq_ids`: sequences whose blocks went back to the pool since)."""
        step = self.input_batch.prepare(batch, freed_seq_ids)

        def tensor(data):
            return to_device(torch.from_numpy(np.array(data, dtype=np.int64)), self.device)

        sampling = [e for e in batch if e.sampling is not None]
        spec = None
        if self.drafter is not None or any(e.draft_token_ids for e in sampling):
            spec = self._prepare_spec(batch, sampling, tensor)
        return ModelInput(step.input_ids, step.positions, step.metadata, step.logits_indices, step.placeholder_slots,
                          step.placeholder_prev_rows, [e.sampling for e in sampling], [e.prev_row for e in sampling],
                          spec, kv_connector_metadata, grammar_output, step.sampling, step.host_set,
                          prompt_logprobs.plan(batch, tensor))

    def _prepare_spec(self, batch: list[SequenceBatchEntry], sampling: list[SequenceBatchEntry],
                      tensor) -> SpecInput:
        draft_slots, row = [], 0
        for e in batch:
            row += len(e.token_ids) + (e.prev_row is not None)
            if e.sampling is not None:
                draft_slots += range(row, row + len(e.draft_token_ids))
            row += len(e.draft_token_ids)
        meta = SpecDecodeMetadata.from_drafts([e.draft_token_ids for e in sampling])
        passes = self._plan_draft_passes(batch, sampling, tensor) if self.drafter is not None else None
        return SpecInput(meta, [e.sampling for e in sampling], [e.min_tokens_left for e in sampling],
                         tensor(draft_slots), passes)

    def _plan_draft_passes(self, batch: list[SequenceBatchEntry], sampling: list[SequenceBatchEntry],
                           tensor) -> list[DraftPass]:
        """The catch-up pass: every entry's known tokens that the draft's KV lacks (a prompt chunk,
        or the newest token, plus the last accepted draft when all of them were accepted); its
        last row gives each speculating sequence's first draft. Then pass j (1..k-1) feeds draft
        j-1 back, one token per sequence still drafting. All within the slots the target needs."""
        spec_of = {id(e): i for i, e in enumerate(sampling) if e.draft_token_ids}
        ids, positions, seq_lens, query_lens, last, seqs = [], [], [], [], [], []
        for e in batch:
            end = e.num_computed_tokens + len(e.token_ids)
            ids += e.draft_input_ids
            positions += range(end - len(e.draft_input_ids), end)
            seq_lens.append(end)
            query_lens.append(len(e.draft_input_ids))
            if id(e) in spec_of:
                last.append(len(ids) - 1)
                seqs.append(spec_of[id(e)])
        bs, dev = self.block_size, self.device
        passes = [DraftPass(PagedAttentionMetadata.build([e.block_ids for e in batch], seq_lens, query_lens, bs, dev),
                            tensor(positions), tensor(ids), None, tensor(last), seqs)]
        for j in range(1, max((len(e.draft_token_ids) for e in sampling), default=0)):
            prev_seqs = passes[-1].seqs
            entries = [(r, i) for r, i in enumerate(prev_seqs) if len(sampling[i].draft_token_ids) > j]
            ends = [sampling[i].num_computed_tokens + len(sampling[i].token_ids) + j for _, i in entries]
            meta = PagedAttentionMetadata.build([sampling[i].block_ids for _, i in entries], ends,
                                                [1] * len(entries), bs, dev)
            passes.append(DraftPass(meta, tensor([p - 1 for p in ends]), None, tensor([r for r, _ in entries]),
                                    tensor(list(range(len(entries)))), [i for _, i in entries]))
        return passes

    def register_kv_connector(self, connector) -> None:
        """Hand a KV connector (parts 12-13: a host tier, a transfer to another engine) this process's
        KV cache tensors; from then on every step binds the connector's metadata, lets it start its
        loads before the forward pass and collect its finished transfers after it."""
        self.kv_connector = self.attn.kv_connector = connector
        connector.register_kv_caches(self.attn.k_cache, self.attn.v_cache)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> ModelRunnerOutput:
        """The device half: fill in the previous step's tokens, run the model, sample. The
        sampled ids stay on the device (the next step reads them there)."""
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(inp.kv_connector_metadata)
            connector.start_load_kv()
        sampled, prompt = self._forward_and_sample(inp)
        kv_out = None
        if connector is not None:
            connector.wait_for_save()
            kv_out = connector.get_finished()
            connector.clear_connector_metadata()
        return ModelRunnerOutput(sampled, kv_out, prompt)

    def _forward_and_sample(self, inp: ModelInput) -> tuple[SampledBatch | RejectionOutput,
                                                            prompt_logprobs.PromptLogprobsOutput | None]:
        if inp.input_ids.numel() == 0:  # a step that only moves KV blocks (part 12)
            return SampledBatch(torch.empty(0, dtype=torch.long, device=self.device)), None
        start = time.perf_counter()
        # On a GPU, the step's host arrays into the device's, here on the thread that runs the step.
        self.input_batch.to_device(inp)
        input_ids = inp.input_ids
        if inp.placeholder_slots is not None:
            input_ids[inp.placeholder_slots] = self.prev_sampled_token_ids[inp.placeholder_prev_rows]
        draft_probs = self._propose_on_device(inp) if inp.spec and inp.spec.draft_passes else None
        if self.pipeline is None:
            hidden = self.graph_runner(input_ids, inp.positions, inp.metadata)
        else:  # the step's time on this stage counts from the previous stage's activations' arrival
            hidden, start = self._stage_forward(input_ids, inp)
            if hidden is None:  # a stage before the last: its activations are sent on
                return SampledBatch(torch.empty(0, dtype=torch.long, device=self.device)), None
        prompt = prompt_logprobs.compute(self.model, hidden, inp.prompt_logprobs) if inp.prompt_logprobs else None
        if inp.spec is not None and inp.rows:  # verify: 1..k+1 tokens per sequence
            spec = inp.spec
            logits = self._constrained(self.model.compute_logits(hidden[inp.logits_indices]), inp)
            rows = [position_row(row, drafts, j, left)
                    for row, drafts, left in zip(spec.rows, spec.meta.draft_token_ids, spec.min_tokens_left)
                    for j in range(len(drafts) + 1)]
            sampled = self.rejection_sampler(logits, rows, spec.meta, draft_probs)
        elif inp.rows:
            logits = self._constrained(self.model.compute_logits(hidden[inp.logits_indices]), inp)
            sampled = self.sampler.sample(logits, inp.sampling, self.prev_sampled_token_ids)
            self.prev_sampled_token_ids = sampled.token_ids
        else:  # only prefill chunks that stop short of their prompt's end: nothing to sample
            sampled = SampledBatch(torch.empty(0, dtype=torch.long, device=self.device))
        if self.timeline is not None:
            self.timeline.append((start, time.perf_counter()))
        return sampled, prompt

    def _stage_forward(self, input_ids: torch.Tensor, inp: ModelInput) -> tuple[torch.Tensor | None, float]:
        """This stage's layers on the previous stage's activations (pipeline.py): the last stage's
        hidden states, or None once an earlier stage has sent its own on; and when the activations
        arrived (the timeline counts a stage's work, not its wait)."""
        pipe = self.pipeline
        intermediate = None if pipe.is_first else \
            pipe.recv(input_ids.shape[0], self.model_config.hidden_size, self.dtype, self.device)
        start = time.perf_counter()
        with set_forward_context(self.attn, inp.metadata):
            out = self.model(input_ids, inp.positions, intermediate)
        if pipe.is_last:
            return out, start
        if self.timeline is not None:
            self.timeline.append((start, time.perf_counter()))
        pipe.send(out)
        return None, start

    @staticmethod
    def _constrained(logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """Structured outputs (part 15): the grammars' disallowed tokens get -inf before sampling.
        The engine may still be filling the bitmask while the forward ran: wait for it here."""
        out = inp.grammar_output
        if out is None:
            return logits
        out.wait()
        idx = to_device(torch.from_numpy(np.array(out.indices, dtype=np.int64)), logits.device)
        allowed = unpack_bitmask(out.bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits

    def _propose_on_device(self, inp: ModelInput) -> torch.Tensor | None:
        """Run the draft model's passes, write its drafts into the target's input and return q for
        each draft ([sum of k, V], sequence-major, as the rejection sampler reads it)."""
        spec, drafter = inp.spec, self.drafter
        drafts: dict[int, list[int]] = {i: [] for i in range(len(spec.rows))}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(spec.rows))}
        prev = None
        for p in spec.draft_passes:
            input_ids = p.input_ids if p.input_ids is not None else prev[p.input_rows]
            with set_forward_context(drafter.attn, p.metadata):
                hidden = drafter.model(input_ids, p.positions)
            if not p.seqs:
                break
            logits = drafter.model.compute_logits(hidden[p.logits_indices])
            rows = [position_row(spec.rows[i], drafts[i], len(drafts[i]), spec.min_tokens_left[i]) for i in p.seqs]
            prev, q = sample_drafts(logits, rows)
            # The host needs the ids (penalty rows, the rejection sampler's bookkeeping): on a GPU
            # this is one small sync per pass.
            for r, (i, tok) in enumerate(zip(p.seqs, prev.tolist())):
                drafts[i].append(tok)
                probs[i].append(q[r])
        flat = [t for i in range(len(spec.rows)) for t in drafts[i]]
        if not flat:
            return None
        inp.input_ids[spec.draft_slots] = torch.tensor(flat, dtype=torch.long, device=self.device)
        spec.meta = SpecDecodeMetadata.from_drafts([drafts[i] for i in range(len(spec.rows))])
        return torch.stack([q for i in range(len(spec.rows)) for q in probs[i]])
