"""Part 03: paged attention. KV lives in fixed-size blocks of one preallocated pool, reached
through block tables; requests run in static batches."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
