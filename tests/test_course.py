"""The course tool: every carried-forward file is byte-identical unless its part declares the
change, and `check` really catches drift."""
from __future__ import annotations

import shutil

from shared import course


def test_stages_keep_their_promises():
    assert course.check() == []


def test_each_stage_diff_shows_its_technique():
    stat = course.diff(course.find_stage("03"), course.find_stage("04"), stat=True)
    assert "scheduler.py" in stat and "added" in stat
    assert "paged_attention.py" not in stat  # carried forward unchanged


def test_check_catches_an_undeclared_change(tmp_path):
    for name in ("part01_simple_server", "part02_streaming"):
        shutil.copytree(course.ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    assert course.check(tmp_path) == []
    (tmp_path / "part02_streaming" / "engine.py").write_text("# drifted\n")
    (tmp_path / "part02_streaming" / "extra.py").write_text("x = 1\n")
    problems = course.check(tmp_path)
    assert any("engine.py differs" in p for p in problems)
    assert any("extra.py is new" in p for p in problems)
