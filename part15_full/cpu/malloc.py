"""glibc's allocator set up for an engine on a CPU: freed activations stay in the heap.

Why. torch takes a CPU tensor's memory from malloc. glibc serves a large request (128 KiB at
first) with a fresh mmap and gives it back to the kernel on free; it raises that threshold as it
sees large blocks freed, but only up to 32 MiB, and it trims the heap's top whenever enough of it
is free. A decode step allocates and frees hundreds of activations of a few hundred KiB to a few
MiB, so the kernel keeps mapping new pages and zeroing them at their first touch (a page fault for
each 4 KiB). On the held-out workload (bf16, one round) part 15 took 110-160 thousand page faults
and 0.3-0.4 s of system time; with the settings below 40 thousand and 0.2 s.

How. `mallopt` sets the mmap threshold to glibc's ceiling (32 MiB: a larger value is refused) and
the trim threshold above it, so blocks under 32 MiB come from the heap and freed ones are reused.
A setting made explicitly turns glibc's adaptive thresholds off: setting only the trim threshold
would leave the mmap threshold at 128 KiB, measured 5x worse than the default. Weights and the KV
pool are larger and still get their own mappings. Linux with glibc only; anything else is left
as it is.

vLLM's CPU build gets the same effect from tcmalloc, which it asks for in LD_PRELOAD (v0.33.0:
vllm/platforms/cpu.py sets LD_PRELOAD for the processes it starts; vllm/v1/worker/cpu_worker.py
warns when libtcmalloc is not preloaded).

Off-switch: VLLM_COURSE_CPU_MALLOC=0."""
from __future__ import annotations

import ctypes
import logging
import platform

from . import envs

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def tune_malloc() -> bool:
    """Apply the settings to this process (once is enough; again is harmless). True if applied."""
    if not envs.VLLM_COURSE_CPU_MALLOC:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the CPU allocator settings; glibc's defaults stay")
    return ok
