"""Every environment switch the engine core (shared/) reads, with its default and what it does,
read here and nowhere else. Part 15 registers its own beside these (part15_full/envs.py), and its
server prints the effective values at start-up.

A switch is read when it is asked for (`envs.VLLM_COURSE_CPU_PREPACK`), not at import, so a test
or a notebook can set the variable and build a new engine; a running engine keeps what it chose
at start-up.

In vLLM v0.33.0: vllm/envs.py (a dict of name -> how to read it, and a module __getattr__)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def flag(value: str) -> bool:
    """'0' turns a switch off; anything else leaves it on."""
    return value != "0"


@dataclass(frozen=True)
class EnvVar:
    default: str
    doc: str
    parse: Callable[[str], Any] = flag

    def read(self, name: str) -> Any:
        return self.parse(os.environ.get(name, self.default))


environment_variables: dict[str, EnvVar] = {
    "VLLM_COURSE_CACHE": EnvVar(
        "~/.cache/vllm-course", "where the converted GGUF model and part 15's compiled CPU kernels are kept",
        lambda v: Path(v).expanduser()),
    "VLLM_COURSE_CPU_PREPACK": EnvVar(
        "1", "CPU linear layers on weights prepacked once for oneDNN (0: F.linear every call)"),
    "VLLM_COURSE_CHUNKED_ARGMAX": EnvVar(
        "1", "greedy argmax on a CPU in chunks of the vocabulary (0: torch's argmax)"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name].read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
