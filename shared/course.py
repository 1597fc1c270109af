"""The course tool.

    python -m shared.course list             the parts and their techniques
    python -m shared.course diff A B [--stat] one stage against another (e.g. part01 part02)
    python -m shared.course check            carried-forward files are byte-identical unless the
                                             part's stage.toml declares them changed
    python -m shared.course servers          the parts grouped by identical server.py
    python -m shared.course notebooks [NN ...] [--quick]
                                             run notebooks top to bottom in a fresh kernel and
                                             save them with their outputs (all of them by
                                             default); --quick runs them in quick mode
                                             (COURSE_QUICK=1) and saves nothing

Each part folder holds a `stage.toml`: the technique it teaches and the files it `changed`,
`added` or `removed` relative to the part before. `check` holds the parts to that promise.

Notebooks are committed executed, so a reader sees measured outputs and plots on the
repository's web view; `notebooks` is the one way to (re)produce them, in full mode. In quick mode
the environment variable COURSE_QUICK=1 reaches the kernel; each notebook reads it in its first
code cell and shrinks its workloads (fewer requests, shorter outputs), still running every cell.
The test suite runs them that way, without writing the files."""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
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

    @property
    def name(self) -> str:
        return self.path.name

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
                             meta.get("added", []), meta.get("removed", [])))
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


def diff(a: Stage, b: Stage, stat: bool = False) -> str:
    fa, fb = a.files(), b.files()
    out = []
    for f in sorted(fa.keys() | fb.keys()):
        old = fa[f].read_text(errors="replace").splitlines(keepends=True) if f in fa else []
        new = fb[f].read_text(errors="replace").splitlines(keepends=True) if f in fb else []
        if old == new:
            continue
        lines = list(difflib.unified_diff(old, new, f"{a.name}/{f}", f"{b.name}/{f}"))
        if stat:
            plus = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
            minus = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))
            state = "added" if f not in fa else "removed" if f not in fb else "changed"
            out.append(f"{f:40s} {state:8s} +{plus} -{minus}\n")
        else:
            out.extend(x if x.endswith("\n") else x + "\n" for x in lines)
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
