"""Notebooks use only the packages' public names: what each package lists in `__all__`.

The rule, checked on the notebooks' code cells (parsed with `ast`, IPython magics dropped):
- `from workbench.X import n`: `workbench.X` is a package or top-level module (one level below
  `workbench`, never a module inside a package) and `n` is in its `__all__`;
- `from workbench import X` / `import workbench.X as a`: `X` has an `__all__`;
- a module bound that way (including a submodule listed in an `__all__`, like
  `workbench.track.expert_stats`): every attribute the notebook reads from it is in its `__all__`.
And the figure functions of `workbench.plots` follow one pattern: `plot_*`, returning a Figure.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _code(src: str) -> str:
    # IPython magics and shell escapes are not Python; blank them, keeping line numbers
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.split("\n"))


def _public(module: types.ModuleType) -> set[str] | None:
    names = getattr(module, "__all__", None)
    return None if names is None else set(names)


def violations(cells: list[str], where: str) -> list[str]:
    bad: list[str] = []
    bound: dict[str, types.ModuleType] = {}  # notebook name -> workbench module it stands for

    def bind(alias: str, mod: types.ModuleType, at: str) -> None:
        if _public(mod) is None:
            bad.append(f"{at}: {mod.__name__} has no __all__: import from its package")
        bound[alias] = mod

    for i, src in enumerate(cells, 1):
        tree = ast.parse(_code(src), filename=f"{where}[{i}]")
        for node in ast.walk(tree):
            at = f"{where} cell {i} line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "workbench" and a.name != "workbench":
                        if a.name.count(".") != 1:
                            bad.append(f"{at}: import {a.name}: import its package instead")
                        bind(a.asname or a.name, importlib.import_module(a.name), at)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "workbench":
                mod = importlib.import_module(node.module)
                if node.module.count(".") > 1:
                    bad.append(f"{at}: from {node.module}: a module inside a package; import "
                               f"from {'.'.join(node.module.split('.')[:2])}")
                    continue
                public = _public(mod)
                for a in node.names:
                    obj = getattr(mod, a.name, None)
                    if node.module == "workbench":  # the root package lists no names
                        if not isinstance(obj, types.ModuleType):
                            obj = importlib.import_module(f"workbench.{a.name}")
                        bind(a.asname or a.name, obj, at)
                        continue
                    if public is None or a.name not in public:
                        bad.append(f"{at}: {a.name} is not in {node.module}.__all__")
                    if isinstance(obj, types.ModuleType):
                        bind(a.asname or a.name, obj, at)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in bound:
                mod = bound[node.value.id]
                if node.attr not in (_public(mod) or set()):
                    bad.append(f"{where} cell {i} line {node.lineno}: {node.value.id}.{node.attr}"
                               f" is not in {mod.__name__}.__all__")
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_uses_only_public_names(path):
    assert violations(_cells(path), path.name) == []


def test_the_check_sees_private_names():
    cells = ["%matplotlib inline\nfrom workbench.plots.runs import plot_curves\n",
             "from workbench.track import _leak, read_metrics\n",
             "from workbench import plots\nplots._label('x')\nplots.plot_curves\n",
             "from workbench.track import expert_stats as es\nes._REDUCE\n"]
    bad = violations(cells, "nb")
    assert len(bad) == 4, bad
    assert "workbench.plots.runs" in bad[0] and "_leak" in bad[1]
    assert "plots._label" in bad[2] and "es._REDUCE" in bad[3]


def test_figure_functions_are_plot_star_returning_a_figure():
    plots = importlib.import_module("workbench.plots")
    figures = [n for n in plots.__all__ if callable(getattr(plots, n))
               and "Figure" in str(inspect.signature(getattr(plots, n)).return_annotation)]
    assert figures and all(n.startswith("plot_") for n in figures), figures
    named = [n for n in plots.__all__ if n.startswith("plot_")]
    assert sorted(named) == sorted(figures), "a plot_* name that does not return a Figure"
