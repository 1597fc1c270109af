"""Part 15's allocator settings on a CPU (cpu_malloc.py): freed activations stay in the heap."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import part15_full.model_runner as model_runner
from conftest import build_llm

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")

# A step's worth of activations: 20 tensors of 2 MiB, written, then freed together. glibc's
# defaults serve each from the heap once its adaptive threshold has risen, but trim the freed
# 40 MiB off the heap's top, so the next step maps and zeroes them again.
STEPS = """
import resource, sys, torch
from part15_full.cpu_malloc import tune_malloc
applied = tune_malloc()
def step():
    for x in [torch.empty(1 << 19) for _ in range(20)]:
        x.fill_(1.0)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(switch: str) -> tuple[str, int]:
    env = {"VLLM_COURSE_CPU_MALLOC": switch, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=120, check=True,
                         env=env).stdout.split()
    return out[0], int(out[1])


def test_freed_activations_are_reused_not_mapped_again():
    applied, faults = _page_faults("1")
    off, faults_off = _page_faults("0")
    assert (applied, off) == ("True", "False")
    # Off: each of the 20 steps faults its 40 MiB in again (about 10 thousand pages a step).
    assert faults_off > 20 * 5000, faults_off
    assert faults < faults_off / 20, (faults, faults_off)


def test_a_cpu_engine_applies_them(monkeypatch):
    calls = []
    monkeypatch.setattr(model_runner, "tune_malloc", lambda: calls.append(True))
    llm = build_llm("part15_full", kv_cache_memory_mb=8)
    try:
        assert calls == [True]
    finally:
        llm.shutdown()
