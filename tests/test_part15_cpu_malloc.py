"""Part 15's allocator settings on a CPU (cpu/malloc.py): freed activations stay in the heap."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import part15_full.cpu.malloc as cpu_malloc
from part15_full.cpu.malloc import tune_malloc
from conftest import build_llm

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")

# A step's worth of activations: 20 tensors of 1 MiB, written, then freed together, 20 times. The
# control fixes glibc's mmap threshold at its starting 128 KiB: each tensor is then a fresh mapping,
# faulted in page by page at every step. glibc's own default is adaptive (the threshold rises after
# a large free), so whether it re-faults this pattern depends on what the process freed before:
# a fresh clone's run measured 512 faults, a developer's 204 thousand. A fixed control cannot
# pass by luck.
STEPS = """
import ctypes, resource, sys, torch
from part15_full.cpu.malloc import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
else:
    assert ctypes.CDLL(None).mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD
def step():
    for x in [torch.empty(1 << 18) for _ in range(20)]:
        x.fill_(1.0)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    return int(out.stdout.split()[-1])


def test_freed_activations_are_reused_not_mapped_again():
    faults, control = _page_faults("tuned"), _page_faults("control")
    # The control faults its 20 MiB in again at each of the 20 steps: ~100 thousand pages.
    assert control > 20 * 2500, control
    assert faults < control / 20, (faults, control)


def test_the_off_switch(monkeypatch):
    monkeypatch.setenv("VLLM_COURSE_CPU_MALLOC", "0")
    assert tune_malloc() is False


def test_a_cpu_engine_applies_them(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_malloc, "tune_malloc", lambda: calls.append(True))
    llm = build_llm("part15_full", kv_cache_memory_mb=8)
    try:
        assert calls == [True]
    finally:
        llm.shutdown()
