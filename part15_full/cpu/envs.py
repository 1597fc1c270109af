"""The CPU appendix's switches: each turns one of its optimisations off (or picks its variant), and
the engine's output stays the same to float rounding. Part 15's registry (../envs.py) lists them with
its own and the engine core's; a switch is read when it is asked for (`envs.VLLM_COURSE_CPU_GEMM`),
and an engine asks while it starts, as it picks its CPU platform's pieces (platform.py).

In vLLM v0.33.0: vllm/envs.py (VLLM_CPU_* beside the rest)."""
from __future__ import annotations

from typing import Any

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
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name].read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
