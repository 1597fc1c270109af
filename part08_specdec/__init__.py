"""Part 08: speculative decoding. A cheap proposer (n-gram prompt lookup, or a draft model) guesses
k tokens; the target scores them all in one pass and a rejection sampler keeps a prefix of them plus
one token of its own, so each step yields 1..k+1 tokens with the target's exact distribution."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
