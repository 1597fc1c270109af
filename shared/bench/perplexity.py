"""Perplexity of an engine's model on a text every Python install carries.

The text is the prose of the standard library's `pydoc_data/topics.py` (the help() topics: English
reStructuredText, ~465k characters; technical, with markup), so no download is needed. It is
tokenized once, cut into windows of `window` tokens, and each window is scored by the engine's own
model (its quantized layers included): perplexity = exp(mean negative log-likelihood of every token
given the ones before it in its window). Lower is better; the number only compares formats of one
model on one text.

    python -m shared.bench perplexity --part part14_quant --engine-arg quantization=int8

In vLLM: there is no built-in perplexity command; its quantization docs report lm-eval-harness
scores (e.g. wikitext perplexity) for quantized checkpoints."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch

from shared.attention import NoCacheAttention
from shared.forward_context import set_forward_context


def topics_text() -> str:
    """The help topics' text, in a fixed order."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int
    windows: int


@torch.inference_mode()
def model_perplexity(model, ids: list[int], window: int) -> PerplexityResult:
    """exp(mean NLL) over non-overlapping windows of `window` tokens (each predicts tokens 1..w-1)."""
    nll, count, windows = 0.0, 0, 0
    device = next(model.parameters()).device
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window], device=device)
        if len(chunk) < 2:
            break
        with set_forward_context(NoCacheAttention(model.config.head_dim ** -0.5)):
            hidden = model(chunk, torch.arange(len(chunk), device=device))
        logprobs = model.compute_logits(hidden[:-1]).log_softmax(dim=-1)
        nll -= logprobs.gather(1, chunk[1:, None]).sum().item()
        count += len(chunk) - 1
        windows += 1
    return PerplexityResult(math.exp(nll / count), count, windows)


def run_perplexity(part: str, max_tokens: int, window: int, model: str | None = None, **engine_kwargs):
    """Build `part`'s LLM (its model, in this process) and score the first `max_tokens` of the text."""
    llm = importlib.import_module(part).LLM(model=model, **engine_kwargs)
    try:
        ids = llm.tokenizer.encode(topics_text())[:max_tokens]
        return model_perplexity(llm.engine.executor.runner.model, ids, window)
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
