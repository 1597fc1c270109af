"""The course tool.

    python -m shared.course list             the parts and their techniques
    python -m shared.course diff A B [--stat] one stage against another (e.g. part01 part02)
    python -m shared.course check            carried-forward files are byte-identical unless the
                                             part's stage.toml declares them changed

Each part folder holds a `stage.toml`: the technique it teaches and the files it `changed`,
`added` or `removed` relative to the part before. `check` holds the parts to that promise."""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    args = p.parse_args(argv)
    if args.cmd == "list":
        for s in stages():
            print(f"{s.name:32s} {s.technique}")
    elif args.cmd == "diff":
        sys.stdout.write(diff(find_stage(args.a), find_stage(args.b), args.stat))
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
