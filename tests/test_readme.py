"""The README a newcomer reads (issue 47): its commands are the ones CI and the CLI have.

The commands are found in the README's code blocks by what they start with (grep), never
copied here: the test command is the one `.ci/run` runs, the fast subset's marker is
registered and names the torchrun tests, every quick-reference command is a subcommand of
the parser, every example a command names exists, the lm-eval line passes the server's
context (`max_length`), and every relative link leads to a file. (The two "Train, then
serve" commands are run by tests/test_serve.py test_readme_train_then_serve.)"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from parcompile.cli import make_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _code_lines() -> list[str]:
    """Every line of the README's ``` blocks, continuation lines joined."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README, re.S)
    return [line.strip() for b in blocks for line in b.replace("\\\n", " ").splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command():
    [test] = [line for line in _code_lines() if "python -m pytest" in line]
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines(), "`.ci/run` must run the README's test command verbatim"
    pytest_args = shlex.split(test.split("python -m pytest", 1)[1])
    assert "-m" not in pytest_args and "-k" not in pytest_args   # CI runs everything, not the fast subset


def test_the_fast_subset_is_a_registered_marker_that_leaves_out_the_launches():
    assert 'python -m pytest -q -m "not slow"' in README
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)
    assert re.search(r"about \d+ minutes on a quiet 2-core machine", README)   # how long the whole suite takes
    conftest = (REPO / "tests" / "conftest.py").read_text()
    assert 'get_closest_marker("torchrun")' in conftest and "pytest.mark.slow" in conftest


def test_torchrun_tests_are_slow(pytester):
    """conftest's rule, on a suite of two tests: the torchrun one is deselected by -m "not slow"."""
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    torchrun: x\n    slow: y\n")
    pytester.makepyfile("import pytest\n\n@pytest.mark.torchrun\ndef test_launch():\n    pass\n\n"
                        "def test_quick():\n    pass\n")
    result = pytester.runpytest("-m", "not slow", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=1)


def test_quick_reference_commands_exist_and_examples_are_there():
    sub = next(a for a in make_parser()._actions if a.dest == "command").choices
    rows = re.findall(r"^\| `parcompile ([a-z-]+)[^`]*` \|", README, re.M)
    assert len(rows) >= 10 and set(rows) <= set(sub), set(rows) - set(sub)
    assert set(sub) - set(rows) <= {"schema", "check", "plan", "compile", "run", "serve", "verify", "search", "export",
                                    "export-weights", "diff"} and "serve" in rows
    for path in re.findall(r"\b(examples/[\w./-]+\.(?:par|py))", README):
        assert (REPO / path).is_file(), path


def test_lm_eval_passes_the_servers_context():
    [line] = [line for line in _code_lines() if line.startswith("lm-eval ")]
    assert "max_length=" in line and "local-completions" in line


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README))))
def test_links_lead_to_files(link):
    assert (REPO / link).exists(), link
