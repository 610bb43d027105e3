"""parcompile.testing: the golden-plan helper, its update switches and the pytest plugin's
`parcompile_golden` fixture, as a user's test suite runs them (pytester)."""

from __future__ import annotations

from pathlib import Path

import pytest

import parcompile
import parcompile.plandiff  # noqa: F401 - loaded before pytester's inner runs, which unload what they import
from parcompile.testing import UPDATE_ENV, GoldenMismatch, assert_plan_matches, assert_text_matches

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny.par"
#: tiny at tp 1 (dp 4 keeps its 8 ranks): a layout change
TP1 = {"parallel.tp": 1, "parallel.dp": 4}


def test_missing_golden_fails_and_the_update_switches_write_it(tmp_path, monkeypatch):
    golden = tmp_path / "g" / "tiny.plan.json"
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    with pytest.raises(GoldenMismatch, match="missing"):
        assert_plan_matches(TINY, golden)
    assert not golden.exists()
    plan = assert_plan_matches(TINY, golden, update=True)
    assert golden.read_text() == plan.to_json()
    assert_plan_matches(TINY, golden)                      # holds
    monkeypatch.setenv(UPDATE_ENV, "1")                    # the environment switch rewrites it
    assert_plan_matches(TINY, golden, overrides=TP1)
    assert golden.read_text() == parcompile.compile(TINY, overrides=TP1).to_json()


def test_a_mismatch_says_what_changed_with_parcompile_diff(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    golden = tmp_path / "tiny.plan.json"
    golden.write_text(parcompile.compile(TINY).to_json())
    with pytest.raises(GoldenMismatch) as e:
        assert_plan_matches(TINY, golden, overrides=TP1)
    msg = str(e.value)
    assert msg.startswith(f"the plan of tiny.par differs from its golden {golden}")
    rows = [ln.split() for ln in msg.splitlines()]
    assert ["tp", "2", "->", "1", "-50.0%"] in rows and ["dp", "2", "->", "4", "+100.0%"] in rows
    assert any(r and r[0] == "peak" for r in rows)   # memory named
    assert "--update-goldens" in msg and UPDATE_ENV in msg


def test_bytes_that_differ_outside_the_compared_figures_show_a_text_diff(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    text = parcompile.compile(TINY).to_json()
    golden = tmp_path / "tiny.plan.json"
    golden.write_text(text.replace('"op": "forward"', '"op": "backward"', 1))   # a schedule action
    with pytest.raises(GoldenMismatch) as e:
        assert_plan_matches(TINY, golden)
    msg = str(e.value)
    assert "no changes" in msg and "plan.json differs elsewhere" in msg
    lines = [ln.replace(" ", "") for ln in msg.splitlines()]
    assert '-"op":"backward"' in lines and '+"op":"forward"' in lines


def test_text_goldens(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    golden = tmp_path / "graph.txt"
    assert_text_matches("a\nb\n", golden, update=True)
    assert_text_matches("a\nb\n", golden)
    with pytest.raises(GoldenMismatch, match=r"(?s)graph.txt differs.*-b\n\+c"):
        assert_text_matches("a\nc\n", golden)


USER_TEST = f'''
from pathlib import Path

def test_layout(parcompile_golden):
    parcompile_golden(Path({str(TINY)!r}), Path("golden") / "tiny.plan.json", overrides={TP1!r})
'''


def test_the_pytest_plugin_fixture_as_a_user_runs_it(pytester, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")   # only the plugin under test
    parcompile.compile(TINY, overrides=TP1)   # the compiler loaded here stays loaded across the inner runs
    pytester.makepyfile(test_user=USER_TEST)
    golden = pytester.path / "golden" / "tiny.plan.json"
    result = pytester.runpytest_inprocess("-p", "parcompile.testing")
    result.assert_outcomes(failed=1)
    assert "golden plan golden/tiny.plan.json is missing" in result.stdout.str()
    assert "During handling of the above exception" not in result.stdout.str()
    result = pytester.runpytest_inprocess("-p", "parcompile.testing", "--update-goldens")
    result.assert_outcomes(passed=1)
    assert golden.read_text() == parcompile.compile(TINY, overrides=TP1).to_json()
    golden.write_text(parcompile.compile(TINY).to_json())     # the layout the golden holds changed
    result = pytester.runpytest_inprocess("-p", "parcompile.testing")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "differs from its golden golden/tiny.plan.json" in out and "parcompile diff" in out
    assert "def test_layout" not in out    # failed with the diff, not a traceback
    pytester.makepyfile(test_user=USER_TEST.replace(repr(TP1), repr({"parallel.tp": 3})))   # a bad override
    result = pytester.runpytest_inprocess("-p", "parcompile.testing")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "<override parallel.tp>:1:" in out and "error: tp = 3" in out
    assert "def test_layout" not in out and "raise_if_errors" not in out   # the diagnostics, no traceback
