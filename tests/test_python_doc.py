"""docs/python.md stays true: every ```python block runs, in order, in one namespace, from
the repository's top directory (as a reader would paste them)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "python.md"


def _blocks() -> list[tuple[int, str]]:
    text = DOC.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def test_python_doc_examples_run(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    blocks = _blocks()
    assert len(blocks) >= 6, "docs/python.md lost its examples"
    namespace: dict = {"__name__": "python_md"}
    for line, code in blocks:
        # a failure points at the block: the code object's first line is its line in the doc
        exec(compile("\n" * (line - 1) + code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "<override parallel.tp>:1:17: error: tp = 3 does not divide heads = 32" in out   # as the doc shows it
    assert "fails CI: True" in out
