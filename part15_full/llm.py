"""The offline API, in vLLM's shape: LLM(...).generate(prompts, sampling_params)."""
from __future__ import annotations

from typing import Any, Sequence

from shared.outputs import RequestOutput

from .chat_template import load_chat_template, render_chat
from .config import EngineConfig
from .engine import LLMEngine
from .generation_config import default_sampling_params
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

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config)."""
        defaults = default_sampling_params(self.config.generation_config, self.engine.executor.model_path)
        return SamplingParams(**defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """`priority`: one per prompt, lower first (needs scheduling_policy="priority")."""
        prompts = _normalize_prompts(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        # Validate every request before running any, so one bad prompt costs nothing.
        requests = [self.engine.processor.process_inputs(p, sp, cache_salt=salt, priority=prio)
                    for (p, salt), sp, prio in zip(prompts, params, priority)]
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
        template = load_chat_template(self.config.chat_template) if self.config.chat_template else None
        prompts = [self.tokenizer.encode(render_chat(self.tokenizer, c, template), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params)
