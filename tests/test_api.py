"""The Python API (issue 22, docs/python.md): overrides equal hand edits, bad overrides are
diagnostics, Plan.write equals `compile -o`, typed plan.json fields, search/verify/export
reports, and the package's callable modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main
from parcompile.plan_schema import PlanJSON

REPO = Path(__file__).resolve().parent.parent
LLAMA8B = REPO / "examples" / "llama3_8b_2x8_h100.par"
TINY = REPO / "examples" / "tiny.par"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_overrides_equal_the_spec_edited_by_hand(tp, monkeypatch):
    """The tp sweep of the Llama-3 8B example with overrides gives plan.json byte for
    byte as the spec with `tp = N` written in it (same file name, so same name and paths)."""
    monkeypatch.chdir(REPO)
    path = LLAMA8B.relative_to(REPO)
    text = path.read_text()
    assert text.count("    tp = 8\n") == 1
    by_hand = parcompile.compile(text.replace("    tp = 8\n", f"    tp = {tp}\n"), filename=str(path))
    by_override = parcompile.compile(path, overrides={"parallel.tp": tp})
    assert by_override.degrees["tp"] == tp
    assert by_override.to_json() == by_hand.to_json()
    assert [d.message for d in by_override.warnings] == [d.message for d in by_hand.warnings]


def test_overrides_add_keys_and_blocks_remove_keys_and_take_python_values():
    spec = 'model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1 }\n'
    base = parcompile.compile(spec, overrides={"parallel.tp": 8, "model.seq_len": 4096, "train.lr": 1e-4,
                                               "parallel.sequence_parallel": True, "cluster.memory": "40 GiB",
                                               "parallel.order": "tp-cp-ep-dp-pp"})
    assert (base.degrees["tp"], base.model.seq_len, base.config.train.lr) == (8, 4096, 1e-4)
    assert base.config.parallel.sequence_parallel and base.config.cluster.memory == 40 * 2**30
    hand = parcompile.compile(spec.replace("nodes = 1 }", "nodes = 1, memory = 40 GiB }")
                              + "parallel {\n tp = 8\n sequence_parallel = true\n order = \"tp-cp-ep-dp-pp\"\n}\n"
                              + "train { lr = 0.0001 }\n", overrides={"model.seq_len": 4096})
    assert base.to_json() == hand.to_json()
    # None removes a key: the default (tp = 1) as if never written
    assert parcompile.compile(LLAMA8B, overrides={"parallel.tp": None}).degrees["tp"] == 1


@pytest.mark.parametrize("overrides, where, message", [
    ({"parallel.tp": 3}, "<override parallel.tp>:1:17", "tp = 3 does not divide heads = 32"),
    ({"parallel.tpp": 2}, "<override parallel.tpp>:1:12", "unknown key `tpp` in `parallel`"),
    ({"tp": 2}, "<override tp>:1:1", "override `tp` is not `block.key`"),
    ({"paralel.tp": 2}, "<override paralel.tp>:1:1", "unknown block `paralel`"),
    ({"parallel.tp": "4, pp = 1"}, "<override parallel.tp>:1:17", "must be one value"),
    ({"parallel.tp": {"x": 1}}, "<override parallel.tp>:1:1", "a dict cannot be written in a spec"),
    ({"cluster.memory": 80}, "<override cluster.memory>:1:20", "missing unit"),
    ({"serve.batch": 2}, "<override serve.batch>:1:9", "adds a `serve` block, but the spec has a `train` block"),
])
def test_a_bad_override_is_a_diagnostic_at_the_override(overrides, where, message):
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(LLAMA8B, overrides=overrides)
    rendered = str(e.value)
    first = next(d for d in e.value.diagnostics if d.span.file.startswith("<override"))
    assert f"{first.span.file}:{first.span.line}:{first.span.column}" == where
    assert message in first.message
    # the excerpt is the override's own line, with the caret under its value or key
    lines = rendered.splitlines()
    at = lines.index(next(x for x in lines if x.startswith(where)))
    assert lines[at + 1].startswith(tuple(overrides)[0].split(".")[0]), rendered
    assert lines[at + 2].index("^") == first.span.column - 1


def test_api_argument_errors_are_type_errors():
    with pytest.raises(TypeError, match="pass overrides by keyword"):
        parcompile.compile(LLAMA8B, {"parallel.tp": 4})
    with pytest.raises(TypeError, match="overrides must be a mapping"):
        parcompile.compile(LLAMA8B, overrides=[("parallel.tp", 4)])
    with pytest.raises(TypeError, match="compiled Plan"):
        parcompile.export(LLAMA8B, "megatron")


def test_plan_write_is_compile_o_byte_for_byte(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["compile", "examples/tiny.par", "-o", str(tmp_path / "cli")]) == 0
    written = parcompile.compile(Path("examples/tiny.par")).write(tmp_path / "api")
    names = sorted(p.relative_to(tmp_path / "cli").as_posix() for p in (tmp_path / "cli").rglob("*") if p.is_file())
    assert written == names and "program.py" in names and "plan.json" in names
    for name in names:
        a, b = tmp_path / "cli" / name, tmp_path / "api" / name
        assert a.read_bytes() == b.read_bytes(), name
        assert a.stat().st_mode == b.stat().st_mode, name
    assert f"({', '.join(names)})" in capsys.readouterr().out


def test_plan_write_replaces_an_earlier_plans_files_but_not_a_users(tmp_path):
    from tests.serve_utils import serve_config

    from parcompile.driver import compile_config

    train, serve = parcompile.compile(TINY), compile_config(serve_config())
    train.write(tmp_path / "out")
    serve.write(tmp_path / "out")           # an earlier compile's program.py goes: the directory is a plan's
    assert "program.py" not in os.listdir(tmp_path / "out") and "serve.py" in os.listdir(tmp_path / "out")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "program.py").write_text("a user's own program")
    serve.write(mine)                       # a directory parcompile never wrote keeps its files
    assert (mine / "program.py").read_text() == "a user's own program" and (mine / "serve.py").is_file()


def test_typed_plan_fields_are_plan_json():
    plan = parcompile.compile(TINY)
    assert isinstance(plan.typed, PlanJSON)
    assert plan.memory.peak == plan.data["memory"]["peak"]
    assert plan.estimate.step_time == plan.data["estimate"]["step_time"]
    assert plan.memory.per_stage[1].total == plan.data["memory"]["per_stage"][1]["total"]
    assert plan.typed.degrees.tp == plan.degrees["tp"] == 2
    assert plan.serve is None and plan.workload == "train"
    # every section of plan.json is an attribute, but the two older names (degrees, search)
    shadowed = {"degrees", "search"}
    for name in PlanJSON.model_fields:
        if name in shadowed:
            continue
        assert getattr(plan, name) == getattr(plan.typed, name), name


def test_search_report_ranks_typed_candidates():
    report = parcompile.search(LLAMA8B, top=3, overrides={"parallel.tp": "auto", "parallel.pp": "auto"})
    assert len(report.candidates) == 3
    times = [c.step_time for c in report.candidates]
    assert times == sorted(times) and all(c.fits for c in report.candidates)
    assert report.best.parallel.tp * report.best.parallel.pp * report.best.parallel.dp == 16
    # the best layout compiled as a spec gives the candidate's estimate
    best = parcompile.compile(LLAMA8B, overrides={"parallel.tp": report.best.parallel.tp,
                                                  "parallel.pp": report.best.parallel.pp,
                                                  "parallel.sequence_parallel": report.best.parallel.sequence_parallel})
    assert best.estimate.step_time == pytest.approx(report.best.step_time, rel=1e-6)
    assert report.text().splitlines()[3].split()[1] == report.best.degrees_text().split()[0]


def test_search_with_no_fitting_layout_raises_with_the_closest():
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.search(LLAMA8B, overrides={"parallel.tp": "auto", "cluster.memory": "1 GiB"})
    assert e.value.diagnostics[-1].code == "does-not-fit"


def test_export_api_is_the_cli_export(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(Path("examples/llama3_70b_8x8_h100.par"))
    assert main(["export", "examples/llama3_70b_8x8_h100.par", "--to", "torchtitan"]) == 0
    assert capsys.readouterr().out == parcompile.export(plan, "torchtitan").text


def test_search_verify_export_are_functions_whatever_was_imported():
    """`import parcompile` loads no torch or pydantic; the modules that implement search,
    verify and export have names of their own, so importing them (as the driver and the
    CLI do) leaves ``parcompile.search`` etc. the API functions, with their signatures."""
    code = (
        "import sys, inspect\n"
        "import parcompile\n"
        "assert not {'torch', 'pydantic'} & set(sys.modules), sorted(sys.modules)\n"
        "import parcompile.exporters, parcompile.layout_search, parcompile.verification\n"
        "from parcompile.exporters import TARGETS\n"
        "assert inspect.isfunction(parcompile.export) and inspect.isfunction(parcompile.search)\n"
        "assert inspect.isfunction(parcompile.verify)\n"
        "assert list(inspect.signature(parcompile.export).parameters) == ['plan', 'target', 'torchtitan_version']\n"
        "import parcompile.api as api\n"
        "for name in ('search', 'verify', 'export'):\n"
        "    assert inspect.signature(getattr(parcompile, name)).parameters.keys() == "
        "inspect.signature(getattr(api, name)).parameters.keys(), name\n"
        "print(type(parcompile.export).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "function"
    # in this process the driver imported the layout search long before anyone called it
    assert callable(parcompile.search) and callable(parcompile.verify)
    assert parcompile.export(parcompile.compile(TINY), "megatron").target == "megatron"


def test_load_plan_reads_plan_json_typed(tmp_path):
    plan = parcompile.compile(TINY)
    plan.write(tmp_path)
    loaded = parcompile.load_plan(tmp_path / "plan.json")
    assert loaded == plan.typed and parcompile.load_plan(tmp_path).memory.peak == plan.memory.peak
    (tmp_path / "bad.json").write_text(json.dumps({"format": "parcompile.plan/1", "memory": {}}))
    with pytest.raises(parcompile.PlanFileError, match="schema"):
        parcompile.load_plan(tmp_path / "bad.json")


# --------------------------------------------------------------------------------------
# verify: the report of a real miniature run (batched with the other 2-rank verify cases)

from tests.verify_batch import result_of, verify_fixture  # noqa: E402

#: the tiny example on 2 ranks (tp 2), through overrides; its data is read (builtin:pydoc)
VERIFY_OVERRIDES = {"cluster.gpus_per_node": 2, "parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 1,
                    "parallel.global_batch": 8}


def _build(test: str, case: str) -> tuple:
    return parcompile.compile(TINY, overrides=VERIFY_OVERRIDES).config, "fp32"


verified = verify_fixture(__name__, _build)


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["tiny_tp2"])
def test_verify_report_and_the_cli_print_the_run(case, verified, request, monkeypatch, capsys):
    """parcompile.verify compiles with the overrides, reads the data, runs verify on that
    config and reports its rows; the CLI prints the report. The run itself is the batched
    one of the same config (verify.verify_many builds it as verify.verify does)."""
    result = result_of(verified, request, case)
    calls = []

    def run(cfg, steps, dtype, timeout_s):
        calls.append((cfg, steps, dtype))
        return result

    monkeypatch.setattr("parcompile.verification.verify", run)
    report = parcompile.verify(TINY, overrides=VERIFY_OVERRIDES)
    assert calls == [(_build("", case)[0], 3, "fp32")]
    assert report.passed and report.rows == result.checks and len(report.losses) == 3
    assert report.plan.world_size == 2
    text = report.text()
    assert result.table() in text and text.endswith("verify: passed\n")
    assert text.startswith("miniature: ") and "dp 1 x tp 2 x pp 1" in text
    monkeypatch.chdir(REPO)
    assert main(["verify", "examples/tiny.par"]) == 0     # the CLI prints the API's report
    assert capsys.readouterr().out == parcompile.verify(TINY, overrides=None).text()
