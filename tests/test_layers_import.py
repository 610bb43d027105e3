"""The import layers of parcompile (docs/internals.md, "Layers"), read from the source with ``ast``.

- No import cycle anywhere in ``parcompile`` (imports at module level: those a module
  runs when it is imported).
- ``parcompile.core`` is the ground floor: it imports only the standard library and itself.
- ``parcompile.runtime`` (what generated programs import) imports only ``parcompile.core``,
  itself, torch and the third-party libraries of :data:`RUNTIME_THIRD_PARTY`: never the
  compiler (``parcompile.analysis``, ``parcompile.config``, pydantic, ...); importing it
  loads none of them.
- :data:`MAY_NOT_IMPORT`: arrows that must not exist (one row per rule).

Every import counts for the layer rules, at module level or inside a function, ``from x
import y`` and ``import x`` alike, relative ones resolved against the module's package.
To add a rule, add a row to :data:`MAY_IMPORT` or :data:`MAY_NOT_IMPORT`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "parcompile"
#: third-party packages the ground floor must never import (also caught as non-stdlib)
FORBIDDEN = {"torch", "pydantic", "networkx", "lark", "jinja2", "numpy"}

#: per package: the parcompile packages it may import (any other parcompile import fails)
MAY_IMPORT = {
    "parcompile.core": ("parcompile.core",),
    "parcompile.runtime": ("parcompile.core", "parcompile.runtime"),
}
#: (importer, imported) package pairs that must not be imported, even inside a function
MAY_NOT_IMPORT: list[tuple[str, str]] = [
]
#: modules of import cycles hidden by a function-level import that are tolerated: none
#: (the driver calls the search; both run the passes through parcompile/passes/manager.py)
KNOWN_HIDDEN_CYCLE_MODULES: set[str] = set()
#: private names (``_x``) imported from another module that are tolerated: none
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()
#: third-party packages the runtime may import (at run time: torch and its helpers)
RUNTIME_THIRD_PARTY = {"torch", "torch_npu", "numpy", "safetensors", "tokenizers", "jinja2", "pyarrow", "tqdm",
                      "psutil"}   # runtime/machine/host.py: available memory, optional (/proc/meminfo without it)


def _module_name(path: Path, root: Path = PKG.parent) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, root: Path = PKG.parent, module_level: bool = False) -> set[str]:
    """Every module ``path`` (under ``root``, the folder holding ``parcompile``) imports:
    ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (c may be a module). With
    ``module_level``, only the imports run when the module is imported (not those inside
    a function, nor under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    nodes = _module_level_nodes(tree) if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "__future__":
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return out


def _module_level_nodes(tree: ast.Module):
    """The statements a module runs on import: its body, into ``if``/``try``/``with``
    blocks, not into functions or classes' methods; ``if TYPE_CHECKING:`` is skipped."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                todo.extend(node.orelse)
                continue
            todo.extend(node.body + node.orelse)
        elif isinstance(node, (ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
        elif isinstance(node, ast.ClassDef):
            todo.extend(n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _modules(sub: str) -> list[Path]:
    files = sorted((PKG / sub).rglob("*.py"))
    assert files, f"no modules under parcompile/{sub}"
    return files


def _rel(path: Path) -> str:
    return path.relative_to(PKG.parent).as_posix()


def test_imports_of_reads_every_form(tmp_path):
    pkg = tmp_path / "parcompile" / "core"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from __future__ import annotations\nimport os, json\nfrom . import axes\n"
                 "from ..analysis import cost\n\ndef g():\n    import torch\n    from pydantic import BaseModel\n")
    got = imports_of(f, root=tmp_path)
    assert {"os", "json", "parcompile.core", "parcompile.core.axes", "parcompile.analysis",
            "parcompile.analysis.cost", "torch", "pydantic", "pydantic.BaseModel"} == got


def test_core_imports_only_the_standard_library_and_itself():
    bad = {}
    for path in _modules("core"):
        for mod in imports_of(path):
            top = mod.split(".")[0]
            if top == "parcompile":
                ok = mod == "parcompile.core" or mod.startswith("parcompile.core.")
            else:
                ok = top in sys.stdlib_module_names and top not in FORBIDDEN
            if not ok:
                bad.setdefault(_rel(path), set()).add(mod)
    assert not bad, f"parcompile.core may import only the standard library and itself: {bad}"


def test_core_loads_without_third_party_packages():
    """Importing every core module (and the ``parcompile`` package above it) loads none of
    the heavy dependencies."""
    mods = [_module_name(p) for p in _modules("core")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _package_modules() -> dict[str, Path]:
    """Every module of parcompile by dotted name."""
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """module -> the parcompile modules it imports (``from a import b`` with b a module:
    ``a.b``; else ``a``). A package's ``__init__`` run before a submodule is not an edge."""
    mods = _package_modules()
    graph = {}
    for name, path in mods.items():
        got = {m for m in imports_of(path, module_level=module_level) if m in mods}
        # ``from a.b import c`` yields a.b and a.b.c: when c is a module keep only a.b.c
        # (the package a.b then counts only if something else is taken from it)
        graph[name] = {m for m in got if m != name and not (
            any(o.startswith(m + ".") and o.rpartition(".")[0] == m for o in got) and _only_modules_from(path, m, mods))}
    return graph


def _only_modules_from(path: Path, package: str, mods: dict[str, Path]) -> bool:
    """True when every ``from package import x`` of ``path`` names a submodule."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    own = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == package and any(f"{mod}.{a.name}" not in mods for a in node.names):
                return False
        elif isinstance(node, ast.Import) and any(a.name == package for a in node.names):
            return False
    return True


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_find_cycles_finds_one():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_module_level_only(tmp_path, monkeypatch):
    pkg = tmp_path / "parcompile"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "sub" / "a.py").write_text("from parcompile.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from parcompile.sub import a\n")
    assert imports_of(pkg / "sub" / "b.py", root=tmp_path, module_level=True) == set()
    assert "parcompile.sub.a" in imports_of(pkg / "sub" / "b.py", root=tmp_path)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles (module level) in parcompile: {cycles}"


def test_no_cycles_hidden_in_functions():
    """Counting the imports inside functions too: no cycle but among the known modules."""
    cycles = find_cycles(import_graph(module_level=False))
    new = [c for c in cycles if not set(c) <= KNOWN_HIDDEN_CYCLE_MODULES]
    assert not new, f"import cycles through function-level imports: {new}"



def _package_of(module: str) -> str:
    """The floor a module stands on: its subpackage (``parcompile.passes``), or itself for
    a top-level module (``parcompile.driver``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_packages_stand_on_floors():
    """Subpackages and top-level modules, with every import (function-level too) between
    them: no cycle, so each sits on a floor above what it imports (docs/internals.md)."""
    floors: dict[str, set[str]] = {}
    for module, imported in import_graph(module_level=False).items():
        a = _package_of(module)
        floors.setdefault(a, set()).update(b for b in map(_package_of, imported) if b != a)
    cycles = find_cycles(floors)
    assert not cycles, f"packages that import each other: {cycles}"
    # the floors the picture in docs/internals.md shows
    assert "parcompile.passes" in floors["parcompile.layout_search"] and "parcompile.analysis" in floors["parcompile.passes"]
    assert not floors["parcompile.core"] and floors["parcompile.runtime"] == {"parcompile.core"}
    # floor 4's rooms stand side by side: codegen reads the graph and ir's FP8 policy, not the
    # cost model; the front end and the cost model import neither each other nor codegen
    four = ("parcompile.analysis", "parcompile.codegen", "parcompile.frontend")
    assert not {(a, b) for a in four for b in four if b in floors[a]}
    assert "parcompile.ir" in floors["parcompile.codegen"] and "parcompile.config" not in floors["parcompile.runtime"]


def test_no_private_names_across_modules():
    """No ``from parcompile.x import _name`` (dunders aside) but the known ones."""
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        for mod in imports_of(path):
            last = mod.rpartition(".")[2]
            if mod.startswith("parcompile.") and last.startswith("_") and not last.startswith("__"):
                found.add((_rel(path), mod))
    assert found == KNOWN_PRIVATE_IMPORTS, (f"new: {sorted(found - KNOWN_PRIVATE_IMPORTS)}, "
                                            f"gone (remove from KNOWN_PRIVATE_IMPORTS): {sorted(KNOWN_PRIVATE_IMPORTS - found)}")


def _bad_imports(package: str, allowed_parcompile: tuple[str, ...], third_party: set[str]) -> dict[str, set[str]]:
    bad = {}
    for path in _modules(package.split(".", 1)[1].replace(".", "/")):
        for mod in imports_of(path):
            top = mod.split(".")[0]
            if top == "parcompile":
                ok = mod == "parcompile" or any(mod == a or mod.startswith(a + ".") for a in allowed_parcompile)
            else:
                ok = (top in sys.stdlib_module_names or top in third_party) and top not in (FORBIDDEN - third_party)
            if not ok:
                bad.setdefault(_rel(path), set()).add(mod)
    return bad


def test_runtime_imports_only_core_runtime_and_its_libraries():
    bad = _bad_imports("parcompile.runtime", MAY_IMPORT["parcompile.runtime"], RUNTIME_THIRD_PARTY)
    assert not bad, ("parcompile.runtime may import only parcompile.core, itself, the standard library and "
                     f"{sorted(RUNTIME_THIRD_PARTY)}: {bad}")


def test_runtime_does_not_import_analysis():
    got = {_rel(p): {m for m in imports_of(p) if m.startswith("parcompile.analysis")} for p in _modules("runtime")}
    assert not {f: m for f, m in got.items() if m}


def test_layer_rules():
    """Every row of :data:`MAY_IMPORT` (besides core and runtime, tested above with their
    third-party rules) and :data:`MAY_NOT_IMPORT`."""
    bad = {}
    for package, allowed in MAY_IMPORT.items():
        for path in _modules(package.split(".", 1)[1].replace(".", "/")):
            for mod in imports_of(path):
                if mod.startswith("parcompile.") and not any(mod == a or mod.startswith(a + ".") for a in allowed):
                    bad.setdefault(_rel(path), set()).add(mod)
    for importer, imported in MAY_NOT_IMPORT:
        for path in _modules(importer.split(".", 1)[1].replace(".", "/")):
            for mod in imports_of(path):
                if mod == imported or mod.startswith(imported + "."):
                    bad.setdefault(_rel(path), set()).add(mod)
    assert not bad, f"imports across the layers: {bad}"


def test_runtime_loads_no_compiler_module():
    """A fresh interpreter importing the runtime (as every generated program does) loads
    neither pydantic nor any compiler module."""
    compiler = ("parcompile.analysis", "parcompile.config", "parcompile.passes", "parcompile.ir",
                "parcompile.layout_search", "parcompile.driver", "parcompile.frontend", "parcompile.codegen")
    code = ("import sys\nimport parcompile.runtime\nfrom parcompile import runtime as rt\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'networkx', 'lark') "
            f"or m.startswith({compiler!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PKG.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
