"""A system under test: anything that loads once, then turns a list of benchmark requests into
their output token ids. Our engine (any part's `LLM`) and each HF baseline are one of these, so
the throughput harness measures them all with the same code and the same clock."""
from __future__ import annotations

import gc
import importlib
import inspect
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch

from .workload import BenchRequest


@dataclass(frozen=True)
class Sampling:
    """How every system samples the workload, on top of ignore_eos and max_tokens=output_len (always
    set: each request yields exactly its output_len tokens). The defaults are vLLM's SamplingParams
    defaults, so `--sampling top_p=0.9` samples at temperature 1.0; the bench's own default is GREEDY.
    No seed unless given: unseeded sampling is what a server mostly sees (a seeded request draws from
    its own generator, another path in vLLM and ours). A given seed goes to every request as is."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Deterministic: the same tokens every round, and in every system with the same weights."""
        return self.temperature == 0.0

    def kwargs(self) -> dict[str, Any]:
        """SamplingParams keywords (ours and vLLM's spell them alike): temperature and what differs from
        the defaults, so a greedy run passes exactly what it always did."""
        default = Sampling()
        return {k: v for k, v in asdict(self).items() if k == "temperature" or v != getattr(default, k)}

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.kwargs().items()) + ", ignore_eos, max_tokens=output_len"

    def to_dict(self) -> dict[str, Any]:
        """For a report's workload: every field, defaults included, and what every request also gets."""
        return {**asdict(self), "ignore_eos": True, "max_tokens": "output_len"}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Sampling:
        """to_dict's inverse; None (a report from before sampling was recorded): greedy."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d}) if d else GREEDY


GREEDY = Sampling(temperature=0.0)


def parse_sampling(text: str | None) -> Sampling:
    """'temperature=1.0,top_p=0.9,top_k=50' -> Sampling; None or '' -> GREEDY. An unknown key or a
    value out of range is refused here, before any engine loads."""
    if not text:
        return GREEDY
    known = {f.name for f in fields(Sampling)}
    values: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (x.strip() for x in pair.partition("="))
        if key not in known or not sep:
            raise ValueError(f"--sampling wants key=value pairs with keys from {', '.join(sorted(known))}; "
                             f"got {pair!r}")
        cast = int if key in ("top_k", "seed") else float
        try:
            values[key] = cast(value)
        except ValueError:
            raise ValueError(f"--sampling {key} wants {'an integer' if cast is int else 'a number'}, "
                             f"got {value!r}") from None
    sampling = Sampling(**values)
    from shared.sampling_params import SamplingParams

    SamplingParams(**sampling.kwargs())  # vLLM's ranges (temperature >= 0, 0 < top_p <= 1, ...)
    return sampling


class BenchSystem:
    """Lifecycle: load() -> prepare(all requests) -> generate(warm-up requests) ->
    generate(all requests) [timed] -> close()."""

    name: str = "system"
    sampling: Sampling = GREEDY  # what generate() samples with (a system that cannot sample refuses)

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
                 name: str = "ours", sampling: Sampling = GREEDY):
        super().__init__()
        self.spec, self.name, self.sampling = llm, name, sampling
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
        # ignore_eos: every request produces exactly output_len tokens, in every system.
        params = [sp(**self.sampling.kwargs(), max_tokens=r.output_len, ignore_eos=True) for r in requests]
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
