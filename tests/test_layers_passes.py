"""Passes above analyses, never both ways (issue 17; docs/internals.md, "Layers").

The passes may import the analyses (the schedule pass times chunks with the estimate's
model, ``insert-collectives`` reads the bucket rules); no module of ``parcompile.analysis``
imports ``parcompile.passes``, nor the driver or the search that run the passes, at module
level or inside a function. Read from the source with ``ast``
(:func:`tests.test_layers_import.imports_of`).
"""

from __future__ import annotations

from pathlib import Path

from tests.test_layers_import import PKG, imports_of

#: what sits above the analyses: the passes, and the modules that sequence them
ABOVE_ANALYSIS = ("parcompile.passes", "parcompile.driver", "parcompile.layout_search")


def _climbs(path: Path, root: Path = PKG.parent) -> set[str]:
    return {m for m in imports_of(path, root)
            if any(m == a or m.startswith(a + ".") for a in ABOVE_ANALYSIS)}


def test_climbs_are_found_at_function_level(tmp_path):
    pkg = tmp_path / "parcompile" / "analysis"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from parcompile.core.schedule import simulate\n\n"
                 "def g():\n    from parcompile.passes.base import PassContext\n    from ..driver import PASSES\n")
    assert _climbs(f, tmp_path) == {"parcompile.passes.base", "parcompile.passes.base.PassContext",
                                    "parcompile.driver", "parcompile.driver.PASSES"}


def test_analysis_imports_no_pass():
    files = sorted((PKG / "analysis").rglob("*.py"))
    assert len(files) > 5
    bad = {f.relative_to(PKG.parent).as_posix(): sorted(c) for f in files if (c := _climbs(f))}
    assert not bad, f"parcompile.analysis imports the layer above it: {bad}"
