"""Part 13: prefill/decode disaggregation. KV connectors move KV blocks in and out of an engine's pool
(vLLM V1's KVConnectorBase_V1): part 12's host tier as the OffloadingConnector, an ExampleConnector
on shared storage, and a NIXL-shaped connector through which a decode engine pulls a prefill
engine's blocks; a proxy in front sends each request to a prefill server, then to a decode server."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
