"""Golden plans in tests: hold a spec's plan.json against a file kept in the repository.

Goldens show change, not truth: a golden test fails when a spec, an override or a new
parcompile version changes the plan, and says what changed with ``parcompile diff``
(degrees, memory per stage, collectives, the estimate) rather than a raw JSON diff.
When the change is intended, rewrite the goldens with the update switch and review the
diff of the files in the commit.

In any test::

    from parcompile.testing import assert_plan_matches

    def test_llama_layout():
        assert_plan_matches(Path("specs/llama.par"), Path("tests/golden/llama.plan.json"),
                            overrides={"parallel.tp": 4})

As a pytest plugin (``pytest -p parcompile.testing``, or ``pytest_plugins =
["parcompile.testing"]`` in a ``conftest.py``), the ``parcompile_golden`` fixture does the
same and reports a mismatch without a traceback::

    def test_llama_layout(parcompile_golden):
        parcompile_golden(Path("specs/llama.par"), Path("tests/golden/llama.plan.json"))

The update switch: ``pytest --update-goldens`` (the plugin's option) or the environment
variable ``PARCOMPILE_UPDATE_GOLDENS=1`` writes the goldens instead of comparing (each
file atomically: written beside and renamed into place). A missing golden fails, so a
golden test cannot pass by having nothing to compare with.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

__all__ = ["UPDATE_ENV", "assert_plan_matches", "assert_text_matches", "update_requested", "GoldenMismatch"]

#: the environment variable that switches golden helpers to writing the goldens
UPDATE_ENV = "PARCOMPILE_UPDATE_GOLDENS"
#: the pytest option the plugin adds (shared with a conftest or plugin that already adds it)
UPDATE_OPTION = "--update-goldens"


class GoldenMismatch(AssertionError):
    """Output differs from its golden file, or the golden file is missing."""


def update_requested(update: bool | None = None) -> bool:
    """Whether golden helpers write instead of compare: ``update`` when given, else the
    environment variable :data:`UPDATE_ENV` set to anything but ``""``, ``0``, ``false``, ``no``."""
    if update is not None:
        return bool(update)
    return os.environ.get(UPDATE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the old file or the new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _how_to_update(path: Path) -> str:
    return (f"if the change is intended, rewrite the golden ({path}) with `pytest {UPDATE_OPTION}` "
            f"(plugin parcompile.testing) or {UPDATE_ENV}=1, and review the diff")


def _first_lines_differing(old: str, new: str, limit: int = 40) -> str:
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "golden", "now", n=1, lineterm=""))
    more = f"\n... ({len(lines) - limit} more diff lines)" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


def assert_text_matches(text: str, golden: str | os.PathLike, *, update: bool | None = None,
                        what: str | None = None) -> None:
    """Hold ``text`` against the file ``golden`` (or write it there when updating,
    :func:`update_requested`); on a mismatch, the first lines of a unified diff.

    Raises:
        GoldenMismatch: the golden is missing, or differs (an AssertionError).
    """
    path = Path(golden)
    if update_requested(update):
        _write(path, text)
        return
    name = what or path.name
    if not path.is_file():
        raise GoldenMismatch(f"golden file {path} is missing; {_how_to_update(path)}")
    old = path.read_text(encoding="utf-8")
    if old != text:
        raise GoldenMismatch(f"{name} differs from its golden {path}:\n{_first_lines_differing(old, text)}\n"
                             f"{_how_to_update(path)}")


def assert_plan_matches(spec: Any, golden: str | os.PathLike, *, overrides: Mapping[str, Any] | None = None,
                        filename: str | None = None, update: bool | None = None):
    """Compile ``spec`` (a :class:`pathlib.Path` or spec text, with ``overrides``, as
    :func:`parcompile.compile` takes them; or a :class:`~parcompile.plan.Plan` already
    compiled) and hold its plan.json against the file ``golden``, byte for byte.

    On a mismatch the message is ``parcompile diff GOLDEN NOW`` (what changed in degrees,
    groups, stages, memory per stage, collectives and the estimate), and, when the diff
    compares nothing that changed (schedule actions, rank lists, a key it does not read),
    the first lines that differ. With the update switch (:func:`update_requested`) the
    golden is written instead.

    Returns:
        the plan, for further checks.

    Raises:
        GoldenMismatch: the golden is missing or differs (an AssertionError).
        SpecError: the spec has errors.
    """
    import json

    from parcompile.api import compile as compile_spec
    from parcompile.plan import Plan
    from parcompile.plandiff import PlanDiff, diff_plans

    plan = spec if isinstance(spec, Plan) else compile_spec(spec, filename, overrides=overrides)
    text = plan.to_json()
    path = Path(golden)
    if update_requested(update):
        _write(path, text)
        return plan
    if not path.is_file():
        raise GoldenMismatch(f"golden plan {path} is missing; {_how_to_update(path)}")
    old = path.read_text(encoding="utf-8")
    if old == text:
        return plan
    try:
        old_data = json.loads(old)
    except json.JSONDecodeError:
        old_data = None
    if not isinstance(old_data, dict):
        raise GoldenMismatch(f"golden plan {path} is not a plan.json; {_how_to_update(path)}")
    d = PlanDiff(old_data, plan.data, diff_plans(old_data, plan.data), str(path), "now")
    body = d.text()
    if not d.changed:
        body += ("the compared figures are equal; plan.json differs elsewhere:\n"
                 + _first_lines_differing(old, text) + "\n")
    raise GoldenMismatch(f"the plan of {getattr(spec, 'name', None) or plan.config.filename} differs from its "
                         f"golden {path}:\n{body}{_how_to_update(path)}")


# --------------------------------------------------------------------------------------
# The pytest plugin: `pytest -p parcompile.testing` or `pytest_plugins = ["parcompile.testing"]`


def pytest_addoption(parser) -> None:
    """``--update-goldens``; a conftest or another plugin that already adds it is reused."""
    try:
        parser.addoption(UPDATE_OPTION, action="store_true", default=False,
                         help=f"rewrite golden files instead of comparing (also: {UPDATE_ENV}=1)")
    except ValueError:   # already added (pytest-golden, a project's conftest): same meaning
        pass


class GoldenPlans:
    """The ``parcompile_golden`` fixture: ``parcompile_golden(spec, golden, overrides=...)``
    is :func:`assert_plan_matches` with the run's update switch, failing the test with
    the diff (or the spec's diagnostics) and no traceback; ``parcompile_golden.text(text, golden)`` holds any text."""

    def __init__(self, update: bool):
        self.update = update

    def __call__(self, spec: Any, golden: str | os.PathLike, *, overrides: Mapping[str, Any] | None = None,
                 filename: str | None = None):
        import pytest

        from parcompile.diagnostics import SpecError

        try:
            return assert_plan_matches(spec, golden, overrides=overrides, filename=filename, update=self.update)
        except (GoldenMismatch, SpecError) as e:
            message = str(e)     # failed outside the handler: no "during handling of ..." chain
        pytest.fail(message, pytrace=False)

    def text(self, text: str, golden: str | os.PathLike, what: str | None = None) -> None:
        import pytest

        try:
            assert_text_matches(text, golden, update=self.update, what=what)
            return
        except GoldenMismatch as e:
            message = str(e)
        pytest.fail(message, pytrace=False)


def _update_switch(config) -> bool:
    try:
        option = bool(config.getoption(UPDATE_OPTION))
    except ValueError:   # the plugin's option is not registered (fixture used without the plugin)
        option = False
    return option or update_requested()


try:   # the fixture exists only where pytest does; the helpers above need no pytest
    import pytest as _pytest
except ImportError:  # pragma: no cover - pytest is not installed
    pass
else:
    @_pytest.fixture
    def parcompile_golden(request) -> GoldenPlans:
        """Hold a spec's plan against a golden plan.json (:class:`GoldenPlans`)."""
        return GoldenPlans(_update_switch(request.config))
