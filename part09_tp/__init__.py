"""Part 09: tensor parallelism. Every large weight is split across N worker processes (ranks):
column-parallel and row-parallel linears, heads and vocabulary sharded, one all-reduce per attention
and MLP block. The engine stays in its own process and drives the ranks through a multiprocess
executor."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
