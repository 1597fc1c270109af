"""Part 11: mixture of experts and expert parallelism. Mixtral and Qwen2-MoE checkpoints (a model
registry), an MoE block of stacked experts with a top-k router, and experts spread over the ranks
with all-to-all dispatch and combine."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
