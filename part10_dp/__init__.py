"""Part 10: data parallelism. Several engine-core processes, each a whole engine with its own KV
cache, behind one API server that routes every request to one of them (round-robin, least-loaded,
or cache-aware on the prompt's block hashes) over ZeroMQ, and survives an engine's death."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
