"""Part 12: a second tier of KV blocks in host memory. Preempted requests swap their KV there and
back instead of recomputing it (--preemption-mode swap), and full prompt blocks are kept there
under their block hashes, so a prefix evicted from the device comes back by copy
(--kv-offloading-size)."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
