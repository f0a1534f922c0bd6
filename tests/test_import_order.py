"""The package layers import one way only, and project imports sit at module top.

The order is declared once, in docs/architecture.md, and mirrored in LAYERS below (the test
checks the two agree). A package may import itself and any package listed before it, never
one listed after it. Imports of the project's own modules inside function bodies, and
``try/except ImportError`` around them, are not allowed except where listed in EXCEPTIONS
with a reason. Print the whole graph with ``python tests/import_graph.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

# Loaded by path, not through sys.path: tests/ on sys.path would shadow the per-folder conftests.
_spec = importlib.util.spec_from_file_location("_workbench_import_graph",
                                               Path(__file__).resolve().parent / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = import_graph  # dataclasses look their module up here
_spec.loader.exec_module(import_graph)
ROOT, Edge, all_edges, cycles = import_graph.ROOT, import_graph.Edge, import_graph.all_edges, import_graph.cycles
package_graph, module_graph = import_graph.package_graph, import_graph.module_graph
report = import_graph.report

# Lowest first. "workbench" is the root package (docstring only).
LAYERS = [
    "workbench", "_io", "recipe", "arch", "source", "formats", "kernels", "scope", "checkpoint", "model", "qat", "analysis",
    "plots", "train", "track", "launch", "eval", "report", "compare_cli", "demo", "cli",
]

CYCLE = "intra-package import cycle broken by deferring; hoist once the modules are split"
LIGHT = "keeps a light import light: the caller's package must not pull torch/heavy layers at import"
CLI = "command entry point: subcommands import only what they run"

# (source module, imported module) -> reason. Covers edges against LAYERS, imports inside
# functions and guarded imports. An entry that no longer occurs fails the test (keep it short).
EXCEPTIONS: dict[tuple[str, str], str] = {
    # edges against the order
    ("workbench.demo", "workbench.train.export"): CLI,
    # imports inside functions
    ("workbench.launch.submit", "workbench.launch.job"): "submitit (the launch extra) is imported "
                                                         "when a job is submitted, not before",
    ("workbench.launch.submit", "workbench.launch.fits"): LIGHT,
    ("workbench.checkpoint.dcp", "workbench.checkpoint"): CYCLE,
    ("workbench.cli", "workbench.analysis.inspect"): CLI,
    ("workbench.cli", "workbench.checkpoint"): CLI,
    ("workbench.cli", "workbench.checkpoint.select"): CLI,
    ("workbench.compare_cli", "workbench.checkpoint.select"): CLI,
    ("workbench.cli", "workbench.report"): CLI,
    ("workbench.cli", "workbench.train.plan"): CLI,
    ("workbench.cli", "workbench.eval.cli"): CLI,
    ("workbench.cli", "workbench.train.args"): CLI,
    ("workbench.cli", "workbench.train.cli"): CLI,
    ("workbench.compare_cli", "workbench.analysis.compare"): CLI,
    ("workbench.compare_cli", "workbench.checkpoint"): CLI,
    ("workbench.compare_cli", "workbench.report"): CLI,
    ("workbench.demo", "workbench.model"): CLI,
    ("workbench.demo", "workbench.train.data"): CLI,
    ("workbench.demo", "workbench.train.tokenizer"): CLI,
    ("workbench.demo", "workbench.train"): CLI,
    ("workbench.demo", "workbench.train.args"): CLI,
    ("workbench.demo", "workbench.train.cli"): CLI,
    ("workbench.demo", "workbench.train.loop"): CLI,
    ("workbench.formats.api", "workbench.formats.mx"): CYCLE,
    ("workbench.formats.api", "workbench.formats.nvfp4"): CYCLE,
    ("workbench.kernels.api", "workbench.kernels"): CYCLE,
    ("workbench.kernels.adamw", "workbench.kernels"): "Triton is optional: the kernel module "
                                                      "imports it, so it loads on first use",
    ("workbench.kernels.sumsq", "workbench.kernels"): "Triton is optional: the kernel module "
                                                      "imports it, so it loads on first use",
    ("workbench.kernels.cast", "workbench.kernels"): "Triton is optional: the kernel module "
                                                     "imports it, so it loads on first use",
    ("workbench.model.attention", "workbench.model.flex"): "FlexAttention loads torch._dynamo "
                                                           "and Triton: imported on the first "
                                                           "CUDA call",
    ("workbench.launch.handle", "workbench.track.metrics"): LIGHT,
    ("workbench.launch.watch", "workbench.plots.runs"): LIGHT,
    ("workbench.track.experts", "workbench.qat.recipe"): LIGHT,
    ("workbench.track.experts", "workbench.analysis"): LIGHT,
    ("workbench.track.experts", "workbench.checkpoint"): LIGHT,
}


def _rank(pkg: str) -> int:
    assert pkg in LAYERS, f"package {pkg!r} is not in LAYERS: add it to the order (and docs/architecture.md)"
    return LAYERS.index(pkg)


def _violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        against = _rank(e.dst_pkg) > _rank(e.src_pkg)
        if not (against or e.in_function or e.guarded):
            continue
        if (e.src_module, e.dst_module) in EXCEPTIONS:
            continue
        why = ", ".join(w for w, on in (("against the layer order", against),
                                        ("inside a function", e.in_function),
                                        ("guarded by try/except ImportError", e.guarded)) if on)
        bad.append(f"{e.src_module}:{e.lineno} imports {e.dst_module} ({why})")
    return bad


def test_imports_follow_the_layer_order():
    edges = all_edges()
    bad = _violations(edges)
    assert not bad, "\n".join(bad) + "\n\n" + report(edges)


def test_no_package_cycles_outside_exceptions():
    kept = [e for e in all_edges() if (e.src_module, e.dst_module) not in EXCEPTIONS]
    assert cycles(package_graph(kept)) == []


def test_no_module_cycles_inside_a_package():
    """Two modules of one package that import each other at module level work only while
    neither touches the other's names before both finish: an order of imports away from an
    ImportError, and invisible to the package-level check above."""
    found = cycles(module_graph(all_edges()))
    assert found == [], "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_module_cycle(tmp_path):
    # the module graph itself: `from . import b` in a and `from .a import f` in b is a cycle; a
    # submodule importing its package's own names is an edge to the package's __init__
    pkg = tmp_path / "workbench" / "formats"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\ndef f():\n    from . import c\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("from . import f\nfrom . import b\n")
    old = import_graph.ROOT
    import_graph.ROOT = tmp_path
    try:
        edges = [e for p in sorted(pkg.glob("*.py")) for e in import_graph.edges_of(p)]
        g = module_graph(edges)
    finally:
        import_graph.ROOT = old
    assert g["workbench.formats.a"] == {"workbench.formats.b"}  # c is imported in a function
    assert g["workbench.formats.c"] == {"workbench.formats", "workbench.formats.b"}
    assert cycles(g) == [["workbench.formats.a", "workbench.formats.b"]]


def test_exceptions_are_still_needed():
    seen = {(e.src_module, e.dst_module) for e in all_edges()
            if e.in_function or e.guarded or _rank(e.dst_pkg) > _rank(e.src_pkg)}
    stale = sorted(set(EXCEPTIONS) - seen)
    assert not stale, f"remove these EXCEPTIONS, the imports are gone or now allowed: {stale}"


def test_order_is_declared_in_the_docs():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(r"<!-- layers -->\s*(.*?)\s*<!-- /layers -->", doc, re.DOTALL)
    assert m, "docs/architecture.md lacks the <!-- layers --> block"
    declared = [p.strip(" `") for p in m.group(1).replace("\n", " ").split("<")]
    assert declared == LAYERS


def test_the_checker_sees_a_bad_edge(tmp_path):
    # the parser itself: a function-level import against the order is caught
    pkg = tmp_path / "workbench" / "formats"
    pkg.mkdir(parents=True)
    src = pkg / "bad.py"
    src.write_text("def f():\n    from workbench.train import loop\n")
    old = import_graph.ROOT
    import_graph.ROOT = tmp_path
    try:
        (e,) = import_graph.edges_of(src)
    finally:
        import_graph.ROOT = old
    assert e.src_pkg == "formats" and e.dst_pkg == "train" and e.in_function
    assert _violations([e])
