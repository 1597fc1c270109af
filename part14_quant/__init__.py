"""Part 14: weight-only quantization. Linear layers (and MoE experts) hold int8 or int4 weights,
quantized as a float checkpoint loads (--quantization int8|int4) or read from a GPTQ checkpoint, and
dequantized inside the matrix product."""
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
