"""Part 15: the whole engine. Every technique of parts 01-14 behind one configuration with its
off-switch, served as an OpenAI-compatible server with what a production server needs: structured
outputs, Prometheus metrics, tokenize/detokenize, API keys, graceful shutdown, torch.compile, and a
`bench serve` client."""
from shared.outputs import CompletionOutput, RequestOutput

from .llm import LLM
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
