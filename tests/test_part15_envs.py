"""Part 15's switches in one registry (part15_full/envs.py, shared/envs.py): every VLLM_COURSE_*
variable the code names is registered there with a default and a line of doc, no other module
reads one from the environment itself, a switch is read when asked for, and the start-up summary
prints each effective value."""
from __future__ import annotations

import re
from pathlib import Path

import part15_full.envs as envs
import shared.envs as shared_envs

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"VLLM_COURSE_[A-Z0-9_]+")


def sources():
    for folder in ("shared", "part15_full"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, path.read_text()


def test_every_switch_the_code_names_is_registered_with_a_default_and_a_doc():
    registry = envs.all_variables()
    named = {name for _, text in sources() for name in NAME.findall(text)}
    assert named - set(registry) == set(), "named in the code but not registered"
    assert all(var.default is not None and len(var.doc) > 20 for var in registry.values())


def test_only_the_registries_read_the_environment():
    readers = [path.relative_to(ROOT).as_posix() for path, text in sources()
               if re.search(r"os\.(environ|getenv)[^\n]*VLLM_COURSE_", text)]
    assert readers == [], readers
    assert "os.environ" in (ROOT / "shared/envs.py").read_text()


def test_a_switch_is_read_when_asked_and_the_summary_shows_the_effective_values(monkeypatch):
    monkeypatch.delenv("VLLM_COURSE_CPU_GEMM", raising=False)
    assert envs.VLLM_COURSE_CPU_GEMM == "auto" and envs.VLLM_COURSE_CPU_RUNNER is True
    monkeypatch.setenv("VLLM_COURSE_CPU_RUNNER", "0")
    monkeypatch.setenv("VLLM_COURSE_CPU_PREPACK", "0")
    assert envs.VLLM_COURSE_CPU_RUNNER is False and shared_envs.VLLM_COURSE_CPU_PREPACK is False
    assert envs.VLLM_COURSE_CPU_PREPACK is False  # the core's switches through part 15's registry too
    lines = envs.summary().splitlines()[1:]
    assert len(lines) == len(envs.all_variables())
    assert "  VLLM_COURSE_CPU_RUNNER=False  (set)" in lines and "  VLLM_COURSE_CPU_GEMM=auto" in lines
