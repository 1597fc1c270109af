"""The host's share of a step: engines on a model whose arithmetic costs next to nothing.

A step of a 135M model on a GPU is well under a millisecond of kernels; what an engine does around
them (scheduling, building the step's inputs, sampling, detokenizing, output processing, the
Python between kernel launches) is then the step. A CPU cannot show kernel launches, but it shows
the rest: on `tiny_model.py`'s model (hidden 128, 2 layers, random weights) each engine runs a
fixed workload at a given batch size (`max_num_seqs`), and its time per step is the wall time
divided by the steps that batch needs (output tokens / batch). The same workload, batch limits,
token budget and sampling go to every engine, vLLM's CPU build included (`--vllm-python`).
Greedy by default; `--sampling temperature=1.0,top_p=0.9,top_k=50,repetition_penalty=1.1` (the
fields of systems.Sampling; no seed unless `seed=N` is given) prices the sampler's work as well:
top-k/top-p masking, penalties, drawing from the distribution.

    python -m shared.bench host --part part15_full --compare part04_continuous_batching \\
        --batch-sizes 1,64,256 --vllm-python /path/to/venv/bin/python --json host.json"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .systems import GREEDY, Sampling
from .throughput import run_throughput
from .tiny_model import make_tiny_model
from .workload import make_workload


@dataclass
class HostRow:
    system: str
    batch: int
    wall_s: float
    output_tokens: int
    error: str | None = None

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.wall_s * self.batch / self.output_tokens if self.output_tokens else float("nan")


@dataclass
class HostResult:
    workload: dict[str, Any]
    machine: dict[str, Any]
    rows: list[HostRow] = field(default_factory=list)

    def table(self) -> str:
        systems = list(dict.fromkeys(r.system for r in self.rows))
        batches = sorted({r.batch for r in self.rows})
        width = max(len(s) for s in systems) + 2
        lines = [f"{'ms per step':{width}s}" + "".join(f"{f'batch {b}':>12s}" for b in batches)]
        for s in systems:
            cells = []
            for b in batches:
                row = next((r for r in self.rows if r.system == s and r.batch == b), None)
                cells.append(f"{'-' if row is None or row.error else f'{row.ms_per_step:.2f}':>12s}")
            lines.append(f"{s:{width}s}" + "".join(cells))
        sampling = Sampling.from_dict(self.workload.get("sampling"))
        if not sampling.greedy:
            lines.append(f"sampling: {sampling.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "machine": self.machine,
                "rows": [{**asdict(r), "ms_per_step": r.ms_per_step} for r in self.rows]}


def run_host(part: str, batch_sizes: Sequence[int], *, compare: Sequence[str] = (), num_requests: int = 256,
             input_len: str = "16:48", output_len: str = "64", seed: int = 0, rounds: int = 1,
             max_num_batched_tokens: int = 2048, vllm_python: str | None = None,
             vllm_kwargs: dict[str, Any] | None = None, model: str | None = None,
             progress: bool = False, sampling: Sampling = GREEDY) -> HostResult:
    """Each engine (`part` and `compare`, specs as throughput's --compare) and vLLM at each batch size;
    `model`: a folder with config.json and a tokenizer (default: tiny_model.py's, made in a temp dir)."""
    model = model or str(make_tiny_model(Path(tempfile.gettempdir()) / "vllm-course-tiny-llama"))
    workload = make_workload(model, num_requests, input_len, output_len, seed)
    rows, machine = [], {}
    for batch in batch_sizes:
        kwargs = {"load_format": "dummy", "max_num_seqs": batch, "max_num_batched_tokens": max_num_batched_tokens}
        res = run_throughput(part, workload, model=model, engine_kwargs=kwargs, baselines=(), floor=False,
                             vllm_python=vllm_python, vllm_kwargs=vllm_kwargs, compare=compare, rounds=rounds,
                             progress=progress, sampling=sampling)
        machine = res.machine
        rows += [HostRow(s.name, batch, s.wall_s, s.output_tokens, s.error) for s in res.systems]
    return HostResult({**workload.describe(), "model": model, "max_num_batched_tokens": max_num_batched_tokens,
                       "sampling": sampling.to_dict()}, machine, rows)


def save_json(result: HostResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=1))
