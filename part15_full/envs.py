"""Every `VLLM_COURSE_*` switch of part 15, with its default and what it does, read here and
nowhere else (shared/envs.py holds the engine core's own). All but the last few are off-switches of
the CPU appendix (cpu/README.md): each optimisation can be turned off alone, and the engine's
output stays the same to float rounding. The server prints the effective values at start-up
(`summary()`).

A switch is read when it is asked for (`envs.VLLM_COURSE_CPU_GEMM`): an engine reads each once,
while it starts (the backends are chosen then), so a test or a notebook can set a variable and
build a new engine.

In vLLM v0.33.0: vllm/envs.py."""
from __future__ import annotations

from typing import Any

from shared import envs as shared_envs
from shared.envs import EnvVar

environment_variables: dict[str, EnvVar] = {
    "VLLM_COURSE_CPU_RUNNER": EnvVar(
        "1", "a CPU step replayed by the CPU graph runner: the C kernels called with the weights bound once "
             "(0: the modules' forward)"),
    "VLLM_COURSE_CPU_ATTENTION": EnvVar(
        "1", "CPU paged attention in the C kernel that reads K/V blocks in place (0: the torch reference)"),
    "VLLM_COURSE_CPU_ATTENTION_TILES": EnvVar(
        "1", "a prefill's query rows in tiles that read each key once (0: row by row, as decode)"),
    "VLLM_COURSE_CPU_ATTENTION_AMX": EnvVar(
        "1", "bf16 decode scores on AMX tiles where the CPU has them"),
    "VLLM_COURSE_CPU_FUSED_OPS": EnvVar(
        "1", "RMSNorm, the rotary embedding and SiLU x up in fused C kernels (0: torch)"),
    "VLLM_COURSE_CPU_GEMM": EnvVar(
        "auto", "fp32 linear layers in the C GEMM kernel: auto where the build has AVX-512, 1 always, 0 oneDNN",
        str),
    "VLLM_COURSE_CPU_AMX": EnvVar(
        "1", "bf16 linear layers in the AMX GEMM kernel where the CPU has AMX (0: oneDNN)"),
    "VLLM_COURSE_CPU_MALLOC": EnvVar(
        "1", "glibc keeps freed activations in the heap (mmap and trim thresholds raised)"),
    "VLLM_COURSE_CPU_WIDE_VECTORS": EnvVar(
        "1", "the C kernels compiled to prefer 512-bit vectors where the CPU has AVX-512"),
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
    """The core's switches and this part's."""
    return {**shared_envs.environment_variables, **environment_variables}


def summary() -> str:
    """One line per switch with its effective value, for the server's start-up log."""
    lines = []
    for name, var in all_variables().items():
        value = var.read(name)
        mark = "" if value == var.parse(var.default) else "  (set)"
        lines.append(f"  {name}={value}{mark}")
    return "switches:\n" + "\n".join(lines)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name].read(name)
    if name in shared_envs.environment_variables:
        return getattr(shared_envs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
