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


def test_server_groups_are_byte_identical_server_files():
    groups = course.server_groups()
    parts = [s.name for g in groups for s in g]
    assert sorted(parts) == [s.name for s in course.stages() if (s.path / "server.py").is_file()]
    texts = [g[0].path.joinpath("server.py").read_bytes() for g in groups]
    assert len(set(texts)) == len(groups)  # groups really differ
    for g, text in zip(groups, texts):
        assert [s.number for s in g] == sorted(s.number for s in g)
        assert all(s.path.joinpath("server.py").read_bytes() == text for s in g)


def test_server_groups_follow_the_bytes(tmp_path):
    for name in ("part01_simple_server", "part02_streaming"):
        shutil.copytree(course.ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tmp_path / "part02_streaming", tmp_path / "part03_copy")
    names = lambda: [[s.name for s in g] for g in course.server_groups(tmp_path)]  # noqa: E731
    assert names() == [["part01_simple_server"], ["part02_streaming", "part03_copy"]]
    server = tmp_path / "part03_copy" / "server.py"
    server.write_bytes(server.read_bytes() + b"\n")  # one byte is a different server
    assert names() == [["part01_simple_server"], ["part02_streaming"], ["part03_copy"]]


def _notebook(*cells, full=True):
    import nbformat

    nb = nbformat.v4.new_notebook()
    for source, count, outputs in cells:
        cell = nbformat.v4.new_code_cell(source, execution_count=count)
        cell.outputs = outputs
        nb.cells.append(cell)
    if full:
        nb.metadata["course"] = {"executed": "full"}
    return nb


def test_execution_problems_accepts_an_executed_notebook_and_names_each_fault():
    import nbformat

    out = nbformat.v4.new_output("stream", name="stdout", text="hi\n")
    good = _notebook(("x = 1", 1, []), ("print(x)", 2, [out]))
    assert course.execution_problems(good) == []
    assert any("not executed" in p for p in course.execution_problems(
        _notebook(("x = 1", 1, []), ("print(x)", None, []))))
    assert any("expected 2" in p for p in course.execution_problems(
        _notebook(("x = 1", 1, []), ("print(x)", 5, [out]))))
    assert any("no outputs" in p for p in course.execution_problems(
        _notebook(("x = 1", 1, []), ("print(x)", 2, []))))
    err = nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[])
    assert any("ValueError: boom" in p for p in course.execution_problems(
        _notebook(("x = 1", 1, []), ("print(x)", 2, [err]))))
    assert any("full mode" in p for p in course.execution_problems(
        _notebook(("x = 1", 1, []), ("print(x)", 2, [out]), full=False)))


def test_notebook_paths_by_number():
    paths = course.notebook_paths()
    assert paths and all(p.suffix == ".ipynb" for p in paths)
    assert course.notebook_paths(["1"]) == [p for p in paths if p.name.startswith("01_")]
