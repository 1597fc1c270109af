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
import signal
import subprocess
import tempfile
from pathlib import Path

from shared.gguf_convert import cache_root

from . import envs

CSRC = Path(__file__).with_name("csrc")


def _cpu_flags() -> str:
    """/proc/cpuinfo's flags line (what -march=native depends on: a library built on one CPU may
    not run on another), else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


# Tried in order: -march=native is what makes the loops AVX2/AVX-512; -fopenmp runs the kernels on
# torch's OpenMP threads (see paged_attention_cpu.c); a compiler that refuses a flag gets the next,
# plainer line (without -fopenmp the attention kernel starts its own threads). A line that is not
# the first is a slower kernel: the log says so.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O2"])
_TIMEOUT_S = 120
# -O2 for the attention kernel on an x86 CPU without AVX-512: there GCC splits its 16-float vectors
# into pairs of 8, and -O3 then spends about 4 minutes on it (a 2-core AVX2 EPYC: 221-247 s, against
# 18 s at -O2), past the timeout, for no speed (the engine's decode step at batch 64: 9.64 ms at
# -O3, 9.62 at -O2). The other kernels build in seconds, and -O3 keeps the fused ops 3% faster.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_SLOW_AT_O3 = {"paged_attention_cpu.c"} if _X86 and "avx512f" not in _cpu_flags().split() else set()
# On x86, GCC vectorizes a plain loop (SiLU's exp, the rotary embedding) 8 floats wide even where
# the CPU has 16-float AVX-512 registers, unless asked: with this, SiLU x up and the rotary
# embedding ran 1.3-1.4x faster at a decode step's 25 rows on a Cascade Lake Xeon. The kernels
# written with explicit vector types (the GEMM's, attention's) do not change. No effect without
# AVX-512, and only x86 compilers know the flag. VLLM_COURSE_CPU_WIDE_VECTORS=0 leaves GCC's choice.
_X86_FLAGS = ["-mprefer-vector-width=512"]
logger = logging.getLogger(__name__)


def build(source: Path, compiler: str | None = None) -> Path | None:
    """Compile `source` (or find it compiled) -> the shared library's path; None if it cannot."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or not source.is_file():
        return None
    texts = [source.read_bytes()] + [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # its includes
    wide = envs.VLLM_COURSE_CPU_WIDE_VECTORS
    extra = _X86_FLAGS if wide and _X86 else []
    # Each -march=native line first with the extra flags, then without (a compiler too old to know them).
    opt = "-O2" if source.name in _SLOW_AT_O3 else "-O3"
    flag_sets = [[opt if f == "-O3" else f for f in line] for flags in _FLAG_SETS
                 for line in ([[*flags, *extra], flags] if extra and "-march=native" in flags else [flags])]
    key = hashlib.sha256(b"\0".join([*texts, compiler.encode(), platform.machine().encode(), _cpu_flags().encode(),
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
            done = _compile(cmd)
        except (OSError, subprocess.TimeoutExpired) as e:
            done, errors = None, errors + [str(e)]
        if done is not None and done.returncode == 0:
            os.replace(tmp, target)
            if flags is not flag_sets[0]:
                logger.warning("built %s with %s only (%s failed): a slower kernel", source.name, " ".join(flags),
                               " ".join(flag_sets[0]))
            return target
        os.unlink(tmp)
        if done is not None:
            errors.append(done.stderr.strip()[-500:])
    logger.warning("could not build %s with %s: %s", source.name, compiler, errors[-1] if errors else "")
    return None


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in a process group of its own: on a timeout the whole group goes (the driver's
    cc1 would otherwise go on compiling, on a core the engine needs)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
