"""Part 05: async scheduling. The engine schedules and launches step N+1 before step N's sampled
tokens reach the host; the model runs on one thread while scheduling, input preparation and
output processing run on another."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
