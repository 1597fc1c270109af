"""The course tool.

    python -m shared.course list             the parts and their techniques
    python -m shared.course diff A B [--stat] one stage against another (e.g. part01 part02): the
                                             stage's files, then each appendix's under a heading
    python -m shared.course check            carried-forward files are byte-identical unless the
                                             part's stage.toml declares them changed
    python -m shared.course servers          the parts grouped by identical server.py
    python -m shared.course notebooks [NN ...] [--quick]
                                             run notebooks top to bottom in a fresh kernel and
                                             save them with their outputs (all of them by
                                             default); --quick runs them in quick mode
                                             (COURSE_QUICK=1) and saves nothing
    python -m shared.course exercise NN [--dir DIR] [--only NAME ...] [--solution] [--force]
                                             copy part NN into DIR (default ./workspace) with
                                             the bodies of its key functions replaced by stubs
    python -m shared.course grade NN [--dir DIR] [--only NAME ...]
                                             run part NN's own tests for those functions
                                             against DIR's copy; say which functions pass

Each part folder holds a `stage.toml`: the technique it teaches and the files it `changed`,
`added` or `removed` relative to the part before. `check` holds the parts to that promise. shared/
is one copy that every part imports, so a diff of two part folders cannot show what a stage needed
there; its `[shared]` table names the definitions of shared/ the stage introduced (file -> names,
"Class" or "Class.method"), `diff` prints their code after the folders' diff, and `check` makes
sure they exist. A part may also keep appendix folders (`appendix = ["cpu/"]`: code that is not
the stage's technique, with its own lesson, e.g. part15_full/cpu/README.md); `diff` shows them apart
from the stage, and their lessons are held to the code as the part's lesson is.

`check` also holds each lesson (a part's README.md and its appendices') to its notebook: every
figure its measured sections quote ("measured" in the heading, or "Results" first) must be in the
part's notebook's saved outputs or in a JSON file the lesson links (see `lesson_figures`), and
every figure SOLUTIONS.md quotes under a part in that part's notebook or one it names. And
it holds the docs (lessons, README.md, SOLUTIONS.md, deploy/README.md, the notebooks' markdown) to
the present tense: no line narrates how the project was made (see `narration`); and every vLLM
path they name to a file of vLLM v0.33.0 (see `vllm_path_problems`). A lesson's picture,
notebooks/figures/NN_*.png, is written by notebook NN's run (`lesson_picture`), and `check` makes
sure the committed file is what that notebook's committed outputs show.

Build-it-yourself mode. A stage's `[[exercise.functions]]` tables name the functions that carry
its technique ("file.py:function" or "file.py:Class.method"), the lesson section that explains
each ("README.md#anchor") and the tests of the part's own suite that prove it (pytest node ids,
model-free where the suite has them). `exercise` copies the part into a workspace with those
bodies replaced by a `raise NotImplementedError` naming the section; everything else is the
part's own code, so the part imports and runs until it calls a stub. `grade` runs the named tests
in a subprocess whose import path puts the workspace first (`import partNN_x` is the reader's
copy, `shared` the repository's) and reports per function; the finished part is the solution.
Each lesson ends with a "Build it yourself" section that names those functions, links their
sections and gives both commands; `check` holds it to the stage.toml.

Notebooks are committed executed, so a reader sees measured outputs and plots on the
repository's web view; `notebooks` is the one way to (re)produce them, in full mode. In quick mode
the environment variable COURSE_QUICK=1 reaches the kernel; each notebook reads it in its first
code cell and shrinks its workloads (fewer requests, shorter outputs), still running every cell.
The test suite runs them that way, without writing the files."""
from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK_ENV = "COURSE_QUICK"
_PART = re.compile(r"part(\d\d)_[a-z0-9_]+")
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}
MANIFEST = "stage.toml"


@dataclass
class Stage:
    path: Path
    number: int
    technique: str = ""
    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    shared: dict[str, list[str]] = field(default_factory=dict)  # shared/ file -> names it introduced
    exercise: dict = field(default_factory=dict)  # the [exercise] table (see exercise_functions)
    appendix: list[str] = field(default_factory=list)  # folders of the part that are appendices ("cpu/")

    @property
    def name(self) -> str:
        return self.path.name

    def lessons(self) -> list[Path]:
        """The part's lesson (README.md) and each appendix's (e.g. cpu/README.md), those that exist."""
        paths = [self.path / "README.md"] + [self.path / a / "README.md" for a in self.appendix]
        return [p for p in paths if p.is_file()]

    def group_of(self, file: str) -> str:
        """The appendix folder (e.g. "cpu") that a part-relative file lies in, else "" (the stage)."""
        return next((a for a in self.appendix if file.startswith(a + "/")), "")

    def files(self) -> dict[str, Path]:
        return {p.relative_to(self.path).as_posix(): p for p in sorted(self.path.rglob("*"))
                if p.is_file() and p.name != MANIFEST and not _SKIP_DIRS & set(p.parts)
                and p.suffix != ".pyc"}


def stages(root: Path = ROOT) -> list[Stage]:
    out = []
    for d in sorted(root.iterdir()):
        m = _PART.fullmatch(d.name)
        if d.is_dir() and m:
            meta = tomllib.loads((d / MANIFEST).read_text()) if (d / MANIFEST).exists() else {}
            out.append(Stage(d, int(m.group(1)), meta.get("technique", ""), meta.get("changed", []),
                             meta.get("added", []), meta.get("removed", []), meta.get("shared", {}),
                             meta.get("exercise", {}),
                             [a.rstrip("/") for a in meta.get("appendix", [])]))
    return out


def find_stage(name: str, root: Path = ROOT) -> Stage:
    """Accept 'part03_paged_attention', 'part03', '03' or '3'."""
    for s in stages(root):
        if name in (s.name, f"part{s.number:02d}", f"{s.number:02d}", str(s.number)):
            return s
    raise SystemExit(f"no part named {name!r}")


def check(root: Path = ROOT) -> list[str]:
    """Every problem found, as sentences; empty when the stages keep their promises."""
    problems = []
    all_stages = stages(root)
    for s in all_stages:
        if not (s.path / MANIFEST).exists():
            problems.append(f"{s.name}: no {MANIFEST}")
    for prev, cur in zip(all_stages, all_stages[1:]):
        before, after = prev.files(), cur.files()
        for f in sorted(before.keys() & after.keys()):
            same = before[f].read_bytes() == after[f].read_bytes()
            if not same and f not in cur.changed:
                problems.append(f"{cur.name}/{f} differs from {prev.name}/{f} but is not declared changed")
            if same and f in cur.changed:
                problems.append(f"{cur.name}/{f} is declared changed but is identical to {prev.name}/{f}")
        for f in sorted(after.keys() - before.keys()):
            if f not in cur.added:
                problems.append(f"{cur.name}/{f} is new but not declared added")
        for f in sorted(before.keys() - after.keys()):
            if f not in cur.removed:
                problems.append(f"{cur.name} lacks {prev.name}/{f} but does not declare it removed")
        for f in cur.added:
            if f in before:
                problems.append(f"{cur.name}/{f} is declared added but {prev.name} has it")
            elif f not in after:
                problems.append(f"{cur.name}/{f} is declared added but does not exist")
        for f in cur.changed:
            if f not in after or f not in before:
                problems.append(f"{cur.name}/{f} is declared changed but is not in both parts")
    for s in all_stages:
        for a in s.appendix:
            if not (s.path / a).is_dir():
                problems.append(f"{s.name}/{MANIFEST} declares the appendix {a}/, which does not exist")
        for f, names in s.shared.items():
            for name in names:
                if shared_source(f, name, root) is None:
                    problems.append(f"{s.name}/{MANIFEST} names shared/{f}:{name}, which does not exist")
        problems += exercise_problems(s, root)
        problems += build_it_yourself_problems(s, root)
        problems += figure_problems(s, root)
        problems += excerpt_problems(s, root)
        problems += picture_problems(s, root)
    problems += solutions_figure_problems(root)
    problems += vllm_path_problems(root)
    problems += narration_problems(root)
    problems += navigation_problems(root)
    problems += key_ideas_problems(root)
    return problems


def shared_source(file: str, name: str, root: Path = ROOT) -> str | None:
    """The source of `name` ("Class", "function" or "Class.method") in shared/`file`, else None."""
    import ast

    path = root / "shared" / file
    if not path.is_file():
        return None
    text = path.read_text()
    node = find_def(ast.parse(text), name)
    if node is None:
        return None
    lines = text.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.end_lineno]) + "\n"


def find_def(tree, name: str):
    """The class or function node `name` ("function", "Class" or "Class.method") at the top of a
    parsed module, else None."""
    import ast

    node, nodes = None, tree.body
    for part in name.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        nodes = node.body
    return node


# ------------------------------------------------------------------------------- exercises

WORKSPACE = "workspace"  # `exercise` and `grade` default to ./workspace
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")


@dataclass
class ExerciseFunction:
    """One function a reader writes: `name` in the part's `file`, explained by the lesson section
    `lesson` ("README.md#anchor"), proven by `tests` (pytest node ids from the repository root; an
    id without its [parameters] selects every parametrization)."""
    file: str
    name: str
    lesson: str
    tests: list[str]

    @property
    def label(self) -> str:
        return f"{self.file}:{self.name}"


def exercise_functions(stage: Stage) -> list[ExerciseFunction]:
    """The stage's `[[exercise.functions]]`, each `{name = "file.py:Class.method", lesson =
    "README.md#anchor", tests = ["tests/test_x.py::test_y", ...]}`."""
    out = []
    for entry in stage.exercise.get("functions", []):
        file, _, name = entry["name"].partition(":")
        out.append(ExerciseFunction(file, name, entry.get("lesson", ""), list(entry.get("tests", []))))
    return out


def heading_anchor(title: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _outside_fences(markdown: str) -> list[bool]:
    """For each line of a markdown text, whether it is prose: not in a fenced code block, nor a fence."""
    out, fence = [], None
    for line in markdown.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = None if fence == mark else (fence or mark)
            out.append(False)
            continue
        out.append(fence is None)
    return out


def _blank_fences(markdown: str) -> str:
    """Markdown with its fenced blocks blanked (lines kept, so positions keep their line numbers)."""
    return "\n".join(line if prose else "" for line, prose in zip(markdown.splitlines(), _outside_fences(markdown)))


def _headings(markdown: str) -> list[tuple[int, str, int]]:
    """(level, title, line index) of every heading outside fenced code blocks."""
    out = []
    for i, (line, prose) in enumerate(zip(markdown.splitlines(), _outside_fences(markdown))):
        m = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if prose and m:
            out.append((len(m.group(1)), m.group(2), i))
    return out


def lesson_section(stage: Stage, lesson: str) -> str | None:
    """The title of the heading that `lesson` ("README.md#anchor") points to, else None."""
    file, _, anchor = lesson.partition("#")
    path = stage.path / file
    if not path.is_file():
        return None
    titles = [t for _, t, _ in _headings(path.read_text())]
    return next((t for t in titles if heading_anchor(t) == anchor), None) if anchor else None


def _is_generator(node) -> bool:
    """Whether a function's own body yields (nested functions and classes are their own scopes)."""
    import ast

    def walk(n) -> bool:
        if isinstance(n, (ast.Yield, ast.YieldFrom)):
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return False
        return any(walk(c) for c in ast.iter_child_nodes(n))

    return any(walk(stmt) for stmt in node.body)


def stub_source(text: str, stubs: dict[str, str]) -> str:
    """`text` (a module's source) with the body of each function named in `stubs` replaced by
    `raise NotImplementedError(message)`: the signature, decorators and docstring stay, the code
    and its comments go. A generator keeps an unreachable `yield`, so it is still one. Every other
    line of the file is left as it was."""
    import ast

    tree, lines = ast.parse(text), text.splitlines(keepends=True)
    edits = []
    for name, message in stubs.items():
        node = find_def(tree, name)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise ValueError(f"no function {name!r} to stub")
        first = node.body[0]
        if first.lineno == node.lineno:
            raise ValueError(f"{name}: a body on the line of its `def` cannot be stubbed")
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str)
        if has_doc:
            start = first.end_lineno + 1
        else:  # comments between the header and the first statement belong to the body
            start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])])
            while start - 1 > node.lineno and lines[start - 2].strip()[:1] in ("", "#"):
                start -= 1
        indent = " " * first.col_offset
        new = [f"{indent}raise NotImplementedError({message!r})\n"]
        if _is_generator(node):
            new.append(f"{indent}yield  # never reached: keeps this function a generator\n")
        edits.append((start, node.end_lineno, new))
    edits.sort()
    for (_, end, _), (start, _, _) in zip(edits, edits[1:]):
        if start <= end:
            raise ValueError("stubbed functions overlap (a function and one nested in it?)")
    for start, end, new in reversed(edits):
        lines[start - 1:end] = new
    return "".join(lines)


def stub_message(stage: Stage, f: ExerciseFunction) -> str:
    title = (lesson_section(stage, f.lesson) or f.lesson).replace("`", "")
    return f"exercise: write {f.name}; see {stage.name}/README.md, section '{title}'"


def make_exercise(stage: Stage, workspace: Path, only: list[str] | None = None, solution: bool = False,
                  force: bool = False) -> list[ExerciseFunction]:
    """Copy the part to workspace/<part name> and stub the functions of its exercise (those whose
    label or name is in `only`, when given; none with `solution`). Returns the stubbed ones. An
    existing copy is a reader's work: it is replaced only with `force`."""
    funcs = _choose(stage, only)
    target = workspace / stage.name
    if target.exists():
        if not force:
            raise SystemExit(f"{target} exists (your work?); --force replaces it")
        shutil.rmtree(target)
    workspace.mkdir(parents=True, exist_ok=True)
    shutil.copytree(stage.path, target, ignore=_IGNORE)
    if solution:
        return []
    by_file: dict[str, dict[str, str]] = {}
    for f in funcs:
        by_file.setdefault(f.file, {})[f.name] = stub_message(stage, f)
    for file, stubs in by_file.items():
        path = target / file
        path.write_text(stub_source(path.read_text(), stubs))
    return funcs


@dataclass
class GradeResult:
    function: ExerciseFunction
    outcomes: dict[str, str]  # node id -> "passed", "failed", "error", "skipped", ...
    reasons: dict[str, str]  # node id -> pytest's one-line reason, for those that did not pass
    stub_called: bool = False  # the output shows this function's stub raising: not written yet

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o == "passed" for o in self.outcomes.values())


def _selects(spec: str, node_id: str) -> bool:
    return node_id == spec or node_id.startswith(spec + "[") or node_id.startswith(spec + "::")


def _choose(stage: Stage, only: list[str] | None) -> list[ExerciseFunction]:
    funcs = exercise_functions(stage)
    if not funcs:
        raise SystemExit(f"{stage.name} has no [exercise] in its {MANIFEST}")
    if only:
        unknown = [o for o in only if not any(o in (f.label, f.name) for f in funcs)]
        if unknown:
            raise SystemExit(f"{stage.name} has no exercise function {unknown[0]!r}; it has: "
                             + ", ".join(f.label for f in funcs))
        funcs = [f for f in funcs if f.label in only or f.name in only]
    return funcs


def grade(stage: Stage, workspace: Path, timeout: float = 1200,
          only: list[str] | None = None) -> tuple[list[GradeResult], str, float]:
    """Run the exercise's tests (those of the functions in `only`, when given) against
    workspace/<part name>; (a result per function, pytest's output, wall seconds). One pytest
    subprocess, with the workspace first on its import path."""
    funcs = _choose(stage, only)
    workspace = workspace.resolve()
    if not (workspace / stage.name / "__init__.py").is_file():
        raise SystemExit(f"no {stage.name} in {workspace}: run `python -m shared.course exercise "
                         f"{stage.number:02d} --dir {workspace}` first")
    tests = list(dict.fromkeys(t for f in funcs for t in f.tests))
    start = time.perf_counter()
    # Only this part comes from the workspace: a test may import another part too (part 05's
    # compares its scheduler with part 04's), and a workspace copy of that part, stubbed or half
    # written, must not stand in for it. So the import path gets a folder holding just a link to
    # this part's copy, then the repository.
    with tempfile.TemporaryDirectory(prefix="grade-") as only_this:
        os.symlink(workspace / stage.name, Path(only_this) / stage.name, target_is_directory=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([only_this, str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["COLUMNS"] = "1000"  # pytest cuts a summary line's reason at the terminal width
        # The repository's pytest config puts its root first on sys.path (pythonpath = ["."]),
        # which would import the finished part: override it with the link, then the root. -v
        # prints each test's outcome as it ends (so a timeout still reports what ran), -rfE a
        # reason line per failure.
        cmd = [sys.executable, "-m", "pytest", *tests, "-v", "-rfE", "--tb=line", "-p", "no:cacheprovider",
               "--rootdir", str(ROOT), "-o", "addopts=",
               "-o", f"pythonpath={shlex.quote(only_this)} {shlex.quote(str(ROOT))}"]
        # Its own session, so that on a timeout the tests' own children (worker processes,
        # servers) end with it.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n(timed out after {timeout:.0f} s)\n"
        output = output.replace(only_this, str(workspace))  # tracebacks name the reader's files
    wall = time.perf_counter() - start
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "xfail": 1, "xpass": 2, "failed": 3, "error": 3}
    for line in output.splitlines():
        m = re.match(r"(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        if m:
            node, outcome = m.group(1), m.group(2).lower()
            if rank[outcome] >= rank.get(outcomes.get(node, "passed"), 0):
                outcomes[node] = outcome  # a teardown error after a pass is a failure
            continue
        m = re.match(r"(FAILED|ERROR) (\S+::\S+)(?: - (.*))?$", line)
        if m:
            reasons[m.group(2)] = m.group(3) or m.group(1)
    results = []
    for f in funcs:
        mine = {n: o for n, o in outcomes.items() if any(_selects(t, n) for t in f.tests)}
        results.append(GradeResult(f, mine, {n: reasons.get(n, o) for n, o in mine.items() if o != "passed"},
                                   f"exercise: write {f.name};" in output))
    return results, output, wall


def report_grade(stage: Stage, workspace: Path, results: list[GradeResult], wall: float) -> str:
    width = max(len(r.function.label) for r in results)
    lines = [f"{stage.name}: {workspace / stage.name} against its tests ({wall:.1f} s)"]
    for r in results:
        ok = sum(o == "passed" for o in r.outcomes.values())
        status = "pass" if r.passed else "FAIL"
        ran = f"{ok}/{len(r.outcomes)} tests pass" if r.outcomes else "no test ran (see --verbose)"
        if r.stub_called:
            ran += "; its stub was called: still to write"
        lines.append(f"  {status}  {r.function.label:{width}s}  {ran}")
        for node, reason in list(r.reasons.items())[:3]:
            lines.append(f"          {node}: {reason[:160]}")
    passed = sum(r.passed for r in results)
    lines.append(f"{passed} of {len(results)} functions pass" + ("" if passed < len(results) else
                                                                 ": the part is yours"))
    return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int):
    import ast

    return ast.parse(Path(path).read_text())


def _parse(path: Path):
    """The module at `path`, parsed (cached while the file is unchanged), else None."""
    return _parsed(str(path), path.stat().st_mtime_ns) if path.is_file() else None


def exercise_problems(stage: Stage, root: Path = ROOT) -> list[str]:
    """What is wrong with the stage's [exercise] table: functions, lesson sections or tests that
    do not exist, a function without a test."""
    import ast

    problems = []
    for f in exercise_functions(stage):
        where = f"{stage.name}/{MANIFEST} exercise {f.label}"
        tree = _parse(stage.path / f.file)
        node = find_def(tree, f.name) if tree else None
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems.append(f"{where}: no such function")
        if lesson_section(stage, f.lesson) is None:
            problems.append(f"{where}: lesson section {f.lesson!r} not found")
        if not f.tests:
            problems.append(f"{where}: no tests")
        for t in f.tests:
            file, _, rest = t.partition("::")
            name = rest.split("[")[0]
            tree = _parse(root / file)
            if tree is None or not name or find_def(tree, name.replace("::", ".")) is None:
                problems.append(f"{where}: test {t!r} not found")
    return problems


def build_it_yourself_problems(stage: Stage, root: Path = ROOT) -> list[str]:
    """What the lesson's "Build it yourself" section lacks: the section itself, the `exercise` and
    `grade` commands of this part, each exercise function by name (in a code span) and a link to
    the lesson section that explains it."""
    funcs = exercise_functions(stage)
    lesson = stage.path / "README.md"
    if not funcs or not lesson.is_file():
        return []
    rel, nn = lesson.relative_to(root).as_posix(), f"{stage.number:02d}"
    section = named_section(lesson.read_text(), "build it yourself")
    if section is None:
        return [f"{rel}: no 'Build it yourself' section naming what `python -m shared.course exercise {nn}` "
                f"stubs ({MANIFEST}'s exercise functions)"]
    problems = [f"{rel}, Build it yourself: does not give `python -m shared.course {cmd} {nn}`"
                for cmd in ("exercise", "grade") if f"python -m shared.course {cmd} {nn}" not in section]
    for f in funcs:
        if f"`{f.name}`" not in section:
            problems.append(f"{rel}, Build it yourself: does not name `{f.name}` ({MANIFEST} exercise {f.label})")
        anchor = f.lesson.partition("#")[2]
        if anchor and f"](#{anchor})" not in section:
            problems.append(f"{rel}, Build it yourself: does not link {f.name}'s lesson section (#{anchor})")
    anchors = {heading_anchor(title) for _, title, _ in _headings(lesson.read_text())}
    problems += [f"{rel}, Build it yourself: links #{a}, which no heading has"
                 for a in dict.fromkeys(re.findall(r"\]\(#([^)\s]+)\)", section)) if a not in anchors]
    return problems


def named_section(markdown: str, title: str) -> str | None:
    """The text of the first section whose heading is `title` (any case), up to the next heading of
    its level or higher; None when there is none."""
    heads = _headings(markdown)
    lines = markdown.splitlines()
    for i, (level, head, line) in enumerate(heads):
        if head.strip().lower() == title:
            end = next((ln for lv, _, ln in heads[i + 1:] if lv <= level), len(lines))
            return "\n".join(lines[line + 1:end])
    return None


# ------------------------------------------------------------------------------- lesson figures

_UNITS = sorted(["ms", "µs", "us", "s", "x", "×", "%", "tokens", "token", "tok/s", "tokens/s", "MiB", "GiB",
                 "KiB", "MB", "GB", "KB", "GB/s", "MB/s", "GFLOP/s", "TFLOP/s", "requests", "req/s", "steps",
                 "blocks"], key=len, reverse=True)
_NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)*(?:[eE][-+]?\d+)?")
# "3.96x" but not "576 x 576" (a shape): x and × only right after the number.
_UNIT_AFTER = re.compile(r"(?:[x×]| ?(?:" + "|".join(re.escape(u) for u in _UNITS if u not in "x×") + r"))(?!\w)")
_VERSION_OF = re.compile(r"(?:torch|python|vllm|cuda|transformers|triton|numpy|nbclient|v)\s?$", re.I)


@dataclass(frozen=True)
class Figure:
    text: str  # as the lesson writes it, e.g. "1.25 s"
    value: float
    decimals: int  # digits after the point: the precision the lesson quotes
    scientific: bool
    percent: bool


def _strip_code(markdown: str) -> str:
    """Markdown without fenced blocks, inline code spans and link targets."""
    text = "\n".join(line for line, prose in zip(markdown.splitlines(), _outside_fences(markdown)) if prose)
    text = re.sub(r"`[^`\n]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


MEASURED_HEADING = re.compile(r"\bmeasured\b|^results\b", re.I)


def measured_sections(markdown: str) -> str:
    """Every section of a lesson whose heading contains "measured" or starts with "Results" (any
    case), each up to the next heading of the same or a higher level, joined; "" when there is none."""
    heads = _headings(markdown)
    lines = markdown.splitlines()
    out, covered = [], -1
    for i, (level, title, line) in enumerate(heads):
        if line > covered and MEASURED_HEADING.search(title.strip()):
            covered = next((ln for lv, _, ln in heads[i + 1:] if lv <= level), len(lines))
            out.append("\n".join(lines[line + 1:covered]))
    return "\n".join(out)


_ESTIMATE_BEFORE = re.compile(r"(?:\b(?:about|around|roughly|nearly|approximately)|[≈~=])\s*$", re.I)


def lesson_figures(markdown_section: str, estimates: bool = True) -> list[Figure]:
    """The figures a piece of markdown quotes: numbers with a decimal point (1.25, 2.6e-5) or a
    unit, x or % right after them (57 ms, 3x, 94.6%, 363 tokens). Not figures: code (fenced or
    inline, e.g. flags), link targets, version numbers (0.33.0, torch 2.13), numbers inside words
    (fp32, part07), bare integers (years, part numbers, table sizes). Without `estimates`, a
    number worked out rather than quoted is left out too: one right after "about", "around",
    "roughly", "nearly", "approximately", "≈", "~" or "=" (SOLUTIONS.md derives such numbers)."""
    text = _strip_code(markdown_section)
    figures = []
    for m in _NUMBER.finditer(text):
        token = m.group(0)
        mantissa = re.split(r"[eE]", token)[0]
        if mantissa.count(".") > 1 or _VERSION_OF.search(text[max(0, m.start() - 14):m.start()]):
            continue
        if not estimates and _ESTIMATE_BEFORE.search(text[max(0, m.start() - 16):m.start()]):
            continue
        unit = _UNIT_AFTER.match(text, m.end())
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        if not decimals and not unit and "e" not in token.lower():
            continue
        figures.append(Figure(token + (unit.group(0) if unit else ""), float(token.replace(",", "")),
                              decimals, "e" in token.lower(), bool(unit) and unit.group(0).strip() == "%"))
    return figures


def notebook_output_text(nb) -> str:
    """Everything a notebook's saved outputs show as text: streams, and the text/plain (or
    markdown) of results and displays."""
    parts = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                parts.append(o.get("text", ""))
            elif o.get("output_type") in ("execute_result", "display_data"):
                data = o.get("data", {})
                parts.extend(data.get(k, "") for k in ("text/plain", "text/markdown"))
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


def _numbers(text: str) -> list[float]:
    out = []
    for m in re.finditer(r"(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
        out.append(float(m.group(0).replace(",", "")))
        if "," in m.group(0):  # "1,024" may also be two numbers of a list
            out.extend(float(x) for x in m.group(0).split(",") if x)
    return out


def figure_shown(fig: Figure, numbers: list[float]) -> bool:
    """Whether some output number, rounded as the lesson rounds, is the figure (a % figure may
    also be a fraction the notebook printed: 94.6% for 0.946)."""
    def same(m: float) -> bool:
        if fig.scientific:
            return f"{m:.{fig.decimals}e}" == f"{fig.value:.{fig.decimals}e}"
        return f"{m:.{fig.decimals}f}" == f"{fig.value:.{fig.decimals}f}"

    return any(same(m) or (fig.percent and same(m * 100)) for m in numbers)


def linked_json(markdown: str, folder: Path) -> list[Path]:
    """The JSON files a markdown text links to (`[text](path.json)`, relative to its folder)."""
    links = re.findall(r"\]\(([^)\s#]+\.json)(?:#[^)]*)?\)", markdown)
    return [p for p in dict.fromkeys((folder / link).resolve() for link in links) if p.is_file()]


def figure_problems(stage: Stage, root: Path = ROOT) -> list[str]:
    """The figures of the measured sections of the stage's lessons (its README.md and each
    appendix's) that neither the part's notebook's outputs nor a JSON file the lesson links show."""
    import json

    problems = []
    books = sorted((root / "notebooks").glob(f"{stage.number:02d}_*.ipynb"))
    notebook_text = "\n".join(notebook_output_text(json.loads(b.read_text())) for b in books)
    for lesson in stage.lessons():
        rel = lesson.relative_to(root).as_posix()
        markdown = lesson.read_text()
        figures = lesson_figures(measured_sections(markdown))
        if not figures:
            continue
        if not books:
            problems.append(f"{rel} quotes measurements but there is no notebooks/{stage.number:02d}_*.ipynb")
            continue
        data = linked_json(markdown, lesson.parent)
        numbers = _numbers("\n".join([notebook_text] + [p.read_text() for p in data]))
        names = ", ".join([f"notebooks/{b.name}" for b in books] + [_rel(p, root) for p in data])
        problems += [f"{rel}, measured section: {f.text!r} is not in the outputs of {names}"
                     for f in dict.fromkeys(figures) if not figure_shown(f, numbers)]
    return problems


class _NotebookNumbers:
    """The numbers of notebook NN's saved outputs, read once per `check`."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def __call__(self, n: int) -> tuple[list[str], list[float]]:
        import json

        if n not in self.cache:
            books = sorted((self.root / "notebooks").glob(f"{n:02d}_*.ipynb"))
            self.cache[n] = ([f"notebooks/{b.name}" for b in books],
                             _numbers("\n".join(notebook_output_text(json.loads(b.read_text())) for b in books)))
        return self.cache[n]


def quoted_figure_problems(where: str, text: str, part: int, notebooks: _NotebookNumbers) -> list[str]:
    """The figures of a part's exercise solutions (`text`, numbered items "1. ...") that no
    notebook shows: each must be in the outputs of notebook `part` or of a notebook its item names
    ("notebook 01 measured ..."). Numbers an item works out ("about 61 s", "= 499.5 MiB") are not
    quotes (see `lesson_figures`)."""
    problems = []
    for item in re.split(r"\n(?=\d+\. )", text):
        figures = lesson_figures(item, estimates=False)
        if not figures:
            continue
        named = re.findall(r"\b[Nn]otebooks? (\d\d)\b|notebooks/(\d\d)_", item)
        parts = [part] + sorted({int(a or b) for a, b in named} - {part})
        names = [name for n in parts for name in notebooks(n)[0]]
        numbers = [x for n in parts for x in notebooks(n)[1]]
        at = where + (f", exercise {item.split('.')[0]}" if re.match(r"\d+\. ", item) else "")
        if not names:
            problems.append(f"{at} quotes measurements but there is no notebooks/{part:02d}_*.ipynb")
            continue
        problems += [f"{at}: {f.text!r} is not in the outputs of {', '.join(names)}"
                     for f in dict.fromkeys(figures) if not figure_shown(f, numbers)]
    return problems


def solutions_figure_problems(root: Path = ROOT) -> list[str]:
    """The figures SOLUTIONS.md quotes under "## Part NN" that no notebook shows (see
    `quoted_figure_problems`)."""
    notebooks = _NotebookNumbers(root)
    problems = []
    path = root / "SOLUTIONS.md"
    if path.is_file():
        markdown = path.read_text()
        heads, lines = _headings(markdown), markdown.splitlines()
        for i, (level, title, line) in enumerate(heads):
            m = re.match(r"Part (\d+)\b", title)
            if level == 2 and m:
                end = next((ln for lv, _, ln in heads[i + 1:] if lv <= level), len(lines))
                problems += quoted_figure_problems(f"SOLUTIONS.md, Part {int(m.group(1)):02d}",
                                                   "\n".join(lines[line + 1:end]), int(m.group(1)), notebooks)
    return problems


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def code_section(markdown: str, whole: bool = False) -> str:
    """The lesson's "The code" section (its code walk), up to the next heading of its level; when
    it has none, "" (or with `whole`, the whole text: an appendix may walk its code throughout)."""
    heads = _headings(markdown)
    lines = markdown.splitlines()
    for i, (level, title, line) in enumerate(heads):
        if title.strip().lower() == "the code":
            end = next((ln for lv, _, ln in heads[i + 1:] if lv <= level), len(lines))
            return "\n".join(lines[line + 1:end])
    return markdown if whole else ""


def _code_of(line: str) -> str:
    """A line without its indentation and trailing comment (an excerpt may comment differently): the
    first " #" outside a string literal (quotes before it balanced) starts the comment."""
    for m in re.finditer(r"\s#", line):
        before = line[:m.start()]
        if before.count('"') % 2 == 0 and before.count("'") % 2 == 0:
            return before.strip()
    return line.strip()


def _c_code_of(line: str) -> str:
    """A C line without its indentation and comments (`/* ... */` closed on the line, `//` on)."""
    return re.sub(r"/\*.*?\*/", "", line).split("//")[0].strip()


def excerpt_lines(block: str, code_of=_code_of, comments: tuple[str, ...] = ("#",)) -> list[str]:
    """The lines of an excerpt that must be in the code: not blank, not a comment, not an elision."""
    return [c for c in map(code_of, block.splitlines()) if c and not c.startswith((*comments, "..."))]


def _contains_in_order(lines: list[str], source: list[str]) -> int:
    """How many of `lines`, in order, `source` holds (each after the one before)."""
    it = iter(source)
    return next((i for i, line in enumerate(lines) if not any(line == s for s in it)), len(lines))


def excerpt_problems(stage: Stage, root: Path = ROOT) -> list[str]:
    """The python and C excerpts of a lesson's code walk that are not the part's code: each one's
    lines must appear, in order, in one file of the part or of shared/ (.py; .c and .h for C;
    elisions `...` and comments aside), so a lesson cannot show code the part no longer has. The
    code walk is the lesson's "The code" section; an appendix's lesson (cpu/README.md) is all code
    walk unless it has that section."""
    problems = []
    for lesson in stage.lessons():
        rel = lesson.relative_to(root).as_posix()
        section = code_section(lesson.read_text(), whole=lesson.parent != stage.path)
        for lang, suffixes, code_of, comments in (("python", (".py",), _code_of, ("#",)),
                                                  ("c", (".c", ".h"), _c_code_of, ("/*", "*"))):
            blocks = re.findall(rf"^```{lang}\n(.*?)^```", section, re.S | re.M)
            if not blocks:
                continue
            files = [f for d in (stage.path, root / "shared") for f in d.rglob("*") if f.suffix in suffixes]
            sources = [[code_of(line) for line in f.read_text().splitlines()] for f in files]
            for block in blocks:
                lines = excerpt_lines(block, code_of, comments)
                best = max((_contains_in_order(lines, src) for src in sources), default=0)
                if best < len(lines):
                    problems.append(f"{rel}, The code: an excerpt's line {lines[best]!r} "
                                    f"is not in the part's code (in that order)")
    return problems


# ------------------------------------------------------------------------------- vLLM paths

VLLM_VERSION = "0.33.0"
VLLM_FILES = "shared/vllm_v0_33_0_files.txt"  # what the docs' vLLM paths may name (its header says whence)
_SOURCE = r"(?:py|cu|cuh|cpp|cc|c|h|hpp)"
_FULL_PATH = re.compile(rf"(?<![\w./-])(?:vllm|csrc)/[\w./{{}},-]*?(?:\.{_SOURCE}\b|/(?=[\s`'\").,;:]|$))")
_OTHER_VERSION = re.compile(r"\bv(\d+\.\d+(?:\.\d+)?)\b")
# Sentences about another project: their relative paths are that project's, not vLLM's.
_OTHER_PROJECT = re.compile(r"\b(?:SGLang|sglang|sgl-router|nano-vllm|mini-sglang|TensorRT-LLM|Dynamo|llm-d|"
                            r"Mooncake|LMCache|transformers|Hugging Face)\b")


@functools.lru_cache(maxsize=4)
def _vllm_files(path: str, mtime_ns: int) -> frozenset[str]:
    return frozenset(line.strip() for line in Path(path).read_text().splitlines()
                     if line.strip() and not line.startswith("#"))


def vllm_files(root: Path = ROOT) -> frozenset[str]:
    """The paths of vLLM v0.33.0 listed in shared/vllm_v0_33_0_files.txt (empty when it is missing)."""
    path = root / VLLM_FILES
    return _vllm_files(str(path), path.stat().st_mtime_ns) if path.is_file() else frozenset()


def _expand(token: str) -> list[str]:
    """`a/{b,c}.py` -> a/b.py, a/c.py (one brace group)."""
    m = re.search(r"\{([^{}]*)\}", token)
    return [token[:m.start()] + x + token[m.end():] for x in m.group(1).split(",")] if m else [token]


def vllm_path_known(token: str, files: frozenset[str], relative: bool) -> bool:
    """Whether a path of vLLM (a file, or a folder ending in "/") is in v0.33.0. A `relative` one
    ("fused_moe/fused_moe.py", "serving.py") may be the tail of a listed path."""
    for path in _expand(token):
        if path.endswith("/"):
            ok = any(f.startswith(path) or (relative and f"/{path}" in f) for f in files)
        else:
            ok = path in files or (relative and any(f.endswith("/" + path) for f in files))
        if not ok:
            return False
    return True


def _sentence_at(text: str, pos: int) -> str:
    """The sentence of a markdown text around `pos`: paragraphs and list items end one, and so does
    a full stop before a capital letter, a backquote or a parenthesis."""
    stops = list(re.finditer(r"\n\s*\n|\n\s*(?:[-*]|\d+\.)\s|[.!?]\s+(?=[A-Z`(*])", text))
    start = max((m.end() for m in stops if m.end() <= pos), default=0)
    end = min((m.start() for m in stops if m.start() >= pos), default=len(text))
    return text[start:end]


def vllm_path_problems(root: Path = ROOT) -> list[str]:
    """vLLM paths that vLLM v0.33.0 does not have. Checked: every `vllm/...` or `csrc/...` path in
    a code span of the lessons, SOLUTIONS.md and the notebooks' markdown, or in a part's module
    docstring; and in a lesson's "In vLLM" section, every code span that is a path at all, a
    relative one ("fused_moe/fused_moe.py") matching the tail of a listed file. Not checked: a path
    that is the tail of one of the course's own files ("csrc/gemm_cpu.c", "quant_triton.py"); the
    paths of a sentence that names another version ("v0.8.5's `vllm/core/scheduler.py`"); the
    relative paths of a sentence that names another project (SGLang, ...)."""
    import ast
    import json

    files = vllm_files(root)
    if not files:
        return [f"{VLLM_FILES} is missing: the docs' vLLM paths cannot be checked"]
    ours = {f.relative_to(d).as_posix() for d in [s.path for s in stages(root)] + [root / "shared"]
            for f in d.rglob("*") if f.is_file() and not _SKIP_DIRS & set(f.parts)}
    relative_path = re.compile(rf"[\w.{{}},-]+(?:/[\w.{{}},-]+)*(?:\.{_SOURCE}|/)")
    problems = []

    def check_text(where: str, text: str, in_vllm: list[tuple[int, int]] = (), spans: bool = True):
        """`where` names the place, with {line} for the line number."""
        if spans:  # a code span broken over two lines is one path
            found = [(m.start(), re.sub(r"\s*\n\s*", "", m.group(1))) for m in re.finditer(r"`([^`]+)`", text)]
        else:
            found = [(m.start(), m.group(0)) for m in _FULL_PATH.finditer(text)]
        for pos, token in found:
            full = _FULL_PATH.fullmatch(token) is not None
            relative = not full and any(a <= pos < b for a, b in in_vllm) and relative_path.fullmatch(token)
            if not (full or relative):
                continue
            if (relative or token.startswith("csrc/")) and any(f == token or f.endswith("/" + token) for f in ours):
                continue  # the course's own file
            sentence = _sentence_at(text, pos)
            if any(v != VLLM_VERSION for v in _OTHER_VERSION.findall(sentence)):
                continue
            if relative and _OTHER_PROJECT.search(sentence):
                continue
            if not vllm_path_known(token, files, relative=not full):
                base = token.rstrip("/").rsplit("/", 1)[-1]
                near = sorted((f for f in files if f.endswith("/" + base)), key=lambda f: (f[:5] != "vllm/", f))
                problems.append(where.format(line=text.count("\n", 0, pos) + 1)
                                + f": `{token}` is not a file of vLLM v{VLLM_VERSION} ({VLLM_FILES})"
                                + (f"; it has {', '.join(near[:3])}" if near else ""))

    for path in lesson_paths(root) + [p for p in [root / "SOLUTIONS.md"] if p.is_file()]:
        text = _blank_fences(path.read_text())
        heads = _headings(text)
        offsets = [0]
        for line in text.splitlines(keepends=True):
            offsets.append(offsets[-1] + len(line))
        in_vllm = [(offsets[ln], offsets[next((e for lv, _, e in heads[i + 1:] if lv <= level), len(offsets) - 1)])
                   for i, (level, title, ln) in enumerate(heads) if "in vllm" in title.lower()]
        check_text(path.relative_to(root).as_posix() + ":{line}", text, in_vllm)
    for book in sorted((root / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(book.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                check_text(f"{book.relative_to(root).as_posix()}, markdown cell {i}, line {{line}}",
                           _blank_fences("".join(cell["source"])))
    for s in stages(root):
        for f in sorted(s.path.rglob("*.py")):
            doc = "" if _SKIP_DIRS & set(f.parts) else ast.get_docstring(_parse(f), clean=False) or ""
            if doc:
                check_text(f"{f.relative_to(root).as_posix()}, docstring line {{line}}", doc, spans=False)
    return problems


# ------------------------------------------------------------------------------- narration

# Lines that tell how the project was made instead of what the code is: "a ninth session", "this
# session's change", "a slow spell", "on a later day", "earlier runs of this table". Code words are
# not narration: inline code and fenced blocks are left out before matching, and "session" after a
# dot or in an identifier (requests.Session, start_new_session) or after a word that makes it a
# software session ("a Python session", "an HTTP session") is allowed.
_NARRATION = re.compile(r"""
      (?<![.\w])sessions?\b                                   # a ninth session, this session
    | \bspells?\b(?!\s+(?:out|it)\b)                         # a slow spell (not "spell out")
    | \b(?:an?|the|one|another|some)\s+(?:later|earlier|previous|next|other)\s+days?\b
    | \ba\s+day\s+(?:later|earlier|before)\b
    | \b(?:earlier|previous|prior|older)\s+(?:runs?|measurements?)\s+(?:of|on|in|before)\b
    | \b(?:earlier|previous|prior|older)\s+builds?\b                 # the older build was faster
    | \b(?:at|before|after|since|from|than)\s+(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b  # at f7a9808
    """, re.I | re.X)
_SOFTWARE_SESSION = re.compile(r"\b(?:python|ipython|interactive|jupyter|notebook|http|https|client|aiohttp|"
                               r"requests|tcp|tls|ssh|shell|terminal|login|browser|tmux|kernel)\s+sessions?\b",
                               re.I)


def prose_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number from 1, text) of each line outside fenced code blocks, inline code removed."""
    return [(i, re.sub(r"`[^`\n]*`", " ", line))
            for i, (line, prose) in enumerate(zip(markdown.splitlines(), _outside_fences(markdown)), 1) if prose]


def narration(text: str) -> list[tuple[int, str]]:
    """(line number, words) of each line of a markdown text that narrates how the project was made."""
    hits = []
    for n, line in prose_lines(text):
        allowed = {m.end() - len(m.group(0).split()[-1]) for m in _SOFTWARE_SESSION.finditer(line)}
        found = [m.group(0) for m in _NARRATION.finditer(line) if m.start() not in allowed]
        if found:
            hits.append((n, ", ".join(repr(" ".join(f.split())) for f in found)))
    return hits


def lesson_paths(root: Path = ROOT) -> list[Path]:
    """Every lesson: each part's README.md and each of its appendices' README.md."""
    return [p for s in stages(root) for p in s.lessons()]


def doc_paths(root: Path = ROOT) -> list[Path]:
    """The course's prose: the lessons, the top-level README.md, SOLUTIONS.md, LEARNING_PATH.md and
    GLOSSARY.md, deploy/README.md, and the notebooks (their markdown cells)."""
    docs = lesson_paths(root) + [root / f for f in ("README.md", "SOLUTIONS.md", "LEARNING_PATH.md", "GLOSSARY.md",
                                                    "deploy/README.md")]
    return [p for p in docs if p.is_file()] + sorted((root / "notebooks").glob("*.ipynb"))


def narration_problems(root: Path = ROOT) -> list[str]:
    """The doc lines that narrate how the project was made ("a ninth session", "a slow spell", "a
    later day", "earlier runs of this table"): the docs describe the code and its figures as they
    are now; git history keeps the story."""
    import json

    problems = []
    for path in doc_paths(root):
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            texts = [(f"{rel}, markdown cell {i}, line ", "".join(c["source"]))
                     for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
        else:
            texts = [(f"{rel}:", path.read_text())]
        for where, text in texts:
            problems += [f"{where}{n}: narrates how the project was made ({words}); say what the code "
                         f"is and what it measures now" for n, words in narration(text)]
    return problems


# ------------------------------------------------------------------------------- lesson frame

_LINK = re.compile(r"\b(previous|next):\s*\[[^\]]*\]\(([^)\s]+)\)")


def lesson_header(text: str) -> str:
    """A lesson's lines before its first section (## ...): the title and the links under it."""
    head = []
    for line in text.splitlines():
        if line.startswith("## "):
            break
        head.append(line)
    return "\n".join(head)


def navigation_problems(root: Path = ROOT) -> list[str]:
    """Each part's lesson links the part before it (`previous: [..](..)`) and the part after it
    (`next: [..](..)`) in its header, and each link resolves to that part's lesson (the first part
    needs no previous link, the last no next one)."""
    problems = []
    all_stages = stages(root)
    for i, s in enumerate(all_stages):
        lesson = s.path / "README.md"
        if not lesson.is_file():
            continue
        links = {kind: target for kind, target in _LINK.findall(lesson_header(lesson.read_text()))}
        wanted = {"previous": all_stages[i - 1] if i > 0 else None,
                  "next": all_stages[i + 1] if i + 1 < len(all_stages) else None}
        for kind, other in wanted.items():
            if other is None:  # the first part has no previous one, the last no next one
                continue
            if kind not in links:
                problems.append(f"{s.name}/README.md: no `{kind}:` link to {other.name} under its title")
            elif (lesson.parent / links[kind]).resolve() != (other.path / "README.md").resolve():
                problems.append(f"{s.name}/README.md: its `{kind}:` link goes to {links[kind]}, not "
                                f"../{other.name}/README.md")
    return problems


KEY_IDEAS = "## Key ideas"


def key_ideas_problems(root: Path = ROOT) -> list[str]:
    """Each part's lesson has a "## Key ideas" section of 3 to 6 bullets: what a reader should
    keep from the part, in a few lines."""
    problems = []
    for s in stages(root):
        lesson = s.path / "README.md"
        if not lesson.is_file():
            continue
        lines = lesson.read_text().splitlines()
        if KEY_IDEAS not in lines:
            problems.append(f"{s.name}/README.md: no {KEY_IDEAS!r} section")
            continue
        body = []
        for line in lines[lines.index(KEY_IDEAS) + 1:]:
            if line.startswith("## "):
                break
            body.append(line)
        bullets = [line for line in body if line.startswith(("- ", "* "))]
        if not 3 <= len(bullets) <= 6:
            problems.append(f"{s.name}/README.md: its {KEY_IDEAS!r} section has {len(bullets)} bullets, "
                            f"not 3 to 6")
    return problems


def server_groups(root: Path = ROOT) -> list[list[Stage]]:
    """The parts grouped by byte-identical `server.py`, in part order; parts without one are left out.

    Why: the HTTP layer (parity through the openai client, streaming, stop strings, bad input,
    disconnects, /health during generation) is tested in full once per group, on its latest part,
    which has the most machinery under that server code. Every part's engine is proven on its own
    by the engine tests (greedy parity with HF, the part's technique), so for the other parts of a
    group, identical server code over a different engine needs only a smoke test: that this part's
    engine is wired under it (models and health, a greedy completion equal to HF's, a stream, an
    OpenAI-shaped error)."""
    groups: dict[bytes, list[Stage]] = {}
    for s in stages(root):
        server = s.path / "server.py"
        if server.is_file():
            groups.setdefault(server.read_bytes(), []).append(s)
    return sorted(groups.values(), key=lambda g: g[0].number)


# ------------------------------------------------------------------------------- notebooks

FIGURES = "notebooks/figures"  # each lesson's key picture, notebooks/figures/NN_*.png, written by notebook NN


def lesson_picture(fig, name: str, root: Path = ROOT):
    """Save a notebook's key plot as the picture its lesson embeds (notebooks/figures/`name`, e.g.
    "03_kv_memory.png") and return it as an IPython image read back from that file, for the cell to
    display: so the cell's saved output is the file's bytes, which `check` compares. The figure is
    closed. In quick mode (COURSE_QUICK=1) the file goes to a temporary folder instead: a committed
    picture comes from a full run."""
    import matplotlib.pyplot as plt
    from IPython.display import Image

    quick = os.environ.get(QUICK_ENV) == "1"
    folder = Path(tempfile.mkdtemp(prefix="course-figures-")) if quick else root / FIGURES
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / name, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Image(filename=str(folder / name))


def _png_outputs(cell) -> list[bytes]:
    import base64

    return [base64.b64decode("".join(o["data"]["image/png"])) for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]


def picture_problems(stage: Stage, root: Path = ROOT) -> list[str]:
    """The pictures a lesson embeds (`![caption](path.png)`) that are missing, or, under
    notebooks/figures/, not written by the part's notebook's committed run: the file must be named
    for the part (NN_*.png), and a code cell of notebook NN must name it and show, as its saved
    image output, exactly the file's bytes (see `lesson_picture`)."""
    import json

    problems = []
    figures = (root / FIGURES).resolve()
    for lesson in stage.lessons():
        rel = lesson.relative_to(root).as_posix()
        for caption, target in re.findall(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", _blank_fences(lesson.read_text())):
            path = (lesson.parent / target).resolve()
            shown = _rel(path, root)
            if not path.is_file():
                problems.append(f"{rel} embeds {shown}, which does not exist")
                continue
            if path.parent != figures:
                continue
            if not caption.strip():
                problems.append(f"{rel} embeds {shown} without a caption")
            if not path.name.startswith(f"{stage.number:02d}_"):
                problems.append(f"{rel} embeds {shown}: a lesson's picture is its own notebook's, "
                                f"{FIGURES}/{stage.number:02d}_*.png")
                continue
            books = sorted((root / "notebooks").glob(f"{stage.number:02d}_*.ipynb"))
            cells = [c for b in books for c in json.loads(b.read_text())["cells"]
                     if c["cell_type"] == "code" and path.name in "".join(c["source"])]
            data = path.read_bytes()
            if not any(data in _png_outputs(c) for c in cells):
                problems.append(f"{rel} embeds {shown}, which is not the picture notebook "
                                f"{stage.number:02d}'s committed run shows (a cell that names it and displays "
                                f"the file; `python -m shared.course notebooks {stage.number:02d}` writes both)")
    return problems



def notebook_paths(names: list[str] | None = None, root: Path = ROOT) -> list[Path]:
    """notebooks/*.ipynb, or those whose name starts with one of `names` ('03', '3', '03_paged')."""
    paths = sorted((root / "notebooks").glob("*.ipynb"))
    if not names:
        return paths
    chosen = []
    for name in names:
        key = f"{int(name):02d}_" if name.isdigit() else name
        hits = [p for p in paths if p.name.startswith(key)]
        if not hits:
            raise SystemExit(f"no notebook named {name!r} in {root / 'notebooks'}")
        chosen += [p for p in hits if p not in chosen]
    return chosen


def execute_notebook(path: Path, quick: bool, timeout: int = 600, write: bool = False):
    """Run a notebook top to bottom in a fresh `python3` kernel whose working directory is the
    repository root, with COURSE_QUICK=1 in its environment when `quick`, else without it.
    Returns (the executed notebook, wall seconds). With `write` (full mode only) the notebook is
    saved in place with its outputs. Raises nbclient's CellExecutionError when a cell fails."""
    import nbclient
    import nbformat

    if write and quick:
        raise ValueError("a notebook is committed from a full run, never a quick one")
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != QUICK_ENV}
    if quick:
        env[QUICK_ENV] = "1"
    # kernel_name="python3" starts ipykernel from this interpreter even when no kernelspec has been
    # installed (jupyter_client falls back to the native kernel of the running Python).
    # record_timing=False, coalesce_streams=True: no per-cell timestamps, and a cell's printed text
    # saved as one output per stream, so re-running changes only what was measured.
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                     coalesce_streams=True,
                                     resources={"metadata": {"path": str(path.parent.parent)}})
    start = time.perf_counter()
    client.execute(env=env)
    wall = time.perf_counter() - start
    if write:
        nb.metadata["course"] = {"executed": "full", "wall_s": round(wall, 1)}
        nbformat.write(nb, path)
    return nb, wall


def _shows_output(source: str) -> bool:
    """Whether a cell calls print(), display() or plt.show() itself (not only inside a function it
    defines), so that running it must leave outputs. IPython magics and shell lines are skipped."""
    import ast

    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False

    def calls(node) -> bool:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return False
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("print", "display")) or \
                    (isinstance(f, ast.Attribute) and f.attr == "show"):
                return True
        return any(calls(child) for child in ast.iter_child_nodes(node))

    return calls(tree)


def execution_problems(nb) -> list[str]:
    """Why a notebook is not committed executed in full mode, as sentences; empty when it is.

    Every code cell ran, in order, in one fresh kernel (execution counts 1, 2, 3, ...); a cell
    that prints or plots has its outputs; no output is an error; the notebook was saved by
    `python -m shared.course notebooks` from a full run, not a quick one."""
    problems, expected = [], 1
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        count = cell.get("execution_count")
        if count is None:
            problems.append(f"cell {i} was not executed")
        elif count != expected:
            problems.append(f"cell {i} has execution_count {count}, expected {expected} "
                            "(cells run out of order, or not in one fresh kernel)")
        expected = (count or expected) + 1
        outputs = cell.get("outputs", [])
        if _shows_output(cell.source) and not outputs:
            problems.append(f"cell {i} prints or plots but has no outputs")
        for o in outputs:
            if o.get("output_type") == "error":
                problems.append(f"cell {i} has an error output: {o.get('ename')}: {o.get('evalue')}")
    if nb.metadata.get("course", {}).get("executed") != "full":
        problems.append("not saved by `python -m shared.course notebooks` (full mode)")
    return problems


def appendix_title(stage: Stage, folder: str) -> str:
    """The first heading of an appendix's README.md, else ''."""
    lesson = stage.path / folder / "README.md"
    heads = _headings(lesson.read_text()) if lesson.is_file() else []
    return heads[0][1] if heads else ""


def diff(a: Stage, b: Stage, stat: bool = False) -> str:
    """The unified diff of two parts' folders, then the shared/ definitions `b` introduced. A part
    whose stage.toml declares appendix folders (`appendix = ["cpu/"]`) is shown in groups: the
    stage first, then each appendix under a heading; --stat gives each group its totals."""
    fa, fb = a.files(), b.files()
    groups: dict[str, list[str]] = {"": []}
    for folder in dict.fromkeys(b.appendix + a.appendix):
        groups[folder] = []
    for f in sorted(fa.keys() | fb.keys()):
        groups[b.group_of(f) or a.group_of(f)].append(f)
    out = []
    for folder, files in groups.items():
        if folder:
            title = appendix_title(b, folder) or appendix_title(a, folder)
            out.append(f"\n# appendix {b.name}/{folder}/" + (f": {title}" if title else "") + "\n")
        elif len(groups) > 1:
            out.append(f"# the stage: {b.name} against {a.name}\n")
        count = plus_all = minus_all = 0
        for f in files:
            old = fa[f].read_text(errors="replace").splitlines(keepends=True) if f in fa else []
            new = fb[f].read_text(errors="replace").splitlines(keepends=True) if f in fb else []
            if old == new and f in fa and f in fb:
                continue
            lines = list(difflib.unified_diff(old, new, f"{a.name}/{f}", f"{b.name}/{f}"))
            if stat:
                plus = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
                minus = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))
                state = "added" if f not in fa else "removed" if f not in fb else "changed"
                out.append(f"{f:40s} {state:8s} +{plus} -{minus}\n")
                count, plus_all, minus_all = count + 1, plus_all + plus, minus_all + minus
            else:
                out.extend(x if x.endswith("\n") else x + "\n" for x in lines)
        if stat:
            what = f"appendix {folder}/" if folder else "the stage" if len(groups) > 1 else "in all"
            out.append(f"{what}: {count} file{'s' * (count != 1)}, +{plus_all} -{minus_all}\n")
    if b.shared:
        out.append(f"\n# shared/ (one copy, used by every part): what {b.name} needed there\n")
        for f, names in b.shared.items():
            for name in names:
                if stat:
                    out.append(f"shared/{f}:{name}\n")
                else:
                    out.append(f"\n## shared/{f}: {name}\n{shared_source(f, name) or '(missing)'}")
    return "".join(out)


def _busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores' worth of CPU the machine used over `seconds` (Linux /proc/stat), else None."""
    def sample():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def run_notebooks(names: list[str] | None, quick: bool, timeout: int) -> int:
    import nbclient

    failed = 0
    for path in notebook_paths(names):
        busy = _busy_cores()
        note = "" if busy is None or busy < 0.25 else \
            f"; {busy:.1f} cores busy with other work before the start: its timings will show it"
        print(f"{path.name}: running ({'quick, not saved' if quick else 'full'}){note}", flush=True)
        try:
            nb, wall = execute_notebook(path, quick, timeout, write=not quick)
        except nbclient.exceptions.CellExecutionError as e:
            print(f"{path.name}: FAILED, not saved\n{e}", flush=True)
            failed += 1
            continue
        problems = [] if quick else execution_problems(nb)
        print(f"{path.name}: ran in {wall:.1f} s" + ("" if quick else ", saved")
              + "".join(f"\n  problem: {x}" for x in problems), flush=True)
        failed += bool(problems)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.course", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--stat", action="store_true")
    sub.add_parser("check")
    sub.add_parser("servers")
    n = sub.add_parser("notebooks")
    n.add_argument("names", nargs="*", help="notebook numbers or name prefixes (default: all)")
    n.add_argument("--quick", action="store_true", help="COURSE_QUICK=1, and save nothing")
    n.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    e = sub.add_parser("exercise", help="a workspace copy of a part with its key functions stubbed")
    e.add_argument("part", help="part number or name (07, part07, part07_prefix_cache)")
    e.add_argument("--dir", type=Path, default=Path(WORKSPACE), help="the workspace (default ./workspace)")
    e.add_argument("--only", action="append", metavar="NAME",
                   help="stub only this function (\"file.py:Class.method\" or its name); repeatable")
    e.add_argument("--solution", action="store_true", help="copy the finished part, nothing stubbed")
    e.add_argument("--force", action="store_true", help="replace an existing copy (your work is lost)")
    g = sub.add_parser("grade", help="run a part's exercise tests against the workspace copy")
    g.add_argument("part")
    g.add_argument("--dir", type=Path, default=Path(WORKSPACE), help="the workspace (default ./workspace)")
    g.add_argument("--only", action="append", metavar="NAME", help="grade only this function; repeatable")
    g.add_argument("--timeout", type=float, default=1200, help="seconds for the whole test run")
    g.add_argument("--verbose", action="store_true", help="print pytest's whole output too")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for s in stages():
            print(f"{s.name:32s} {s.technique}")
    elif args.cmd == "diff":
        sys.stdout.write(diff(find_stage(args.a), find_stage(args.b), args.stat))
    elif args.cmd == "servers":
        for group in server_groups():
            print(f"{group[-1].name:32s} full HTTP tests; smoke: {', '.join(s.name for s in group[:-1]) or '-'}")
    elif args.cmd == "notebooks":
        return run_notebooks(args.names, args.quick, args.timeout)
    elif args.cmd == "exercise":
        stage = find_stage(args.part)
        stubbed = make_exercise(stage, args.dir, args.only, args.solution, args.force)
        target = args.dir / stage.name
        if not stubbed:
            print(f"{target}: the finished part (nothing stubbed)")
        else:
            print(f"{target}: write these functions (each raises NotImplementedError until you do):")
            for f in stubbed:
                print(f"  {f.label:48s} {stage.name}/{f.lesson}")
            print(f"then: python -m shared.course grade {stage.number:02d} --dir {args.dir}")
    elif args.cmd == "grade":
        stage = find_stage(args.part)
        results, output, wall = grade(stage, args.dir, args.timeout, args.only)
        if args.verbose:
            print(output)
        print(report_grade(stage, args.dir, results, wall))
        return 0 if all(r.passed for r in results) else 1
    else:
        problems = check()
        for line in problems:
            print(line)
        print("ok: every carried-forward file is accounted for" if not problems else
              f"{len(problems)} problem(s)")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
