"""Every import of the project's own modules outside the package resolves.

`test_import_order.py` checks how workbench/ imports itself. The scripts in jobs/, the tests and
the notebooks import workbench too, and a module that moves (as the model configuration did, to
`workbench.arch`) breaks them without breaking the package: a GPU test that skips on CPU, or a
notebook cell, only fails where it runs. This finds every `import workbench...` and
`from workbench... import name` by parsing (nothing is executed but the imports of workbench
modules themselves) and checks that each module exists and each imported name is an attribute
or a submodule of it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[tuple[str, str]]:
    """(label, python source) for every .py under jobs/ and tests/ and every notebook's code."""
    out = [(str(p.relative_to(ROOT)), p.read_text())
           for d in ("jobs", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            text = "".join(cell["source"])
            # IPython magics and shell escapes are not Python
            lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("%", "!"))]
            out.append((f"{nb.relative_to(ROOT)} cell {i}", "\n".join(lines)))
    return out


def _imports(label: str, source: str) -> list[tuple[str, int, str, str | None]]:
    """(label, line, module, imported name or None) for each absolute import of workbench."""
    found = []
    for node in ast.walk(ast.parse(source, filename=label)):
        if isinstance(node, ast.Import):
            found += [(label, node.lineno, a.name, None) for a in node.names
                      if a.name.split(".")[0] == "workbench"]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "workbench"):
            found += [(label, node.lineno, node.module, a.name) for a in node.names]
    return found


def _problem(module: str, name: str | None) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return f"no module {e.name!r}"
    if name is None or name == "*" or hasattr(mod, name):
        return None
    if hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        return None
    return f"{module} has no attribute or submodule {name!r}"


IMPORTS = [imp for label, src in _sources() for imp in _imports(label, src)]


def test_the_scan_finds_the_imports_it_checks():
    """The check is only as good as its reach: the jobs, the tests and the notebooks each import
    workbench in many places (a parser that found nothing would pass everything)."""
    by_kind = {k: sum(1 for label, *_ in IMPORTS if label.startswith(k))
               for k in ("jobs/", "tests/", "notebooks/")}
    assert all(n >= 5 for n in by_kind.values()), by_kind


def test_a_moved_module_is_reported():
    # the break that reached CI once: the configuration module left workbench.model
    assert _problem("workbench.model", "config") == \
        "workbench.model has no attribute or submodule 'config'"
    assert _problem("workbench.modell", None) == "no module 'workbench.modell'"
    assert _problem("workbench.arch", "PRESETS") is None
    assert _problem("workbench", "arch") is None  # a submodule not yet imported


@pytest.mark.parametrize("module", sorted({m for _, _, m, _ in IMPORTS}))
def test_imports_of_workbench_resolve(module):
    bad = [f"{label}:{line}: from {module} import {name}: {why}"
           for label, line, m, name in IMPORTS if m == module
           for why in [_problem(m, name)] if why]
    assert not bad, "\n".join(bad)
