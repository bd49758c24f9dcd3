"""The static import graph of a set of packages, read from their source with ``ast`` (nothing imported).

The rule: every ``import`` statement counts wherever it stands (module level, inside a function, under
``if TYPE_CHECKING``), because a function-level import that closes a cycle is still a cycle a reader
has to untangle, and it moves the failure from import time to a call site. An import names the most
specific module it reaches (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``);
the parent packages Python runs first are not edges (a package's ``__init__`` is checked by its own
imports). Modules outside the packages (the standard library, torch, ...) are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ImportGraph:
    """Module name -> the modules of the same packages it imports, and where each edge was written."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    lines: dict[tuple[str, str], int] = field(default_factory=dict)    # (importer, imported) -> first line

    def add(self, src: str, dst: str, line: int) -> None:
        self.edges.setdefault(src, set())
        if dst != src:
            self.edges[src].add(dst)
            self.lines.setdefault((src, dst), line)

    def cycles(self) -> list[list[str]]:
        """Every strongly connected component of more than one module, each as one cycle through it."""
        return [_a_cycle(comp, self.edges) for comp in _sccs(self.edges) if len(comp) > 1]


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under the packages."""
    found = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = f
    return found


def build(root: Path, packages: Iterable[str]) -> ImportGraph:
    mods = modules(root, packages)
    graph = ImportGraph()
    for name, path in mods.items():
        graph.edges.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(node, package):
                dst = _resolve(target, mods)
                if dst is not None:
                    graph.add(name, dst, node.lineno)
    return graph


def _targets(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        return [f"{src}.{a.name}" for a in node.names]
    return []


def _resolve(dotted: str, mods: Mapping[str, Path]) -> str | None:
    while dotted and dotted not in mods:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _sccs(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (deep packages must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _a_cycle(comp: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """One closed path through a component (breadth-first back to its first module), for the message."""
    inside, first = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & inside):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return [*reversed(path), first]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp
