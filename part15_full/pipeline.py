"""Pipeline parallelism: the model's layers split into stages, one group of TP ranks each.

Stage s holds layers get_pp_indices(L, s, PP) and a KV cache for those layers only; the first stage
embeds the tokens, the last normalises, projects to the vocabulary and samples (shared/model.py
builds a stage's part, PPMissingLayer in place of the others). A step flows through the stages:
each TP rank of a stage receives the previous stage's hidden states and residual from the rank with
its own TP index there, runs its layers and sends its own on. The shapes are the step's (its token
count, which every rank knows from the step message) by the model's hidden size: only the tensors
travel, point to point (gloo on a CPU, NCCL on GPUs).

A stage idles while the others work on a step: with one step at a time, each of PP stages is busy
1/PP of the time (the bubble). So the engine keeps up to PP steps in flight (engine.py,
`max_steps_in_flight`), each with sequences the others do not hold, since a sequence's next input
is the token its step in flight has not sampled yet: the scheduler skips sequences in flight and
gives each step at most max_num_seqs / PP of them (scheduler.py). Stage 0 then runs step N + 1
while stage 1 runs step N.

In vLLM: vllm/distributed/utils.py (get_pp_indices, VLLM_PP_LAYER_PARTITION),
vllm/model_executor/models/utils.py (PPMissingLayer, make_layers), vllm/sequence.py
(IntermediateTensors), vllm/v1/worker/gpu_model_runner.py (the stage's forward) and
vllm/v1/engine/core.py (step_with_batch_queue, max_concurrent_batches)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import envs

logger = logging.getLogger(__name__)


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage `pp_rank`: an even split, the remainder one layer each to the
    stages before the last (which also holds the norm and the head), or VLLM_PP_LAYER_PARTITION's
    comma-separated counts."""
    spec = envs.VLLM_PP_LAYER_PARTITION
    if spec:
        try:
            counts = [int(n) for n in spec.split(",")]
        except ValueError:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={spec!r}: give one layer count per stage, as 4,6,6,4") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={spec!r} must give each of the {pp_size} stages at least "
                             f"one layer, {num_layers} in all")
    else:
        if num_layers < pp_size:
            raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
        counts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            counts[-i] += 1
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


@dataclass
class PipelineStage:
    """One rank's place in the pipeline, and its transfers to the stages beside it."""
    pp_rank: int
    pp_size: int
    tp_size: int
    rank: int  # global

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden states, residual) of this step."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=self.rank - self.tp_size)
        dist.recv(residual, src=self.rank - self.tp_size)
        return hidden, residual

    def send(self, intermediate: tuple[torch.Tensor, torch.Tensor]) -> None:
        for t in intermediate:
            dist.send(t.contiguous(), dst=self.rank + self.tp_size)
