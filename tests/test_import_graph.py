"""No part's modules import each other in a circle.

A circle works in Python only while each side imports the other inside a function, so it hides
until someone moves an import to the top, and it hides the layering a reader should see (the
configuration knows nothing of the engine; an interface knows none of its implementations). The
graph is read from the source with `ast`, without importing anything: every `import` statement,
at module level or inside a function, whose target is a module of the same part."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.course import stages

STAGES = stages()


def module_names(part: Path) -> dict[str, Path]:
    """'pkg.mod' (relative to the part) -> file, for every module of the part; '' is its __init__."""
    out = {}
    for f in sorted(part.rglob("*.py")):
        rel = f.relative_to(part).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        out[".".join(rel)] = f
    return out


def imports_of(name: str, file: Path, modules: dict[str, Path], part: str) -> set[str]:
    """The part's own modules that `file` (module `name`) imports, anywhere in its body."""
    is_package = file.name == "__init__.py"
    here = name.split(".") if name else []
    package = here if is_package else here[:-1]

    def resolve(base: list[str], dotted: str) -> str | None:
        target = ".".join(base + ([dotted] if dotted else []))
        return target if target in modules else None

    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                head, _, rest = alias.name.partition(".")
                if head == part and (m := resolve([], rest)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from .. import z
                base = package[:len(package) - (node.level - 1)]
                target = node.module or ""
            elif node.module and node.module.split(".")[0] == part:
                base, target = [], node.module.partition(".")[2]
            else:
                continue
            module = resolve(base, target)
            for alias in node.names:  # `from . import scheduler` names a module, not an attribute
                sub = resolve(base, ".".join(filter(None, [target, alias.name])))
                if sub is not None:
                    found.add(sub)
                elif module is not None:
                    found.add(module)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [circle_in(graph, comp) for comp in comps]


def circle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest circle through the component's first module, for the failure message."""
    start = min(comp)
    paths, seen = [[start]], {start}
    while paths:
        nxt = []
        for path in paths:
            for w in sorted(graph[path[-1]] & comp):
                if w == start:
                    return path + [start]
                if w not in seen:
                    seen.add(w)
                    nxt.append(path + [w])
        paths = nxt
    raise AssertionError("a strongly connected component always holds a circle")


def import_graph(part: Path) -> dict[str, set[str]]:
    modules = module_names(part)
    return {name: imports_of(name, f, modules, part.name) for name, f in modules.items()}


def test_the_finder_sees_a_circle_through_a_function_level_import(tmp_path):
    part = tmp_path / "part99_x"
    (part / "sub").mkdir(parents=True)
    (part / "__init__.py").write_text("from .a import A\n")
    (part / "a.py").write_text("from .sub.b import B\nclass A: ...\n")
    (part / "sub" / "__init__.py").write_text("")
    (part / "sub" / "b.py").write_text("def f():\n    from ..a import A\nclass B: ...\n")
    (part / "c.py").write_text("from . import a\n")
    graph = import_graph(part)
    assert graph["c"] == {"a"} and graph[""] == {"a"}
    assert cycles(graph) == [["a", "sub.b", "a"]]


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_no_import_cycles_among_a_parts_modules(stage):
    found = cycles(import_graph(stage.path))
    assert not found, f"{stage.name} imports in a circle: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_the_configuration_imports_nothing_of_the_engine(stage):
    """config.py is read to parse and check a command line; the engine's modules import their
    choices from it, never the other way round. It may read the registry of switches (envs.py),
    which holds no engine code."""
    graph = import_graph(stage.path)
    assert graph.get("config", set()) <= {"envs"}, f"{stage.name}/config.py imports {sorted(graph['config'])}"
    assert graph.get("envs", set()) <= {"cpu.envs"}, f"{stage.name}/envs.py imports {sorted(graph['envs'])}"


LAST = next(s for s in STAGES if s.name == "part15_full")
# The modules of part 15 that run in the API server's process: the HTTP app, the engine clients,
# the router and the proxy. They start and watch processes through process_utils.py.
FRONT_END = {"server", "async_llm", "core_client", "engine_client", "serving_chat", "serving_completion",
             "serving_tokenization", "streaming", "router", "proxy", "disagg_serve", "middleware", "metrics"}
RUNNER_SIDE = {"model_runner", "worker", "executor", "multiproc_executor"}


def test_the_engine_knows_the_runner_only_through_its_messages():
    """The engine builds SequenceBatchEntry and reads ModelRunnerOutput (runner_messages.py), and
    talks to an executor; it imports neither the runner nor the worker."""
    graph = import_graph(LAST.path)
    assert "runner_messages" in graph["engine"]
    assert graph["engine"] & RUNNER_SIDE <= {"executor"}, sorted(graph["engine"])


def test_the_front_end_imports_neither_the_executor_nor_the_worker():
    graph = import_graph(LAST.path)
    assert FRONT_END <= set(graph), sorted(FRONT_END - set(graph))
    found = {m: sorted(graph[m] & RUNNER_SIDE) for m in FRONT_END if graph[m] & RUNNER_SIDE}
    assert found == {}, found


def test_the_runner_side_imports_nothing_of_the_scheduler_side():
    """Block arithmetic both sides need is in block_utils.py; the runner and the attention backends
    never import the KV cache manager, the block pool or the scheduler."""
    graph = import_graph(LAST.path)
    runner = {"model_runner", "paged_attention", "attention_metadata", "graph_runner", "input_batch", "worker"}
    scheduler_side = {"kv_cache_manager", "block_pool", "scheduler", "engine"}
    found = {m: sorted(graph[m] & scheduler_side) for m in runner if graph[m] & scheduler_side}
    assert found == {}, found


def test_the_cpu_appendix_plugs_in_at_one_point():
    """Only platforms.py names the appendix (its CpuPlatform, by qualified name); the registry of
    switches lists the appendix's (cpu/envs.py); no other module of the stage imports cpu/."""
    graph = import_graph(LAST.path)
    importers = {m for m, deps in graph.items() if not m.startswith("cpu") and any(d.startswith("cpu") for d in deps)}
    assert importers == {"envs"} and graph["envs"] == {"cpu.envs"}, (importers, graph["envs"])
    naming = sorted(f.name for f in LAST.path.glob("*.py") if "part15_full.cpu" in f.read_text())
    assert naming == ["platforms.py"], naming


def test_the_checks_see_an_import_of_the_runner(tmp_path):
    """The checks above can fail: an engine that imports the runner, and a second point into cpu/."""
    part = tmp_path / "part15_full"
    (part / "cpu").mkdir(parents=True)
    for name in ("__init__", "model_runner", "runner_messages", "executor"):
        (part / f"{name}.py").write_text("")
    (part / "cpu" / "__init__.py").write_text("")
    (part / "cpu" / "layers.py").write_text("")
    (part / "engine.py").write_text("from .runner_messages import X\nfrom .model_runner import SequenceBatchEntry\n")
    (part / "paged_attention.py").write_text("def f():\n    from .cpu.layers import L\n")
    graph = import_graph(part)
    assert graph["engine"] & RUNNER_SIDE == {"model_runner"}
    assert graph["paged_attention"] == {"cpu.layers"}
