"""Parse every module under workbench/ with ast and report project-internal imports.

Run as a script to print the package-level import graph, the imports that
sit inside function bodies, the cycles between packages and the cycles between the modules of
one package:

    .venv/bin/python tests/import_graph.py
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"


@dataclass(frozen=True)
class Edge:
    src_module: str  # dotted module name, e.g. workbench.model.experts
    dst_module: str  # dotted target, e.g. workbench.qat.ste
    lineno: int
    in_function: bool
    guarded: bool  # inside try/except ImportError
    names: tuple[str, ...] = ()  # what ``from dst import ...`` takes (a name may be a submodule)

    @property
    def src_pkg(self) -> str:
        return package_of(self.src_module)

    @property
    def dst_pkg(self) -> str:
        return package_of(self.dst_module)


def package_of(module: str) -> str:
    """workbench.model.experts -> model; workbench.cli -> cli."""
    parts = module.split(".")
    if len(parts) == 1:
        return "workbench"
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _guarded(try_node: ast.Try) -> bool:
    for h in try_node.handlers:
        names = []
        t = h.type
        if isinstance(t, ast.Tuple):
            names = [getattr(e, "id", "") for e in t.elts]
        elif t is not None:
            names = [getattr(t, "id", "")]
        if "ImportError" in names or "ModuleNotFoundError" in names:
            return True
    return False


def edges_of(path: Path) -> list[Edge]:
    module = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[Edge] = []

    def visit_one(child: ast.AST, in_fn: bool, guarded: bool, recurse: bool = True) -> None:
        if isinstance(child, ast.Import):
            for a in child.names:
                if a.name == "workbench" or a.name.startswith("workbench."):
                    out.append(Edge(module, a.name, child.lineno, in_fn, guarded))
        elif isinstance(child, ast.ImportFrom):
            target = _resolve(child, module, is_pkg)
            if target and (target == "workbench" or target.startswith("workbench.")):
                if target == "workbench":
                    for a in child.names:
                        out.append(Edge(module, f"workbench.{a.name}", child.lineno, in_fn, guarded))
                else:
                    out.append(Edge(module, target, child.lineno, in_fn, guarded,
                                    tuple(a.name for a in child.names)))
        fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.Try) and _guarded(child):
            for b in child.body:
                visit_one(b, fn, True)
            for rest in child.handlers + child.orelse + child.finalbody:
                visit_one(rest, fn, guarded)
            return
        for sub in ast.iter_child_nodes(child):
            visit_one(sub, fn, guarded)

    for top in tree.body:
        visit_one(top, False, False)
    return out


def all_edges() -> list[Edge]:
    edges: list[Edge] = []
    for path in sorted(PKG.rglob("*.py")):
        edges.extend(edges_of(path))
    return edges


def package_graph(edges: list[Edge]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for e in edges:
        if e.src_pkg != e.dst_pkg:
            g.setdefault(e.src_pkg, set()).add(e.dst_pkg)
    return g


def is_module(name: str) -> bool:
    """Whether dotted ``name`` is a module or package of the project (a file under ROOT)."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_graph(edges: list[Edge]) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports while it is being imported (imports at
    module level, guarded or not; imports inside functions run later). ``from pkg import name``
    needs the module ``pkg.name`` when there is one, else ``pkg`` itself (its ``__init__``); a
    submodule's implicit import of its parent package is no edge: Python finds the parent in
    ``sys.modules`` half-initialised and carries on, so only named imports can deadlock."""
    g: dict[str, set[str]] = {}
    for e in edges:
        if e.in_function or e.src_pkg != e.dst_pkg:
            continue
        targets = [f"{e.dst_module}.{n}" for n in e.names if is_module(f"{e.dst_module}.{n}")]
        if len(targets) < len(e.names) or not e.names:  # a name defined in dst itself
            targets.append(e.dst_module)
        for t in targets:
            if t != e.src_module:
                g.setdefault(e.src_module, set()).add(t)
    return g


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    nodes = set(graph) | {d for ds in graph.values() for d in ds}

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def report(edges: list[Edge]) -> str:
    lines = []
    total = len(edges)
    in_fn = [e for e in edges if e.in_function]
    guarded = [e for e in edges if e.guarded]
    lines.append(f"project-internal imports: {total}; inside functions: {len(in_fn)}; "
                 f"guarded by try/except ImportError: {len(guarded)}")
    lines.append("")
    lines.append("package graph (src -> dst  [top-level/in-function edge counts]):")
    counts: dict[tuple[str, str], list[int]] = {}
    for e in edges:
        if e.src_pkg == e.dst_pkg:
            continue
        c = counts.setdefault((e.src_pkg, e.dst_pkg), [0, 0])
        c[1 if e.in_function else 0] += 1
    for (s, d), (top, fn) in sorted(counts.items()):
        lines.append(f"  {s:12s} -> {d:12s} [{top}/{fn}]")
    lines.append("")
    cyc = cycles(package_graph(edges))
    lines.append(f"package cycles: {len(cyc)}")
    for c in cyc:
        lines.append("  " + " <-> ".join(c))
    lines.append("")
    mcyc = cycles(module_graph(edges))
    lines.append(f"module cycles inside a package (module-level imports): {len(mcyc)}")
    for c in mcyc:
        lines.append("  " + " <-> ".join(c))
    lines.append("")
    lines.append("imports inside functions:")
    for e in in_fn:
        rel = e.src_module
        lines.append(f"  {rel}:{e.lineno} -> {e.dst_module}{'  (guarded)' if e.guarded else ''}")
    lines.append("")
    lines.append("guarded imports of own packages:")
    for e in guarded:
        lines.append(f"  {e.src_module}:{e.lineno} -> {e.dst_module}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(all_edges()))
