"""Part 02: streaming. The engine runs on its own thread; the async server streams tokens over
SSE and stops a generation when its client goes away."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
