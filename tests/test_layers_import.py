"""The import layers of parcompile (docs/internals.md, "Layers"), read from the source with ``ast``.

- ``parcompile.core`` is the ground floor: it imports only the standard library and itself.
- ``parcompile.runtime`` does not import ``parcompile.analysis`` (generated programs import
  the runtime; the compiler's analyses must not come with it). Not true yet (issue 17):
  the known offenders are listed, a new one fails, and the strict xfail turns red once
  they are gone so the mark is removed.

Every import counts, at module level or inside a function, ``from x import y`` and
``import x`` alike, relative ones resolved against the module's package.
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

#: runtime modules that import parcompile.analysis today (issue 17: to be removed)
RUNTIME_IMPORTS_ANALYSIS = {
    "parcompile/runtime/buckets.py": {"parcompile.analysis.buckets"},   # partition, GradUnit, unit_order_key
    "parcompile/runtime/train.py": {"parcompile.analysis.buckets"},     # reshard_after_forward
    "parcompile/runtime/zero.py": {"parcompile.analysis.buckets"},      # bucket_positions, needed_in_backward, ...
}


def _module_name(path: Path, root: Path = PKG.parent) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, root: Path = PKG.parent) -> set[str]:
    """Every module ``path`` (under ``root``, the folder holding ``parcompile``) imports:
    ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (c may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
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


def _runtime_analysis_imports() -> dict[str, set[str]]:
    got = {}
    for path in _modules("runtime"):
        mods = {m for m in imports_of(path)
                if m == "parcompile.analysis" or m.startswith("parcompile.analysis.")}
        # ``from parcompile.analysis.buckets import x`` also yields ``...buckets.x``: keep modules
        mods = {m for m in mods if not any(m.startswith(o + ".") for o in mods)}
        if mods:
            got[_rel(path)] = mods
    return got


def test_runtime_imports_of_analysis_are_only_the_known_ones():
    got = _runtime_analysis_imports()
    new = {f: m - RUNTIME_IMPORTS_ANALYSIS.get(f, set()) for f, m in got.items()}
    new = {f: m for f, m in new.items() if m}
    assert not new, f"new imports of parcompile.analysis in the runtime: {new}"


@pytest.mark.xfail(strict=True, reason="issue 17: runtime/buckets.py, runtime/train.py and runtime/zero.py "
                                       "import parcompile.analysis.buckets (the bucket rules belong in "
                                       "parcompile.core)")
def test_runtime_does_not_import_analysis():
    assert _runtime_analysis_imports() == {}
