"""The course tool: every carried-forward file is byte-identical unless its part declares the
change, and `check` really catches drift; lessons quote only what their notebooks measured; the
build-it-yourself mode stubs exactly the named functions, and `grade` fails on the stubs and
passes on the finished part."""
from __future__ import annotations

import ast
import base64
import re
import shutil

import pytest

from shared import course


def test_stages_keep_their_promises():
    assert course.check() == []


def test_each_stage_diff_shows_its_technique():
    stat = course.diff(course.find_stage("03"), course.find_stage("04"), stat=True)
    assert "scheduler.py" in stat and "added" in stat
    assert "paged_attention.py" not in stat  # carried forward unchanged


def copy_parts(tmp_path, *names):
    """Parts copied into tmp_path with what `check` reads beside them: their notebooks (the
    lessons' figures) and pictures, the tests (their exercises name tests) and shared/ (stage.toml's [shared]
    names its definitions; the lessons' excerpts and vLLM paths are held to it)."""
    for name in names:
        shutil.copytree(course.ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        (tmp_path / "notebooks").mkdir(exist_ok=True)
        for nb in course.ROOT.glob(f"notebooks/{name[4:6]}_*.ipynb"):
            shutil.copy(nb, tmp_path / "notebooks" / nb.name)
        (tmp_path / course.FIGURES).mkdir(exist_ok=True)
        for picture in course.ROOT.glob(f"{course.FIGURES}/{name[4:6]}_*.png"):  # the lesson's key picture
            shutil.copy(picture, tmp_path / course.FIGURES / picture.name)
    shutil.copytree(course.ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    shutil.copytree(course.ROOT / "shared", tmp_path / "shared", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)


def test_check_catches_an_undeclared_change(tmp_path):
    copy_parts(tmp_path, "part01_simple_server", "part02_streaming")
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


# ---- lessons quote their notebooks ------------------------------------------------------------

LESSON = """# Part 99

## The idea

Prefill took 9.99 s here, outside the measured section.

## What was measured

Measured on torch 2.13 and vLLM v0.33.0 (0.33.0), in 2024, for part 05, in fp32 with
`--max-num-seqs 64` and `budget=1.5`:

| L | decode | ratio |
|---:|---:|---:|
| 16 | 40.1 ms | 9.5x |

A 576 x 576 matrix; 94.6% of prompts hit, 363 tokens saved; logits within 4.20e-05; 1,024 blocks.

```
not a figure: 7.77 s
```

### A subsection is still the section

Decode took 0.44 s.

## Exercises

1. Expect 3.14 s.

## Results on a GPU

A step took 2.50 ms.

## In vLLM

Not measured: 6.28 s.
"""


def test_lesson_figures_are_the_numbers_of_the_measured_sections():
    section = course.measured_sections(LESSON)
    assert "0.44 s" in section and "9.99" not in section and "3.14" not in section and "6.28" not in section
    figures = [f.text for f in course.lesson_figures(section)]
    assert figures == ["40.1 ms", "9.5x", "94.6%", "363 tokens", "4.20e-05", "1,024 blocks", "0.44 s", "2.50 ms"]
    assert course.measured_sections("# Part\n\n## The idea\n\n1.5 s\n") == ""


def test_a_figure_is_shown_when_an_output_rounds_to_it():
    outputs = course._numbers("decode 40.08 ms, ratio 9.46x; hit rate 0.946; 363 tokens; 1,024\nerr 4.2e-05")
    shown = {f.text: course.figure_shown(f, outputs) for f in course.lesson_figures(
        "40.1 ms, 9.5x, 94.6%, 363 tokens, 1,024 blocks, 4.20e-05, 40.2 ms, 9.4x, 364 tokens, 4.3e-05")}
    assert shown == {"40.1 ms": True, "9.5x": True, "94.6%": True, "363 tokens": True, "1,024 blocks": True,
                     "4.20e-05": True, "40.2 ms": False, "9.4x": False, "364 tokens": False, "4.3e-05": False}


def test_check_catches_a_lesson_figure_its_notebook_never_printed(tmp_path):
    copy_parts(tmp_path, "part01_simple_server")
    assert course.figure_problems(course.find_stage("01", tmp_path), tmp_path) == []
    lesson = tmp_path / "part01_simple_server" / "README.md"
    text = lesson.read_text()
    heading = "## What was measured\n"
    assert heading in text
    lesson.write_text(text.replace(heading, heading + "\nA step took 123.45 ms.\n", 1))
    problems = course.figure_problems(course.find_stage("01", tmp_path), tmp_path)
    assert len(problems) == 1 and "'123.45 ms'" in problems[0]
    (tmp_path / "notebooks" / "01_simple_server.ipynb").unlink()
    assert any("no notebooks/01_" in p for p in course.check(tmp_path))


def test_check_catches_a_code_excerpt_the_code_does_not_have(tmp_path):
    copy_parts(tmp_path, "part09_tp")
    assert course.excerpt_problems(course.find_stage("09", tmp_path), tmp_path) == []
    lesson = tmp_path / "part09_tp" / "README.md"
    text = lesson.read_text()
    line = "        dist.all_reduce(out)                     # the one collective of the block\n"
    assert line in text and "dist.all_reduce(out)" in course.excerpt_lines(text)
    # A drifted line, and the right lines out of order, are both caught; a changed comment is not.
    for wrong in ("        dist.all_reduce(out, async_op=True)\n", None):
        drifted = text.replace(line, wrong) if wrong else text.replace(
            line, "").replace("    def forward(self, x: torch.Tensor) -> torch.Tensor:\n",
                              "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n" + line)
        lesson.write_text(drifted)
        problems = course.excerpt_problems(course.find_stage("09", tmp_path), tmp_path)
        assert len(problems) == 1 and "not in the part's code" in problems[0], wrong
    lesson.write_text(text.replace(line, "        dist.all_reduce(out)  # summed over the ranks\n"))
    assert course.excerpt_problems(course.find_stage("09", tmp_path), tmp_path) == []


def test_check_catches_a_c_excerpt_the_kernel_does_not_have(tmp_path):
    """Part 15's lessons (the CPU appendix's above all) quote its C kernels: those excerpts are held to
    the .c and .h files the same way. Compared with the problems the copy has already, so that the
    test proves the check and not the state of the lessons."""
    copy_parts(tmp_path, "part15_full")
    stage = course.find_stage("15", tmp_path)
    line = "for (int j = 0; j < n; j++) p[j] = exp_approx(p[j] - m[g]); /* vectorized (vec_math.h) */\n"
    lesson = [p for p in stage.lessons() if line in p.read_text()][-1]
    text = lesson.read_text()
    before = set(course.excerpt_problems(stage, tmp_path))
    lesson.write_text(text.replace(line, line.replace("exp_approx", "expf")))
    new = set(course.excerpt_problems(stage, tmp_path)) - before
    assert len(new) == 1 and "expf(p[j] - m[g])" in new.pop()
    lesson.write_text(text.replace(line, line.replace("/* vectorized (vec_math.h) */", "// one exp per score")))
    assert set(course.excerpt_problems(stage, tmp_path)) == before


# ---- build it yourself: exercise and grade ----------------------------------------------------

EXERCISE_STAGES = [s for s in course.stages() if course.exercise_functions(s)]


def test_every_part_has_an_exercise_of_two_to_four_functions():
    assert [s.name for s in EXERCISE_STAGES] == [s.name for s in course.stages()]
    for stage in EXERCISE_STAGES:
        funcs = course.exercise_functions(stage)
        assert 2 <= len(funcs) <= 4, stage.name
        assert all(f.tests and course.lesson_section(stage, f.lesson) for f in funcs), stage.name
        assert course.exercise_problems(stage) == []


def _without_bodies(tree, names):
    for name in names:
        course.find_def(tree, name).body = [ast.Pass()]
    return ast.dump(tree)


@pytest.mark.parametrize("stage", EXERCISE_STAGES, ids=lambda s: s.name)
def test_stubs_replace_exactly_the_named_bodies(stage):
    """Each named function keeps its signature, decorators and docstring, and its body becomes a
    raise that names it and its lesson section; every other line of the file is unchanged."""
    by_file: dict[str, list[str]] = {}
    for f in course.exercise_functions(stage):
        by_file.setdefault(f.file, []).append(f.name)
    for file, names in by_file.items():
        text = (stage.path / file).read_text()
        stubbed = course.stub_source(text, {n: f"exercise: write {n}" for n in names})
        compile(stubbed, file, "exec")
        before, after = ast.parse(text), ast.parse(stubbed)
        for name in names:
            old, new = course.find_def(before, name), course.find_def(after, name)
            assert type(old) is type(new)
            for attr in ("args", "returns", "decorator_list"):
                assert ast.dump(ast.Module([ast.Expr(getattr(old, attr) or ast.Constant(None))], [])) == \
                    ast.dump(ast.Module([ast.Expr(getattr(new, attr) or ast.Constant(None))], [])), (name, attr)
            doc = ast.get_docstring(old, clean=False)
            assert ast.get_docstring(new, clean=False) == doc
            body = new.body[1:] if doc is not None else new.body
            assert isinstance(body[0], ast.Raise) and f"exercise: write {name}" in ast.unparse(body[0])
            assert len(body) == 1 + course._is_generator(old)  # a generator keeps a `yield`
            assert course._is_generator(new) == course._is_generator(old)
            old_body = old.body[1:] if doc is not None else old.body
            assert old_body and not isinstance(old_body[0], ast.Raise), f"{name} is a stub already"
        assert _without_bodies(before, names) == _without_bodies(after, names)


def test_stub_source_handles_comments_generators_and_refuses_what_it_cannot_stub():
    src = """import x


class A:
    @property
    def p(self):
        # a comment that explains the body
        return 1  # trailing

    async def stream(self, n: int):
        \"\"\"Doc.\"\"\"
        for i in range(n):
            yield i

    def inner(self):
        def gen():
            yield 1
        return list(gen())


def one(): return 1
"""
    out = course.stub_source(src, {"A.p": "m1", "A.stream": "m2", "A.inner": "m3"})
    assert "comment that explains" not in out and "trailing" not in out and "range" not in out
    tree = ast.parse(out)
    assert course._is_generator(course.find_def(tree, "A.stream"))
    assert not course._is_generator(course.find_def(tree, "A.inner"))
    assert ast.get_docstring(course.find_def(tree, "A.stream")) == "Doc."
    assert "@property" in out and "import x" in out and "def one(): return 1" in out
    with pytest.raises(ValueError, match="line of its"):
        course.stub_source(src, {"one": "m"})
    with pytest.raises(ValueError, match="no function"):
        course.stub_source(src, {"A.missing": "m"})


def test_an_existing_workspace_is_never_overwritten_without_force(tmp_path):
    stage = course.find_stage("10")
    course.make_exercise(stage, tmp_path, only=["router.py:CacheAwareRouter._record"])
    mine = tmp_path / stage.name / "router.py"
    mine.write_text(mine.read_text() + "# my work\n")
    with pytest.raises(SystemExit, match="--force"):
        course.make_exercise(stage, tmp_path)
    assert mine.read_text().endswith("# my work\n")
    assert course.make_exercise(stage, tmp_path, solution=True, force=True) == []
    assert mine.read_bytes() == (stage.path / "router.py").read_bytes()


# Two model-free parts run for real (a pytest subprocess per grade, about 8 s each); every other
# part's stubs are checked above without running its tests.
@pytest.mark.parametrize("part", ["08", "10"])
def test_grade_fails_on_the_stubs_and_passes_on_the_finished_part(part, tmp_path, capsys):
    stage = course.find_stage(part)
    funcs = course.exercise_functions(stage)
    assert course.main(["exercise", part, "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert course.main(["grade", part, "--dir", str(tmp_path)]) == 1
    report = capsys.readouterr().out
    for f in funcs:
        assert f"FAIL  {f.label} " in report, report
    # what failed is the stubs themselves, pointing to the lesson
    assert "NotImplementedError: exercise: write " in report and f"; see {stage.name}/README.md, section" in report
    assert "its stub was called" in report
    assert course.main(["exercise", part, "--dir", str(tmp_path), "--solution", "--force"]) == 0
    capsys.readouterr()
    assert course.main(["grade", part, "--dir", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    for f in funcs:
        assert f"pass  {f.label} " in report, report


# ---- the docs describe the code as it is --------------------------------------------------------

NARRATING = [
    "A ninth session found two stalls in the GEMM.",
    "(this session's change, the machine in a slow spell)",
    "measured on a later day, 1.2x",
    "Earlier runs of this table, before the kernel:",
    "an earlier run on another day measured DP 2 ahead",
    "the same VM, a day later",
    "part 15 at f7a9808 took 41 ms a step",
    "the older build was faster here",
]
NOT_NARRATING = [
    "Start it in a Python session: `build_app(LLM(), \"m\")`.",
    "An HTTP session per client; `requests.Session()` keeps the connection.",
    "The grader runs pytest with `start_new_session=True`; so does requests.Session.",
    "The lesson spells out the rules, and each day of the week is a row.",
    "```\nsession = aiohttp.ClientSession()  # a slow spell of code is still code\n```",
    "The kernel is at 0x7f3a2b1c in the map; the build at start-up compiles it.",
]


def test_narration_catches_how_the_project_was_made_and_not_code_words():
    for line in NARRATING:
        assert course.narration(line), line
    for text in NOT_NARRATING:
        assert course.narration(text) == [], text
    assert course.narration("ok\n\nThe fifth session ran it.\n") == [(3, "'session'")]


def test_check_fails_on_a_doc_line_that_narrates(tmp_path):
    import nbformat

    copy_parts(tmp_path, "part01_simple_server")
    assert course.narration_problems(tmp_path) == []
    lesson = tmp_path / "part01_simple_server" / "README.md"
    lesson.write_text(lesson.read_text() + "\n" + "\n".join(NOT_NARRATING) + "\n")
    (tmp_path / "SOLUTIONS.md").write_text("# Solutions\n\n" + NARRATING[1] + "\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 01\n\n" + NARRATING[2]),
                nbformat.v4.new_code_cell("session = 'a slow spell'  # code, not prose")]
    nbformat.write(nb, tmp_path / "notebooks" / "01_simple_server.ipynb")
    problems = course.narration_problems(tmp_path)
    assert problems == [
        "SOLUTIONS.md:3: narrates how the project was made ('session', 'spell'); say what the code is and "
        "what it measures now",
        "notebooks/01_simple_server.ipynb, markdown cell 0, line 3: narrates how the project was made "
        "('a later day'); say what the code is and what it measures now"], problems
    assert set(problems) <= set(course.check(tmp_path))
    lesson.write_text(lesson.read_text() + NARRATING[0] + "\n")
    assert any(p.startswith("part01_simple_server/README.md:") for p in course.narration_problems(tmp_path))


# ---- a part with an appendix ------------------------------------------------------------------

def _with_appendix(tmp_path):
    """Parts 01 and 02 copied, part 02 given an appendix folder `fast/` with its own lesson."""
    copy_parts(tmp_path, "part01_simple_server", "part02_streaming")
    part = tmp_path / "part02_streaming"
    (part / "fast").mkdir()
    (part / "fast" / "__init__.py").write_text("")
    (part / "fast" / "kernel.py").write_text("def twice(x):\n    return 2 * x\n")
    (part / "fast" / "README.md").write_text(
        "# How part 02 runs fast\n\n## The kernel\n\n```python\ndef twice(x):\n    return 2 * x\n```\n\n"
        "## Results\n\nIt runs at [1.50 ms](runs.json) a call.\n")
    (part / "fast" / "runs.json").write_text('{"call_ms": 1.4972}\n')
    manifest = part / "stage.toml"
    text = manifest.read_text()
    added = '"fast/__init__.py", "fast/kernel.py", "fast/README.md", "fast/runs.json", '
    text = text.replace("added = [", "added = [" + added, 1) if "added = [" in text else \
        text.replace("technique =", f"added = [{added}]\ntechnique =", 1)
    manifest.write_text('appendix = ["fast/"]\n' + text)
    return course.find_stage("02", tmp_path)


def test_diff_stat_shows_the_stage_then_each_appendix_with_totals(tmp_path):
    stage = _with_appendix(tmp_path)
    assert stage.appendix == ["fast"] and course.check(tmp_path) == []
    stat = course.diff(course.find_stage("01", tmp_path), stage, stat=True)
    head, appendix = stat.split("\n# appendix part02_streaming/fast/: How part 02 runs fast\n")
    assert head.startswith("# the stage: part02_streaming against part01_simple_server\n")
    assert "async_llm.py" in head and "fast/" not in head
    assert re.search(r"^the stage: \d+ files, \+\d+ -\d+$", head, re.M)
    assert re.findall(r"^(\S+)\s+added", appendix, re.M) == ["fast/README.md", "fast/__init__.py",
                                                               "fast/kernel.py", "fast/runs.json"]
    assert re.search(r"^appendix fast/: 4 files, \+15 -0$", appendix, re.M), appendix
    # without an appendix, one group and its totals
    plain = course.diff(course.find_stage("01"), course.find_stage("02"), stat=True)
    assert "# " not in plain.split("\n# shared/")[0] and re.search(r"^in all: \d+ files", plain, re.M)


def test_an_appendix_lesson_is_held_to_the_code_and_its_figures(tmp_path):
    stage = _with_appendix(tmp_path)
    lesson = stage.path / "fast" / "README.md"
    text = lesson.read_text()
    assert course.figure_problems(stage, tmp_path) == [] and course.excerpt_problems(stage, tmp_path) == []
    lesson.write_text(text.replace("return 2 * x\n```", "return x + x\n```").replace("1.50 ms", "1.60 ms"))
    problems = course.check(tmp_path)
    assert "part02_streaming/fast/README.md, The code: an excerpt's line 'return x + x' is not in the part's " \
           "code (in that order)" in problems
    assert "part02_streaming/fast/README.md, measured section: '1.60 ms' is not in the outputs of " \
           "notebooks/02_streaming.ipynb, part02_streaming/fast/runs.json" in problems
    shutil.rmtree(stage.path / "fast")
    assert "part02_streaming/stage.toml declares the appendix fast/, which does not exist" in course.check(tmp_path)


# ---- "In vLLM" paths name files of vLLM v0.33.0 ----------------------------------------------------

def test_the_vllm_file_list_holds_the_python_and_csrc_files_of_v0_33_0():
    files = course.vllm_files()
    assert len(files) > 5000
    for path in ("vllm/v1/core/sched/scheduler.py", "vllm/entrypoints/openai/completion/serving.py",
                 "csrc/cache_kernels.cu", "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"):
        assert path in files
    assert "vllm/entrypoints/openai/serving_completion.py" not in files
    known = lambda token, relative=False: course.vllm_path_known(token, files, relative)  # noqa: E731
    assert known("vllm/v1/kv_offload/") and known("vllm/v1/kv_offload/{base,abstract}.py") is False
    assert known("fused_moe/fused_moe.py", relative=True) and not known("fused_moe/fused_moe.py")
    assert not known("serving_chat.py", relative=True)


def test_check_fails_on_a_vllm_path_that_v0_33_0_does_not_have(tmp_path):
    copy_parts(tmp_path, "part01_simple_server")
    assert course.vllm_path_problems(tmp_path) == []
    lesson = tmp_path / "part01_simple_server" / "README.md"
    text = lesson.read_text()
    in_vllm = course.named_section(text, "in vllm")
    lesson.write_text(text.replace(in_vllm, in_vllm + (
        "\n`vllm/entrypoints/openai/serving_completion.py` and `serving_chat.py` (the handlers), "
        "`chat_completion/serving.py`, `csrc/cache_kernels.cu`, `engine.py` (this part's), "
        "`docs/design.md`.\nIn v0.8.5 it was `vllm/core/scheduler.py`. SGLang keeps it in `radix_cache.py`.\n")))
    (tmp_path / "SOLUTIONS.md").write_text("# Solutions\n\nSee `vllm/attention/ops/triton_unified_attention.py`.\n")
    engine = tmp_path / "part01_simple_server" / "engine.py"
    engine.write_text('"""The engine.\n\nIn vLLM: vllm/v1/engine/core.py and vllm/v1/engine/llm.py."""\n'
                      + engine.read_text())
    problems = course.vllm_path_problems(tmp_path)
    assert [p.split(": `")[1].split("`")[0] for p in problems] == [
        "vllm/entrypoints/openai/serving_completion.py", "serving_chat.py",
        "vllm/attention/ops/triton_unified_attention.py", "vllm/v1/engine/llm.py"], problems
    assert problems[2] == (
        "SOLUTIONS.md:3: `vllm/attention/ops/triton_unified_attention.py` is not a file of vLLM v0.33.0 "
        "(shared/vllm_v0_33_0_files.txt); it has vllm/v1/attention/ops/triton_unified_attention.py, "
        "vllm/v1/attention/ops/ultraquant/triton_unified_attention.py")
    assert problems[3].startswith("part01_simple_server/engine.py, docstring line 3: `vllm/v1/engine/llm.py`")
    assert set(problems) <= set(course.check(tmp_path))
    (tmp_path / course.VLLM_FILES).unlink()
    assert course.vllm_path_problems(tmp_path) == [
        "shared/vllm_v0_33_0_files.txt is missing: the docs' vLLM paths cannot be checked"]


# ---- every lesson says how to build its part yourself ---------------------------------------------

def test_check_fails_on_a_missing_or_partial_build_it_yourself_section(tmp_path):
    copy_parts(tmp_path, "part04_continuous_batching")
    stage = course.find_stage("04", tmp_path)
    assert course.build_it_yourself_problems(stage, tmp_path) == []
    lesson = stage.path / "README.md"
    text = lesson.read_text()
    section = course.named_section(text, "build it yourself")
    assert section and "`Scheduler._preempt`" in section
    partial = section.replace("`Scheduler._preempt` and ", "").replace("grade 04", "grade")
    lesson.write_text(text.replace(section, partial))
    assert course.build_it_yourself_problems(stage, tmp_path) == [
        "part04_continuous_batching/README.md, Build it yourself: does not give "
        "`python -m shared.course grade 04`",
        "part04_continuous_batching/README.md, Build it yourself: does not name `Scheduler._preempt` "
        "(stage.toml exercise scheduler.py:Scheduler._preempt)"]
    lesson.write_text(text.replace("## Build it yourself", "## Try it"))
    problems = course.check(tmp_path)
    assert "part04_continuous_batching/README.md: no 'Build it yourself' section naming what " \
           "`python -m shared.course exercise 04` stubs (stage.toml's exercise functions)" in problems
    # an exercise whose lesson section is gone is caught too
    lesson.write_text(text.replace("### `scheduler.py` — ", "### `scheduler.py`: "))
    problems = course.check(tmp_path)
    assert any("exercise scheduler.py:Scheduler.schedule: lesson section" in p and "not found" in p
               for p in problems), problems
    assert "part04_continuous_batching/README.md, Build it yourself: links " \
           "#schedulerpy--schedulerconfig-scheduleroutput-scheduler, which no heading has" in problems, problems


# ---- SOLUTIONS.md quotes what the notebooks show ---------------------------------------------------

def test_check_fails_on_a_figure_in_solutions_that_no_notebook_shows(tmp_path):
    copy_parts(tmp_path, "part01_simple_server", "part02_streaming")
    solutions = tmp_path / "SOLUTIONS.md"
    good = ("# Solutions\n\n## Part 01 — a simple server\n\n"
            "1. **Predict.** One 32-token prefill (44.8 ms in the notebook): about 61 s uncached, "
            "`3996 × 128 KiB` = 499.5 MiB, around 1e-6.\n"
            "2. **Compare.** Notebook 02's stream took 4.54 s.\n\n## Part 02 — streaming\n\n1. Nothing measured.\n")
    solutions.write_text(good)
    assert course.solutions_figure_problems(tmp_path) == []
    solutions.write_text(good.replace("44.8 ms", "44.9 ms").replace("Notebook 02's stream", "The stream"))
    problems = course.solutions_figure_problems(tmp_path)
    assert problems == [
        "SOLUTIONS.md, Part 01, exercise 1: '44.9 ms' is not in the outputs of notebooks/01_simple_server.ipynb",
        "SOLUTIONS.md, Part 01, exercise 2: '4.54 s' is not in the outputs of notebooks/01_simple_server.ipynb"]
    assert set(problems) <= set(course.check(tmp_path))
    solutions.write_text(good.replace("## Part 02 — streaming\n\n1. Nothing measured.",
                                      "## Part 03 — paged attention\n\n1. It took 1.5 s."))
    assert course.solutions_figure_problems(tmp_path) == [
        "SOLUTIONS.md, Part 03, exercise 1 quotes measurements but there is no notebooks/03_*.ipynb"]


def test_estimates_are_not_quotes():
    text = "about 61 s, ≈ 94%, `a × b` = 499.5 MiB, around 1e-6, roughly 2x; measured 40.1 ms and 9.5x"
    assert [f.text for f in course.lesson_figures(text, estimates=False)] == ["40.1 ms", "9.5x"]
    assert len(course.lesson_figures(text)) == 7


# ---- a lesson's picture is its notebook's -----------------------------------------------------------

def test_a_lesson_picture_must_be_written_by_its_notebooks_committed_run(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import nbformat

    copy_parts(tmp_path, "part02_streaming")
    stage = course.find_stage("02", tmp_path)
    lesson = stage.path / "README.md"
    lesson.write_text(lesson.read_text() + "\n![Time to first token, blocking against async](../notebooks/"
                      "figures/02_ttft.png)\n")
    assert course.picture_problems(stage, tmp_path) == [
        "part02_streaming/README.md embeds notebooks/figures/02_ttft.png, which does not exist"]

    def run_cell(points):  # what the notebook's cell does: plot, save, display from the file
        fig, ax = plt.subplots()
        ax.plot(points)
        return course.lesson_picture(fig, "02_ttft.png", root=tmp_path)

    monkeypatch.delenv(course.QUICK_ENV, raising=False)
    image = run_cell([1, 2, 3])
    written = tmp_path / course.FIGURES / "02_ttft.png"
    assert image.data == written.read_bytes() and written.read_bytes().startswith(b"\x89PNG")
    book = tmp_path / "notebooks" / "02_streaming.ipynb"
    nb = nbformat.read(book, as_version=4)
    cell = nbformat.v4.new_code_cell('display(lesson_picture(fig, "02_ttft.png"))', execution_count=99)
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(image.data).decode()})]
    nb.cells.append(cell)
    nbformat.write(nb, book)
    assert course.picture_problems(stage, tmp_path) == []
    # a picture made by hand (or by another run) is not the one the notebook shows
    run_cell([3, 2, 1])
    problems = course.picture_problems(stage, tmp_path)
    assert len(problems) == 1 and "which is not the picture notebook 02's committed run shows" in problems[0]
    assert problems[0] in course.check(tmp_path)
    # quick mode (the test suite) never touches the committed picture
    monkeypatch.setenv(course.QUICK_ENV, "1")
    before = written.read_bytes()
    assert run_cell([5, 5, 5]).filename != str(written) and written.read_bytes() == before
    # a picture named for another part, and one without a caption
    lesson.write_text(lesson.read_text().replace("(../notebooks/figures/02_ttft.png)", "(../notebooks/figures/"
                                                 "02_ttft.png)\n![](../notebooks/figures/03_other.png)"))
    shutil.copy(written, tmp_path / course.FIGURES / "03_other.png")
    assert course.picture_problems(stage, tmp_path)[1:] == [
        "part02_streaming/README.md embeds notebooks/figures/03_other.png without a caption",
        "part02_streaming/README.md embeds notebooks/figures/03_other.png: a lesson's picture is its own "
        "notebook's, notebooks/figures/02_*.png"]


# ---- the lesson frame: previous/next links and the key ideas ------------------------------------

def test_check_fails_on_a_missing_or_wrong_next_link(tmp_path):
    copy_parts(tmp_path, "part01_simple_server", "part02_streaming", "part03_paged_attention")
    beyond = []  # part 03, the last part copied, is not asked for a next link
    assert course.navigation_problems(tmp_path) == beyond
    lesson = tmp_path / "part02_streaming" / "README.md"
    text = lesson.read_text()
    lesson.write_text(text.replace("../part03_paged_attention/README.md", "../part04_continuous_batching/README.md", 1))
    assert course.navigation_problems(tmp_path) == [
        "part02_streaming/README.md: its `next:` link goes to ../part04_continuous_batching/README.md, not "
        "../part03_paged_attention/README.md"] + beyond
    head, rest = text.split("\n## ", 1)
    lesson.write_text(head.replace("next:", "onward:") + "\n## " + rest)
    problems = course.navigation_problems(tmp_path)
    assert problems == ["part02_streaming/README.md: no `next:` link to part03_paged_attention under its title"] + beyond
    assert set(problems) <= set(course.check(tmp_path))


def test_check_fails_on_a_missing_or_malformed_key_ideas_section(tmp_path):
    copy_parts(tmp_path, "part01_simple_server")
    assert course.key_ideas_problems(tmp_path) == []
    lesson = tmp_path / "part01_simple_server" / "README.md"
    text = lesson.read_text()
    start = text.index(course.KEY_IDEAS)
    end = text.index("\n## ", start + 1)
    lesson.write_text(text[:start] + course.KEY_IDEAS + "\n\n- one idea\n- two ideas\n" + text[end:])
    assert course.key_ideas_problems(tmp_path) == [
        "part01_simple_server/README.md: its '## Key ideas' section has 2 bullets, not 3 to 6"]
    lesson.write_text(text[:start] + text[end + 1:])
    problems = course.key_ideas_problems(tmp_path)
    assert problems == ["part01_simple_server/README.md: no '## Key ideas' section"]
    assert set(problems) <= set(course.check(tmp_path))
