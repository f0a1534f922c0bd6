"""No module-level mutable state decides results (docs/architecture.md, "No module-level mutable
state decides results"), and the layers beside QAT do not reach into it.

The rule, checked by parsing every module of PACKAGES with ``ast``: module-level names are
constants. A finding is
- ``global``: a ``global`` statement (a function rebinding module state);
- ``mutable``: a module- or class-level name bound to a mutable value (list/dict/set display or
  comprehension, a mutable container's constructor, a tensor factory) that is not an
  UPPER_CASE constant;
- ``written``: a module-level mutable value written after import, from a function body of any
  covered module (item or attribute stores and deletes, a mutating method such as ``append``,
  ``update``, ``pop``, ``add`` or a torch in-place ``*_`` method, also through a module alias or
  ``from ... import``);
- ``memo``: a module-level function behind ``functools.cache`` / ``lru_cache`` (a process-wide
  cache keyed on its arguments);
- ``environ``: a module-level name bound to a read of the environment (``os.environ``,
  ``os.getenv``): configuration taken at import, which no argument of a call shows.
An UPPER_CASE table that nothing writes after import is a constant, not a finding. Each
remaining finding needs an entry in ALLOWED saying why it cannot change a result; an entry that
no longer matches a finding fails the test, so the list stays the list of what there is.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages (and single modules) the rule covers.
PACKAGES = [
    "workbench/qat",
    "workbench/model",
    "workbench/train",
    "workbench/kernels",
    "workbench/formats",
    "workbench/analysis",
    "workbench/checkpoint/stacks.py",  # the stack readers of the analysis
    "workbench/checkpoint/windows.py",
    "workbench/checkpoint/stream.py",
]

LOG_ONCE = ("once-per-process log/warning de-duplication: decides what is logged, never a "
            "number")
MEMO_PURE = "memo of a pure function of its arguments (a table built from constants)"
ALLOWED: dict[tuple[str, str, str], str] = {
    ("written", "workbench.qat.ste", "_LOGGED"): LOG_ONCE,
    ("written", "workbench.train.optim", "_LOGGED"): LOG_ONCE,
    ("mutable", "workbench.train.logger", "_warned"): LOG_ONCE,
    ("written", "workbench.train.logger", "_warned"): LOG_ONCE,
    ("written", "workbench.qat.ste", "_HOOKS"): (
        "observer registry, as torch's global module hooks: the trainer's fake-quant timer "
        "enters and removes its hook (RemovableHandle) and returns each call's result as is"),
    ("global", "workbench.train.loop", "_stop_requested"): (
        "preemption flag: a signal handler can only reach module state; it decides when the "
        "loop checkpoints and stops, never what a step computes"),
    ("written", "workbench.train.distributed", "_SUBGROUPS"): (
        "process groups make_layout created, kept so teardown destroys them before the default "
        "group: a resource registry, read by nothing that computes"),
    ("written", "workbench.formats.elements", "_PAIR_LUTS"): (
        "memo of the FP4 pair-decode table per (dtype, device, -0 rule): a pure function of "
        "constants"),
    ("memo", "workbench.formats.mx_profiles", "cached_lut"): MEMO_PURE,
    ("memo", "workbench.kernels.api", "_triton"): "import memo: Triton's modules, or the error",
    ("memo", "workbench.model.loss", "_chunk_compiled"): (
        "memo of torch.compile's wrapper of a pure function, made on first use: decides speed, "
        "not values (its GPU test holds it to the plain function)"),
    ("memo", "workbench.model.loss", "_accumulate_compiled"): (
        "memo of torch.compile's wrapper of an in-place add, made on first use: decides speed, "
        "not values (its tests hold it to the eager add, bit for bit)"),
    ("memo", "workbench.model.flex", "_flex_kernel"): (
        "memo of torch.compile's wrapper of FlexAttention, made on first use: decides speed, "
        "not values (tests/model/test_attention_flex.py holds it to the SDPA reference)"),
    ("memo", "workbench.model.flex", "_flex_mask"): (
        "memo of FlexAttention's block mask per (seq, window, device): a pure function of its "
        "arguments"),
    ("memo", "workbench.train.data", "_permutation"): (
        "memo of a seeded permutation: a pure function of (seed, split, epoch, count)"),
    ("memo", "workbench.train.data", "load_corpus"): (
        "memo of the packaged corpus, read only after its sha256 matched the manifest"),
    ("memo", "workbench.analysis.fused", "block_tables"): (
        "memo of a closed form's scale tables per (stored, recipe) profile, filled by the "
        "reference's own scale functions: a pure function of constants"),
    ("memo", "workbench.analysis.fused_fp8", "block_tables"): (
        "memo of a closed form's scale tables per (format, stored, recipe) profile, filled by "
        "the reference's own scale functions: a pure function of constants"),
}

_MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "OrderedDict", "defaultdict", "deque",
                  "Counter", "ChainMap", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
                  "local", "ThreadPoolExecutor", "ProcessPoolExecutor"}
_TENSOR_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange",
                     "linspace", "logspace", "rand", "randn", "randint", "from_numpy", "array"}
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
             "setdefault", "add", "discard", "sort", "reverse", "appendleft", "popleft",
             "extendleft", "rotate", "__setitem__", "__delitem__", "__iadd__", "__ior__"}
_MEMOS = {"cache", "lru_cache"}
_CONSTANT = re.compile(r"_*[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class Finding:
    kind: str  # global | mutable | written | memo | environ
    module: str
    name: str
    where: str  # file:line

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.module, self.name)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        if isinstance(f, ast.Name):
            return f.id in _MUTABLE_CALLS
        if isinstance(f, ast.Attribute):
            base = f.value.id if isinstance(f.value, ast.Name) else None
            if base in ("torch", "np", "numpy") and f.attr in _TENSOR_FACTORIES:
                return True
            return f.attr in _MUTABLE_CALLS
    return False


def _reads_environ(value: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")
               and isinstance(n.value, ast.Name) and n.value.id == "os" for n in ast.walk(value))


def _top_statements(body: list[ast.stmt]):
    """Module-level statements, through if/try/with blocks (import-time code)."""
    for s in body:
        yield s
        for block in ("body", "orelse", "finalbody"):
            if isinstance(s, (ast.If, ast.Try, ast.With)) and hasattr(s, block):
                yield from _top_statements(getattr(s, block))
        if isinstance(s, ast.Try):
            for h in s.handlers:
                yield from _top_statements(h.body)


def _bindings(stmts):
    """(name, value, lineno) of simple assignments in these statements."""
    for s in stmts:
        if isinstance(s, ast.Assign):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    yield t.id, s.value, s.lineno
        elif isinstance(s, ast.AnnAssign) and s.value is not None and isinstance(s.target, ast.Name):
            yield s.target.id, s.value, s.lineno


def _decorator_name(d: ast.expr) -> str | None:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else None


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    containers: dict[str, int]  # module-level mutable names -> line
    aliases: dict[str, str]  # local name -> covered module it stands for
    imported: dict[str, tuple[str, str]]  # local name -> (module, name) imported from it


def _parse(path: Path, text: str, package_modules: set[str]) -> _Module:
    name = _module_name(path)
    tree = ast.parse(text, filename=str(path))
    containers: dict[str, int] = {}
    aliases: dict[str, str] = {}
    imported: dict[str, tuple[str, str]] = {}
    for s in _top_statements(tree.body):
        for n, value, line in _bindings([s]):
            if _is_mutable(value) and not (n.startswith("__") and n.endswith("__")):
                containers[n] = line
        if isinstance(s, ast.Import):
            for a in s.names:
                if a.name in package_modules:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(s, ast.ImportFrom) and s.module:
            base = s.module if s.level == 0 else _resolve_relative(name, path, s)
            for a in s.names:
                full = f"{base}.{a.name}"
                if full in package_modules:
                    aliases[a.asname or a.name] = full
                elif base in package_modules:
                    imported[a.asname or a.name] = (base, a.name)
    return _Module(name, path, tree, containers, aliases, imported)


def _resolve_relative(module: str, path: Path, node: ast.ImportFrom) -> str:
    parts = module.split(".")
    if path.name != "__init__.py":
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _base(node: ast.expr) -> ast.expr:
    """The object an item/attribute chain starts from: X in X[a].b[c]."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node


def _target(node: ast.expr, mod: _Module, local: set[str]) -> tuple[str, str] | None:
    """(module, name) of the module-level value `node` refers to, if any."""
    node = _base(node)
    if isinstance(node, ast.Name) and node.id not in local:
        if node.id in mod.imported:
            return mod.imported[node.id]
        return (mod.name, node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id in mod.aliases and node.value.id not in local:
        return (mod.aliases[node.value.id], node.attr)
    return None


def _locals(fn: ast.AST) -> set[str]:
    """Names bound in this function's own scope (parameters and stores, minus `global`s)."""
    out: set[str] = set()
    glob: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                out.add(arg.arg)
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    stack = list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Global):
            glob.update(n.names)
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            continue  # its own scope
        if isinstance(n, ast.Lambda):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return out - glob


def _writes(mod: _Module):
    """((module, name), file:line) for every write to a module-level value from a function."""
    def visit(fn: ast.AST, outer_local: set[str]):
        local = outer_local | _locals(fn)
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        stack = list(body)
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(n, local)
                continue
            hit = None
            if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, (ast.Store, ast.Del)):
                hit = _target(n.value, mod, local) if isinstance(n, ast.Subscript) else (
                    _target(n.value, mod, local) if not (isinstance(n.value, ast.Name)
                                                         and n.value.id in mod.aliases) else None)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and (
                    n.attr in _MUTATORS or (n.attr.endswith("_") and not n.attr.startswith("_"))):
                hit = _target(n.value, mod, local)
            elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                hit = _target(n.target, mod, local)
            if hit is not None:
                yield hit, f"{mod.path.relative_to(ROOT)}:{n.lineno}"
            stack.extend(ast.iter_child_nodes(n))

    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in _top_functions(mod.tree):
            yield from visit(node, set())


def _top_functions(tree: ast.Module) -> set[ast.AST]:
    """Functions not nested in another function (module level or methods)."""
    out: set[ast.AST] = set()
    for s in _top_statements(tree.body):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(s)
        elif isinstance(s, ast.ClassDef):
            stack = list(s.body)
            while stack:
                c = stack.pop()
                if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(c)
                elif isinstance(c, ast.ClassDef):
                    stack.extend(c.body)
    return out


def findings(sources: dict[Path, str] | None = None, packages=PACKAGES) -> list[Finding]:
    """Every finding in `packages` (or in `sources`: {path under ROOT: text}, for the tests of
    this checker)."""
    if sources is None:
        paths = sorted(p for pkg in packages for p in ((ROOT / pkg).rglob("*.py")
                                                       if (ROOT / pkg).is_dir() else [ROOT / pkg]))
        texts = {p: p.read_text() for p in paths}
    else:
        texts = sources
    names = {_module_name(p) for p in texts}
    mods = [_parse(p, text, names) for p, text in texts.items()]
    by_name = {m.name: m for m in mods}
    out: list[Finding] = []
    for m in mods:
        rel = m.path.relative_to(ROOT)
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Global):
                out += [Finding("global", m.name, n, f"{rel}:{node.lineno}") for n in node.names]
        for n, line in m.containers.items():
            if not _CONSTANT.fullmatch(n):
                out.append(Finding("mutable", m.name, n, f"{rel}:{line}"))
        for s in _top_statements(m.tree.body):
            for n, value, line in _bindings([s]):
                if _reads_environ(value):
                    out.append(Finding("environ", m.name, n, f"{rel}:{line}"))
        for s in _top_statements(m.tree.body):
            if isinstance(s, ast.ClassDef):
                for n, value, line in _bindings(s.body):
                    if _is_mutable(value) and not _CONSTANT.fullmatch(n):
                        out.append(Finding("mutable", m.name, f"{s.name}.{n}", f"{rel}:{line}"))
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    _decorator_name(d) in _MEMOS for d in s.decorator_list):
                out.append(Finding("memo", m.name, s.name, f"{rel}:{s.lineno}"))
        seen: set[tuple[str, str]] = set()
        for (owner, name), where in _writes(m):
            target = by_name.get(owner)
            if target is not None and name in target.containers and (owner, name) not in seen:
                seen.add((owner, name))
                out.append(Finding("written", owner, name, where))
    return sorted(set(out), key=lambda f: (f.module, f.name, f.kind))


# -- the checks -------------------------------------------------------------------------------


def test_no_module_level_state_outside_the_allow_list():
    found = findings()
    unexplained = [f for f in found if f.key not in ALLOWED]
    assert not unexplained, "module-level mutable state (see docs/architecture.md):\n" + "\n".join(
        f"  {f.kind:8s} {f.module}.{f.name}  ({f.where})" for f in unexplained)
    stale = sorted(set(ALLOWED) - {f.key for f in found})
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_every_allowed_entry_says_why():
    for key, why in ALLOWED.items():
        assert key[0] in ("global", "mutable", "written", "memo", "environ") and \
            len(why) > 20, key


def test_the_rule_is_written_where_the_docs_say():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "## No module-level mutable state decides results" in doc
    assert "tests/test_module_state.py" in doc


# The checker itself, on modules written for it: each kind is found, constants are not.
CASES = {
    "cache written from a function": ("_CACHE = {}\ndef f(k):\n    _CACHE[k] = 1\n",
                                      [("written", "_CACHE")]),
    "slot rebound in place": ("_SLOT: list = []\ndef f(x):\n    _SLOT[:] = [x]\n",
                              [("written", "_SLOT")]),
    "mutating method passed on": (("import weakref\n_AMAX = {}\n"
                                   "def f(w):\n    weakref.finalize(w, _AMAX.pop, 1, None)\n"),
                                  [("written", "_AMAX")]),
    "global rebinding": ("_n = 0\ndef f():\n    global _n\n    _n += 1\n", [("global", "_n")]),
    "lowercase container": ("seen = set()\n", [("mutable", "seen")]),
    "class-level container": ("class A:\n    cache = {}\n", [("mutable", "A.cache")]),
    "module-level tensor written": (("import torch\n_T = torch.zeros(3)\n"
                                     "def f():\n    _T.add_(1)\n"), [("written", "_T")]),
    "memo": ("import functools\n@functools.lru_cache(maxsize=4)\ndef f(x):\n    return x\n",
             [("memo", "f")]),
    "constant table": (("TABLE = {'a': 1}\n_RULES = {'x': (1, 2)}\n"
                        "def f(k):\n    return TABLE[k], _RULES.get(k)\n"), []),
    "import-time construction": ("_OPS = {1}\nif True:\n    _OPS.add(2)\n", []),
    "a local of the same name": ("_C = {}\ndef f():\n    _C = {}\n    _C[1] = 2\n    return _C\n",
                                 []),
    "parameter of the same name": ("_C = {}\ndef f(_C):\n    _C.update(a=1)\n", []),
    "environment read at import": ("import os\nREADER = os.environ.get('X', 'auto')\n",
                                   [("environ", "READER")]),
    "thread-local": ("import threading\n_local = threading.local()\n", [("mutable", "_local")]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_checker_finds_each_kind_and_leaves_constants(case):
    source, want = CASES[case]
    path = ROOT / "workbench" / "probe" / "mod.py"
    got = [(f.kind, f.name) for f in findings({path: source})]
    assert got == want, (case, got)


def test_the_checker_follows_writes_from_other_modules():
    owner = ROOT / "workbench" / "probe" / "owner.py"
    user = ROOT / "workbench" / "probe" / "user.py"
    user2 = ROOT / "workbench" / "probe" / "user2.py"
    srcs = {owner: "_BOOK = {}\nPLAIN = {'a': 1}\n",
            user: "from workbench.probe import owner\ndef f():\n    owner._BOOK['k'] = 1\n",
            user2: "from workbench.probe.owner import PLAIN as P\ndef g():\n    P.clear()\n"}
    got = sorted((f.kind, f.module, f.name) for f in findings(srcs))
    assert got == [("written", "workbench.probe.owner", "PLAIN"),
                   ("written", "workbench.probe.owner", "_BOOK")]


# -- the layers beside QAT know nothing of its internals ---------------------------------------


def _import_graph():
    spec = importlib.util.spec_from_file_location("_wb_import_graph_state",
                                                  ROOT / "tests" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", ["workbench/train/fsdp.py", "workbench/train/optim.py"])
def test_fsdp_and_the_optimizer_import_nothing_of_qat_nor_touch_instance_dicts(path):
    graph = _import_graph()
    edges = graph.edges_of(ROOT / path)
    qat = [e.dst_module for e in edges if e.dst_pkg == "qat"]
    assert qat == [], f"{path} imports {qat}"
    tree = ast.parse((ROOT / path).read_text())
    touches = [n.lineno for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr == "__dict__"]
    assert touches == [], f"{path} reaches into instance dicts at lines {touches}"
