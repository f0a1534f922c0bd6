"""No module-level mutable state decides analysis results.

What a call learns (compiled graphs, a failed compile, warm jobs) lives in an ``analysis.Session``
the caller owns; which path, reader and passes run is an ``AnalysisPlan`` the caller can pass;
the stack readers keep their threads, streams and buffers per read pass. So a module of
``workbench.analysis``, or a stack reader of ``workbench.checkpoint``, holds at module level
only immutable values: this test parses each with ``ast`` and fails on
- a module-level (or class-level) name bound to a mutable container or a thread-local: a
  list, dict or set display or comprehension, or a call of ``list``, ``dict``, ``set``,
  ``defaultdict``, ``OrderedDict``, ``deque``, ``Counter``, ``bytearray``, ``threading.local``,
  ``Lock``/``RLock`` or an executor;
- configuration read from the environment at import (``os.environ``, ``os.getenv``);
- a ``global`` statement (a function rebinding a module name);
- a ``functools.lru_cache`` / ``cache`` decorator (a process-wide memo);
except the names in ALLOWED, each with the reason it decides nothing.
Constant tables are ``tuple``, ``frozenset`` or ``types.MappingProxyType``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "workbench" / "analysis").glob("*.py")) + [
    ROOT / "workbench" / "checkpoint" / f"{m}.py" for m in ("stacks", "windows", "stream")]

MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                 "bytearray", "local", "Lock", "RLock", "ThreadPoolExecutor",
                 "ProcessPoolExecutor"}
CACHES = {"lru_cache", "cache"}
COLUMNS = "column names and default recipes handed to pandas and callers, never mutated"
PURE_MEMO = ("a memo of a pure function of profile names (tables the reference's own "
             "functions fill): the same value whatever was called before")
# (module path relative to ROOT, name) -> why it decides nothing
ALLOWED: dict[tuple[str, str], str] = {
    ("workbench/analysis/__init__.py", "__all__"): "the package's exported names",
    ("workbench/analysis/compare.py", "KEYS"): COLUMNS,
    ("workbench/analysis/tables.py", "KEY_COLS"): COLUMNS,
    ("workbench/analysis/inspect.py", "STORED_DEFAULT"): COLUMNS,
    ("workbench/analysis/fused.py", "block_tables"): PURE_MEMO,
    ("workbench/analysis/fused_fp8.py", "block_tables"): PURE_MEMO,
}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _mutable(value: ast.AST | None) -> str | None:
    """Why ``value`` makes a mutable module-level object (None: it does not)."""
    if value is None:
        return None
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                          ast.SetComp)):
        return f"a {type(value).__name__.lower()} display"
    if isinstance(value, ast.Call) and _name(value.func) in MUTABLE_CALLS:
        return f"a {_name(value.func)}()"
    for sub in ast.walk(value):
        if isinstance(sub, ast.Attribute) and sub.attr in ("environ", "getenv") and \
                _name(sub.value) == "os":
            return "the environment read at import"
    return None


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def findings(source: str) -> list[tuple[int, str, str]]:
    """(line, name, why) of every module-level mutable binding, ``global`` and process-wide
    memo in ``source``."""
    tree = ast.parse(source)
    out = []

    def scope(body, prefix=""):
        for node in body:
            for name in _targets(node):
                why = _mutable(node.value)
                if why:
                    out.append((node.lineno, prefix + name, why))
            if isinstance(node, ast.ClassDef):
                scope(node.body, f"{node.name}.")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    if _name(d) in CACHES:
                        out.append((node.lineno, prefix + node.name, f"@{_name(d)}"))

    scope(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out += [(node.lineno, n, "a global statement") for n in node.names]
    return out


def test_no_module_level_mutable_state():
    bad, seen = [], set()
    for path in MODULES:
        rel = path.relative_to(ROOT).as_posix()
        for line, name, why in findings(path.read_text()):
            if (rel, name) in ALLOWED:
                seen.add((rel, name))
                continue
            bad.append(f"{rel}:{line}: {name} is {why}")
    assert not bad, ("module-level state in analysis / the stack readers (put it in a Session, "
                     "a plan or the call; constants as tuple, frozenset or "
                     "MappingProxyType):\n" + "\n".join(bad))
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"remove these ALLOWED entries, they are gone: {stale}"


def test_the_scan_sees_each_kind_of_state():
    src = '''
import functools, os, threading
from collections import defaultdict
A = []
B: dict = {}
C = {k: 1 for k in "ab"}
D = threading.local()
E = defaultdict(list)
F = os.environ.get("X", "auto")
G = (1, 2)
H = frozenset({1})
class K:
    cache = {}
    n = 0
@functools.lru_cache(maxsize=8)
def f(x):
    return x
def g():
    global G
    G = ()
    local = []
    return local
'''
    got = {name: why for _, name, why in findings(src)}
    assert set(got) == {"A", "B", "C", "D", "E", "F", "K.cache", "f", "G"}, got
    assert got["F"] == "the environment read at import" and got["f"] == "@lru_cache"
    assert got["G"] == "a global statement"
