"""Part 01: a simple server. Prefill, decode with a contiguous KV cache, sampling, one request
at a time."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
