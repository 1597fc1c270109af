"""Every `VLLM_COURSE_*` switch of part 15, with its default and what it does, read here and
nowhere else: this stage's own below, the engine core's in shared/envs.py, and the CPU appendix's
off-switches in cpu/envs.py (each of its optimisations can be turned off alone, and the engine's
output stays the same to float rounding). `all_variables()` is the one registry of all three, and
the server prints their effective values at start-up (`summary()`).

A switch is read when it is asked for (`envs.VLLM_COURSE_CPU_GEMM`): an engine reads each once,
while it starts (the backends are chosen then), so a test or a notebook can set a variable and
build a new engine.

In vLLM v0.33.0: vllm/envs.py."""
from __future__ import annotations

from typing import Any

from shared import envs as shared_envs
from shared.envs import EnvVar

from .cpu import envs as cpu_envs

environment_variables: dict[str, EnvVar] = {
    "VLLM_PP_LAYER_PARTITION": EnvVar(
        "", "pipeline stages' layer counts, comma-separated (4,6,6,4); empty: an even split (pipeline.py)", str),
    "VLLM_COURSE_STEP_TIMELINE": EnvVar(
        "", "a folder: each worker writes rank<N>.json there at exit, the (start, end) of every step it ran "
            "(notebook 15's pipeline timeline)", str),
    "VLLM_COURSE_GRAPH_STAND_IN": EnvVar(
        "0", "tests without a GPU: --compilation-config's CUDA graphs on a CPU, each replay recomputing its "
             "captured call (cuda_graph.EagerGraph)"),
}


def all_variables() -> dict[str, EnvVar]:
    """The core's switches, the CPU appendix's and this part's."""
    return {**shared_envs.environment_variables, **cpu_envs.environment_variables, **environment_variables}


def summary() -> str:
    """One line per switch with its effective value, for the server's start-up log."""
    lines = []
    for name, var in all_variables().items():
        value = var.read(name)
        mark = "" if value == var.parse(var.default) else "  (set)"
        lines.append(f"  {name}={value}{mark}")
    return "switches:\n" + "\n".join(lines)


def __getattr__(name: str) -> Any:
    registry = all_variables()
    if name in registry:
        return registry[name].read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
