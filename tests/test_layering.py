"""The import graph of ktlite/ keeps DESIGN.md's layering: no import cycle, and no module imports a layer above its own.

What counts as an import: every `import` / `from ... import` in a module, at module level or inside a function
(an import deferred to call time still ties the two modules together), except those under `if TYPE_CHECKING:`
(annotations only, never run). `from a.b import c` is an edge to the module a.b.c where that is a module, else to
a.b; the parent packages that Python imports on the way (ktlite/__init__.py, ...) are not counted.

The layers, bottom up (a module may import its own layer and those below):
  0 ground floor   ktlite.errors, ktlite.numa, ktlite.machine (stdlib and numpy: machine probes, NUMA syscalls)
  1 kernels        ktlite.kernels.** (Numba and Triton kernels, quantization formats)
  2 flags          ktlite.config
  3 runtime        ktlite.runtime.** (engine, scheduler, memory plan, models, ...)
  4 entry points   ktlite (the package's lazy exports), ktlite.cli, ktlite.server.**, ktlite.doctor, ktlite.demo,
                   ktlite.launch_server
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ktlite"
GROUND = ("ktlite.errors", "ktlite.numa", "ktlite.machine")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ktlite modules `name` imports (see the module docstring for what counts)."""

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            for target in targets:
                if target.split(".")[0] == "ktlite" and (found := known(target)) and found != name:
                    out.add(found)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    if name in GROUND:
        return 0
    if name.startswith("ktlite.kernels"):
        return 1
    if name == "ktlite.config":
        return 2
    if name.startswith("ktlite.runtime"):
        return 3
    return 4


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_graph_sees_the_known_imports():
    graph = _graph()
    assert "ktlite.runtime.memory" in graph["ktlite.runtime.knobs"]
    assert "ktlite.machine" in graph["ktlite.kernels.cpu.target"]
    assert "ktlite.kernels.cpu.target" in graph["ktlite.doctor"]  # imported inside a function: counted
    assert "ktlite.runtime.memory" not in graph["ktlite.runtime.plan_table"]  # under TYPE_CHECKING: not counted


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_upward_imports():
    upward = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets if _layer(t) > _layer(m))
    assert upward == []
