"""A system under test: anything that loads once, then turns a list of benchmark requests into
their output token ids. Our engine (any part's `LLM`) and each HF baseline are one of these, so
the throughput harness measures them all with the same code and the same clock."""
from __future__ import annotations

import gc
import importlib
import inspect
from typing import Any, Callable

import torch

from .workload import BenchRequest


class BenchSystem:
    """Lifecycle: load() -> prepare(all requests) -> generate(warm-up requests) ->
    generate(all requests) [timed] -> close()."""

    name: str = "system"

    def __init__(self) -> None:
        self.notes: dict[str, Any] = {}  # settings worth printing beside the numbers

    def load(self) -> None:
        pass

    def prepare(self, requests: list[BenchRequest]) -> None:
        """Size anything workload-dependent before the warm-up (not timed)."""

    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list[list[int]]:
        raise NotImplementedError

    def reset(self) -> None:
        """Before a repeated round: forget what the last one left that would make this one faster
        than the first (cached prefixes: the same prompts would all hit)."""

    def close(self) -> None:
        pass


def free_memory() -> None:
    """Drop what a finished system left behind, so the next one starts on a clean device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work, so a stopwatch read afterwards is honest."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


LLMSpec = str | type | Callable[[], Any] | Any  # a part name, an LLM class, a factory, an instance


class EngineSystem(BenchSystem):
    """Our engine through its offline API: `LLM(...).generate(prompt_ids, [SamplingParams])`.

    `llm` is a part's module name ("part04_continuous_batching"), an LLM class, a zero-argument
    factory, or an already-built LLM (then load time is not ours to measure, and close() leaves
    it alive for its owner)."""

    def __init__(self, llm: LLMSpec, model: str | None = None, device: str | None = None,
                 dtype: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 name: str = "ours"):
        super().__init__()
        self.spec, self.name = llm, name
        self.model, self.device, self.dtype = model, device, dtype
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm: Any = None
        self.owned = True  # False when the caller built the engine: its load time is not ours
        self.sampling_params_cls: Any = None
        # What the built engine resolved (None where a part has no such setting), for a peer
        # system that must run with the same: context length and KV-cache budget.
        self.max_model_len: int | None = None
        self.kv_cache_memory_mb: int | None = None
        self.notes = {"engine": llm if isinstance(llm, str) else getattr(llm, "__name__", "LLM"),
                      **self.engine_kwargs}

    def load(self) -> None:
        spec = importlib.import_module(self.spec).LLM if isinstance(self.spec, str) else self.spec
        if isinstance(spec, type):
            self.llm = spec(model=self.model, device=self.device, dtype=self.dtype, **self.engine_kwargs)
        elif hasattr(spec, "generate"):
            self.llm, self.owned = spec, False
        elif callable(spec):
            self.llm = spec()
        else:
            raise TypeError(f"cannot build an engine from {spec!r}")
        engine, config = getattr(self.llm, "engine", None), getattr(self.llm, "config", None)
        ints = [v for v in (getattr(engine, "max_model_len", None), getattr(config, "max_model_len", None))
                if isinstance(v, int)]
        self.max_model_len = ints[0] if ints else None
        kv_mb = getattr(config, "kv_cache_memory_mb", None)
        self.kv_cache_memory_mb = kv_mb if isinstance(kv_mb, int) else None
        # Each part re-exports the SamplingParams its engine understands; fall back to shared's.
        package = importlib.import_module(type(self.llm).__module__.split(".")[0])
        self.notes["engine"] = package.__name__
        self.sampling_params_cls = getattr(package, "SamplingParams", None)
        if self.sampling_params_cls is None:
            from shared.sampling_params import SamplingParams

            self.sampling_params_cls = SamplingParams

    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list[list[int]]:
        sp = self.sampling_params_cls
        # Greedy and ignore_eos: every request produces exactly output_len tokens, in every system.
        params = [sp(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        prompts = [r.prompt_token_ids for r in requests]
        kwargs = {}
        if "use_tqdm" in inspect.signature(self.llm.generate).parameters:
            kwargs["use_tqdm"] = progress  # later parts show a bar like vLLM's LLM.generate
        outputs = self.llm.generate(prompts, params, **kwargs)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def reset(self) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)  # parts 07 on
        if reset is not None and not reset():
            raise RuntimeError("the prefix cache could not be reset (blocks still in use)")

    def close(self) -> None:
        self.llm = None  # an engine the caller passed in stays alive in the caller's hands
        free_memory()
