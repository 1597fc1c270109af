"""Part 06: chunked prefill. Every step has a token budget; running sequences decode first, and
prompts longer than what is left are computed in chunks over several steps, so a long prompt no
longer stalls the streams already running."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
