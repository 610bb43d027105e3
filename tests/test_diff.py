"""`parcompile diff OLD NEW` (parcompile/plandiff.py): two plans of the 70B example that
differ in tp; what it names, its formats, --fail-on exit statuses and bad usage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main
from parcompile.plandiff import BoundError, check_bound, parse_bound

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "examples" / "llama3_70b_8x8_h100.par"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """plan.json files of the 70B example at tp 8 (as written) and tp 4 (dp auto: 4)."""
    d = tmp_path_factory.mktemp("diff")
    old, new = parcompile.compile(SPEC), parcompile.compile(SPEC, overrides={"parallel.tp": 4})
    (d / "old.json").write_text(old.to_json())
    (d / "new.json").write_text(new.to_json())
    return d / "old.json", d / "new.json", old.data, new.data


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_diff_names_degrees_memory_per_stage_and_estimate(plans, capsys):
    old_path, new_path, old, new = plans
    code, out, _ = _run(capsys, old_path, new_path)
    assert code == 0
    lines = out.splitlines()
    section = {}
    for ln in lines:
        if ln and not ln.startswith(" "):
            current = ln.split(" (")[0]
        elif ln.strip():
            section.setdefault(current, []).append(ln.split())
    assert ["tp", "8", "->", "4", "-50.0%"] in section["degrees"]
    assert ["dp", "2", "->", "4", "+100.0%"] in section["degrees"]
    assert ["tp", "8", "x", "8", "ranks", "->", "16", "x", "4", "ranks"] in section["groups"]
    # memory per stage: every stage's total, in the plans' own bytes
    for s, (o, n) in enumerate(zip(old["memory"]["per_stage"], new["memory"]["per_stage"])):
        row = next(r for r in section["memory"] if r[:3] == ["stage", str(s), "total"])
        assert row[3:5] == [f"{o['total'] / 2**30:.2f}", "GiB"] and row[6:8] == [f"{n['total'] / 2**30:.2f}", "GiB"]
    step = next(r for r in section["estimate"] if r[0] == "step_time")
    assert step[1] == f"{old['estimate']['step_time']:.4g}" and step[4] == f"{new['estimate']['step_time']:.4g}"
    # collectives: runs of tp all-gathers per step, summed from the plans' rows
    runs = [sum(c["count"] for c in p["comm"]["collectives"] if (c["op"], c["axis"]) == ("all_gather", "tp"))
            for p in (old, new)]
    row = next(r for r in section["collectives"] if r[:3] == ["all_gather", "tp", "runs"])
    assert row[3] == f"{runs[0]:,}" and row[5] == f"{runs[1]:,}"


def test_fail_on_exits_1_when_crossed_0_otherwise(plans, capsys):
    old_path, new_path, old, new = plans
    rise = new["memory"]["peak"] / old["memory"]["peak"] - 1     # about +52%
    code, out, _ = _run(capsys, old_path, new_path, "--fail-on", f"peak_memory=+{rise * 100 - 1:.0f}%")
    assert code == 1 and f"fail-on peak_memory=+{rise * 100 - 1:.0f}%: CROSSED" in out
    code, out, _ = _run(capsys, old_path, new_path, "--fail-on", f"peak_memory=+{rise * 100 + 1:.0f}%",
                        "--fail-on", "step_time=+2%", "--fail-on", "degrees.pp")
    assert code == 0 and "CROSSED" not in out
    # the step got faster: a fall bound on it is crossed, a rise bound is not
    assert _run(capsys, old_path, new_path, "--fail-on", "step_time=-5%")[0] == 1
    assert _run(capsys, old_path, new_path, "--fail-on", "peak_memory=+20GiB")[0] == 0
    assert _run(capsys, old_path, new_path, "--fail-on", "peak_memory=+10GiB")[0] == 1
    assert _run(capsys, old_path, new_path, "--fail-on", "degrees")[0] == 1
    assert _run(capsys, old_path, old_path, "--fail-on", "degrees", "--fail-on", "peak_memory=+0%")[0] == 0


def test_markdown_and_json_formats(plans, capsys):
    old_path, new_path, old, new = plans
    code, md, _ = _run(capsys, old_path, new_path, "--format", "markdown", "--fail-on", "peak_memory=+5%")
    assert code == 1
    assert "| `peak_memory=+5%` | **crossed** |" in md and "| tp | 8 | 4 | -50.0% |" in md
    code, text, _ = _run(capsys, old_path, new_path, "--format", "json", "--fail-on", "step_time=+2%")
    doc = json.loads(text)
    assert code == 0 and doc["failed"] is False and doc["changed"] is True
    by_path = {c["path"]: c for c in doc["changes"]}
    assert by_path["degrees.tp"]["old"] == 8 and by_path["degrees.tp"]["new"] == 4
    assert by_path["memory.per_stage.0.total"]["new"] == new["memory"]["per_stage"][0]["total"]
    assert by_path["estimate.step_time"]["relative"] == pytest.approx(
        new["estimate"]["step_time"] / old["estimate"]["step_time"] - 1)


def test_a_spec_and_its_plan_json_diff_to_nothing(plans, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    old_path = plans[0]
    code, out, _ = _run(capsys, "examples/llama3_70b_8x8_h100.par", old_path)
    assert code == 0 and "no changes" in out


@pytest.mark.parametrize("argv, message", [
    (["--fail-on", "peak_memory=+5s"], "`peak_memory` is a memory size, `s` is a time"),
    (["--fail-on", "peak_memory=lots"], "the bound is +N%"),
    (["--fail-on", "no.such.metric=+5%"], "neither plan has `no.such.metric`"),
    (["--fail-on", "degrees=+5%"], "is not a number"),
    (["--format", "yaml"], "invalid choice"),
])
def test_bad_usage_exits_2_with_a_message(plans, capsys, argv, message):
    code, _, err = _run(capsys, plans[0], plans[1], *argv)
    assert code == 2 and message in err, err


def test_files_that_are_not_plans_are_usage_errors(plans, capsys, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    (tmp_path / "broken.json").write_text("{")
    assert _run(capsys, plans[0], tmp_path / "missing.json") == (2, "", f"parcompile: error: {tmp_path / 'missing.json'}: no such file\n")
    code, _, err = _run(capsys, tmp_path / "x.json", plans[0])
    assert code == 2 and "not a parcompile plan.json" in err
    code, _, err = _run(capsys, tmp_path / "broken.json", plans[0])
    assert code == 2 and "broken.json:1:2: not JSON" in err
    bad = tmp_path / "bad.par"
    bad.write_text("parallel { tp = 3 }\n")
    code, _, err = _run(capsys, bad, plans[0])
    assert code == 1 and "bad.par:1:1: error: missing `model` block" in err


def test_bounds_read_as_documented():
    b = parse_bound("peak_memory=+2GiB")
    assert (b.path, b.direction, b.amount, b.relative) == ("memory.peak", "+", 2 * 2**30, False)
    assert parse_bound("mfu=-2%").amount == pytest.approx(0.02) and parse_bound("mfu=-2%").relative
    assert parse_bound("step_time=3%").direction == "±" and parse_bound("degrees").direction == "any"
    assert parse_bound("step_time=+50ms").amount == pytest.approx(0.05)
    old, new = {"memory": {"peak": 100}}, {"memory": {"peak": 105}}
    assert not check_bound(parse_bound("peak_memory=+5%"), old, new).crossed    # exactly 5%: not more
    assert check_bound(parse_bound("peak_memory=+4%"), old, new).crossed
    assert check_bound(parse_bound("peak_memory=4%"), new, old).crossed          # either way
    with pytest.raises(BoundError):
        parse_bound("=+5%")


def test_damaged_plan_json_files_are_usage_errors_not_tracebacks(plans, capsys, tmp_path):
    """Before: a plan.json nested 100,000 deep was a RecursionError traceback, and one whose
    `memory` is a string (a hand-edited or damaged file) an AttributeError in the diff. Now
    each is a usage error naming the file (and the key); a plan.json that only lacks keys
    a later version added still diffs."""
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = _run(capsys, plans[0], tmp_path / "deep.json")
    assert code == 2 and "deep.json:1:1: not JSON: nested too deeply" in err, err
    data = json.loads(plans[0].read_text())
    for key, value in (("memory", "x"), ("degrees", {"tp": "a"}), ("estimate", [1])):
        (tmp_path / "bad.json").write_text(json.dumps({**data, key: value}))
        code, _, err = _run(capsys, plans[0], tmp_path / "bad.json")
        assert code == 2 and "bad.json: does not match plan.json's schema" in err and key in err, (key, err)
    older = json.loads(plans[0].read_text())
    older["memory"].pop("reserved_peak")
    (tmp_path / "older.json").write_text(json.dumps(older))
    code, out, err = _run(capsys, plans[0], tmp_path / "older.json")
    assert code == 0 and "Traceback" not in err, err


def test_float_rounding_is_no_change(plans):
    """Two plans whose times differ only in the last bits of a float (a sum taken in another
    order: pp_comm 0.0006568 s -> 0.0006568 s, "+3.47e-18 s, +0.0%") differ in nothing a
    reviewer reads; a change at the fourth significant digit still shows."""
    from parcompile.plandiff import diff_plans
    _, _, old, _ = plans
    new = json.loads(json.dumps(old))
    t = new["estimate"]["breakdown"]["pp_comm"] = old["estimate"]["breakdown"]["pp_comm"] * (1 + 4e-15)
    assert t != old["estimate"]["breakdown"]["pp_comm"] and diff_plans(old, new) == []
    new["estimate"]["breakdown"]["pp_comm"] = old["estimate"]["breakdown"]["pp_comm"] * 1.0001
    assert [c.path for c in diff_plans(old, new)] == ["estimate.breakdown.pp_comm"]
