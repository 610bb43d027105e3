"""docs/language.md, the user's reference, stays true to the compiler.

- every key the checker knows (``KEYS`` in parcompile/frontend/build.py) has a row in the
  table of its block's section, and no row documents a key the checker does not know;
- every preset and unit the compiler knows is named;
- every ```par block compiles (``parcompile.compile``), and every ```par error: MESSAGE
  block is rejected with an error whose message starts with MESSAGE.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import parcompile
from parcompile.frontend.build import KEYS
from parcompile.config.presets import CLUSTER_PRESET_NAMES, MODEL_PRESET_NAMES
from parcompile.config.units import UNITS
from parcompile.diagnostics import SpecError

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "language.md"
TEXT = DOC.read_text(encoding="utf-8")

_FENCE = re.compile(r"^```par(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
BLOCKS = [(m.group("info").strip(), m.group("body"), TEXT[:m.start()].count("\n") + 1)
          for m in _FENCE.finditer(TEXT)]


def section(kind: str) -> str:
    """The text of the section headed ``## `KIND` `` (up to the next ``## ``)."""
    m = re.search(rf"^## `{kind}`\n(.*?)(?=^## )", TEXT + "\n## end\n", re.M | re.S)
    assert m, f"docs/language.md has no section `## `{kind}``"
    return m.group(1)


def documented_keys(kind: str) -> set[str]:
    """Keys in the first column of the tables of ``kind``'s section (``| `key` |``)."""
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", section(kind), re.M))


@pytest.mark.parametrize("kind", list(KEYS))
def test_every_key_the_checker_knows_is_documented(kind):
    missing = sorted(set(KEYS[kind]) - documented_keys(kind))
    assert not missing, f"docs/language.md does not document `{kind}` keys {missing}"


@pytest.mark.parametrize("kind", list(KEYS))
def test_no_documented_key_is_unknown_to_the_checker(kind):
    stale = sorted(documented_keys(kind) - set(KEYS[kind]))
    assert not stale, f"docs/language.md documents `{kind}` keys the checker rejects: {stale}"


def test_presets_and_units_are_named():
    for name in MODEL_PRESET_NAMES + CLUSTER_PRESET_NAMES:
        assert f"`{name}`" in TEXT, name
    units = section("units") if "## `units`" in TEXT else TEXT[TEXT.index("## Units"):TEXT.index("## `model`")]
    for unit in UNITS:
        assert re.search(rf"[` ]{re.escape(unit)}[` ]", units), unit


def test_the_doc_has_examples_of_both_kinds():
    assert sum(1 for info, _, _ in BLOCKS if not info) >= 6
    assert sum(1 for info, _, _ in BLOCKS if info.startswith("error:")) >= 6
    assert all(info == "" or info.startswith("error:") for info, _, _ in BLOCKS)


@pytest.mark.parametrize("info, body, line", BLOCKS, ids=[f"line{line}" for _, _, line in BLOCKS])
def test_example_compiles_or_fails_as_documented(info, body, line):
    name = f"language.md:{line}"
    if not info:
        try:
            plan = parcompile.compile(body, filename=name)
        except SpecError as e:
            pytest.fail(f"the example at docs/language.md line {line} does not compile:\n{e}")
        assert plan.data["world_size"] >= 1
        return
    expected = info[len("error:"):].strip()
    with pytest.raises(SpecError) as e:
        parcompile.compile(body, filename=name)
    errors = [d.message for d in e.value.diagnostics if d.severity == "error"]
    assert any(m.startswith(expected) for m in errors), (
        f"the error example at docs/language.md line {line} expects {expected!r}, got {errors}")
