"""Golden files: plan.json, the graph dump and program.py of every shipped example.

Goldens show change, not truth (the equivalence tests show truth). They are held with
parcompile's own golden helpers (:mod:`parcompile.testing`, the `parcompile_golden`
fixture): a plan.json that differs fails with `parcompile diff` of the golden and the new
plan; other files with the first lines of a unified diff. A missing golden file fails;
`python -m pytest tests/test_golden.py --update-goldens` (or PARCOMPILE_UPDATE_GOLDENS=1)
rewrites them all.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import parcompile
from parcompile.codegen.emit import render_program, render_serve

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
TRACED = ("tiny", "llama3_8b_zero_bubble_1x8_h100")  # golden timelines (trace.json) for two examples
README_TIMELINE = ("llama3_8b_zero_bubble_1x8_h100", REPO / "docs" / "timeline.svg")  # the README's picture


def _outputs(spec: Path) -> tuple[parcompile.plan.Plan, dict[str, str]]:
    plan = parcompile.compile(spec.relative_to(REPO))
    out = {"graph.txt": plan.graph_dump()}
    if spec.stem in TRACED:
        out["trace.json"] = plan.trace_json()
    if plan.config.workload == "train":
        out["program.py"] = render_program(plan.config, plan, REPO / "build" / plan.config.name)
    else:
        out["serve.py"] = render_serve(plan.config, plan, REPO / "build" / plan.config.name)
    if spec.stem == README_TIMELINE[0]:
        out["timeline.svg"] = plan.timeline_svg()
    return plan, out


def test_examples_exist():
    assert len(EXAMPLES) >= 4, "examples/ must ship the tiny spec and the three big ones"


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_golden(spec, parcompile_golden, monkeypatch):
    monkeypatch.chdir(REPO)  # plans name files relative to where parcompile runs
    plan, outputs = _outputs(spec)
    parcompile_golden(plan, GOLDEN / spec.stem / "plan.json")
    for name, text in outputs.items():
        path = README_TIMELINE[1] if name == "timeline.svg" else GOLDEN / spec.stem / name
        parcompile_golden.text(text, path, what=f"{spec.name}: {name}")


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_full_size_example_programs_import(spec, monkeypatch, tmp_path):
    """Each example's own program (full size) defines its classes and main without error."""
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(spec.relative_to(REPO))
    render = render_program if plan.config.workload == "train" else render_serve
    path = tmp_path / "program.py"
    path.write_text(render(plan.config, plan, tmp_path))
    sp = importlib.util.spec_from_file_location(f"parcompile_golden_full_{spec.stem}", path)
    module = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(module)
    assert callable(module.main)
