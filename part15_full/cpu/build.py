"""Part 15's C kernels for the CPU (csrc/*.c): compiled once per source, compiler and CPU, cached.

A kernel is a plain C file with no Python in it, compiled with the system's C compiler (`cc`, or
$CC) into a shared library in ~/.cache/vllm-course ($VLLM_COURSE_CACHE, beside the converted
model) and loaded with ctypes (kernels.py declares every function). `make setup` builds them
ahead (`main()` below). Without a compiler, or if a build fails, a warning says
so and the torch path serves: the engine's results are the same, to float rounding. Nothing is
compiled at install time, and a C file changed by a reader is rebuilt at its next use (the cache
key holds the source and the headers beside it)."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.gguf_convert import cache_root

from .. import envs

CSRC = Path(__file__).with_name("csrc")
# Tried in order: -march=native is what makes the loops AVX2/AVX-512; -fopenmp runs the kernels on
# torch's OpenMP threads (see paged_attention_cpu.c); a compiler that refuses a flag gets the next,
# plainer line (without -fopenmp the attention kernel starts its own threads).
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O2"])
# On x86, GCC vectorizes a plain loop (SiLU's exp, the rotary embedding) 8 floats wide even where
# the CPU has 16-float AVX-512 registers, unless asked: with this, SiLU x up and the rotary
# embedding ran 1.3-1.4x faster at a decode step's 25 rows on a Cascade Lake Xeon. The kernels
# written with explicit vector types (the GEMM's, attention's) do not change. No effect without
# AVX-512, and only x86 compilers know the flag. VLLM_COURSE_CPU_WIDE_VECTORS=0 leaves GCC's choice.
_X86_FLAGS = ["-mprefer-vector-width=512"]
logger = logging.getLogger(__name__)


def _cpu_id() -> str:
    """What -march=native depends on: a library built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(source: Path, compiler: str | None = None) -> Path | None:
    """Compile `source` (or find it compiled) -> the shared library's path; None if it cannot."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or not source.is_file():
        return None
    texts = [source.read_bytes()] + [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # its includes
    wide = envs.VLLM_COURSE_CPU_WIDE_VECTORS
    extra = _X86_FLAGS if wide and platform.machine().lower() in ("x86_64", "amd64") else []
    # Each -march=native line first with the extra flags, then without (a compiler too old to know them).
    flag_sets = [line for flags in _FLAG_SETS
                 for line in ([[*flags, *extra], flags] if extra and "-march=native" in flags else [flags])]
    key = hashlib.sha256(b"\0".join([*texts, compiler.encode(), platform.machine().encode(), _cpu_id().encode(),
                                      repr(flag_sets).encode()])).hexdigest()[:16]  # flags: a new set rebuilds
    target = cache_root() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    errors = []
    for flags in flag_sets:
        # Build beside the target, then rename: processes starting together never load half a file.
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        except OSError as e:  # a cache directory it may not write
            logger.warning("could not build %s in %s: %s", source.name, target.parent, e)
            return None
        os.close(fd)
        cmd = [compiler, *flags, "-fPIC", "-shared", "-pthread", str(source), "-o", tmp, "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            done, errors = None, errors + [str(e)]
        if done is not None and done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        if done is not None:
            errors.append(done.stderr.strip()[-500:])
    logger.warning("could not build %s with %s: %s", source.name, compiler, errors[-1] if errors else "")
    return None


def main() -> None:
    """Build every kernel ahead (`make setup` runs this); a kernel that does not build is reported,
    and the torch path serves it."""
    logging.basicConfig(format="setup: %(message)s")
    for source in sorted(CSRC.glob("*.c")):
        built = build(source)
        print(f"setup: {source.name} -> {built}" if built else
              f"setup: {source.name} not built; the torch path serves")


if __name__ == "__main__":
    main()
