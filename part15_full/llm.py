"""The offline API, in vLLM's shape: LLM(...).generate(prompts, sampling_params)."""
from __future__ import annotations

from typing import Any, Sequence

from shared.outputs import RequestOutput

from .config import EngineConfig
from .engine import LLMEngine
from .sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | list[int], str | None]]:
    """(prompt, cache_salt) pairs."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    out = []
    for p in prompts:
        salt = None
        if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt, with an optional cache_salt
            salt = p.get("cache_salt")
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        out.append((p, salt))
    return out


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None,
                 dtype: str | None = None, **kwargs: Any):
        self.config = EngineConfig(model=model, device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        prompts = _normalize_prompts(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        # Validate every request before running any, so one bad prompt costs nothing.
        requests = [self.engine.processor.process_inputs(p, sp, cache_salt=salt)
                    for (p, salt), sp in zip(prompts, params)]
        return self.engine.generate(requests)

    def shutdown(self) -> None:
        """End the worker processes (tensor parallelism); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (a cold start for benchmarks); False while requests run."""
        return self.engine.reset_prefix_cache()

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)
