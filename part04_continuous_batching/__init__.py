"""Part 04: continuous batching. Every step admits new requests and decodes running ones in one
flattened batch; requests leave as soon as they finish; recompute preemption when blocks run out."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
