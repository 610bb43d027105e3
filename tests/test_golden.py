"""Golden files: plan.json, the graph dump and program.py of every shipped example.

Goldens show change, not truth (the equivalence tests show truth). A missing golden file
fails; `python -m pytest tests/test_golden.py --update-goldens` rewrites them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import parcompile
from parcompile.codegen.emit import render_program, render_serve

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
TRACED = ("tiny", "llama3_8b_zero_bubble_1x8_h100")  # golden timelines (trace.json) for two examples
README_TIMELINE = ("llama3_8b_zero_bubble_1x8_h100", REPO / "docs" / "timeline.svg")  # the README's picture


def _outputs(spec: Path) -> dict[str, str]:
    plan = parcompile.compile(spec.relative_to(REPO))
    out = {"plan.json": plan.to_json(), "graph.txt": plan.graph_dump()}
    if spec.stem in TRACED:
        out["trace.json"] = plan.trace_json()
    if plan.config.workload == "train":
        out["program.py"] = render_program(plan.config, plan, REPO / "build" / plan.config.name)
    else:
        out["serve.py"] = render_serve(plan.config, plan, REPO / "build" / plan.config.name)
    return out


def test_examples_exist():
    assert len(EXAMPLES) >= 4, "examples/ must ship the tiny spec and the three big ones"


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_golden(spec, request, monkeypatch):
    monkeypatch.chdir(REPO)  # plans name files relative to where parcompile runs
    update = request.config.getoption("--update-goldens")
    outputs = _outputs(spec)
    if spec.stem == README_TIMELINE[0]:
        outputs["timeline.svg"] = parcompile.compile(spec.relative_to(REPO)).timeline_svg()
    for name, text in outputs.items():
        path = README_TIMELINE[1] if name == "timeline.svg" else GOLDEN / spec.stem / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        assert path.exists(), f"golden file {path.relative_to(REPO)} is missing; run pytest --update-goldens"
        assert text == path.read_text(), (
            f"{spec.name}: {name} differs from {path.relative_to(REPO)}; if the change is intended, "
            "regenerate with pytest --update-goldens and review the diff")
