"""Part 07: prefix caching. Full KV blocks are content-addressed by a chained hash of their
tokens; a request whose prompt starts like an earlier one reuses those blocks and computes only
the rest. Freed blocks stay cached until their memory is needed."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
