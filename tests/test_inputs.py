"""Hostile and careless inputs (issue 30, "Signals and inputs"): many diagnostics stay
linear and capped, files that are no regular files are named for what they are and never
read, an unclosed `{` is pointed at, `seq_len` beyond an imported context is warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from parcompile import api
from parcompile.cli import main
from parcompile.diagnostics import SHOWN, Diagnostic, Span, SpecError, render_all

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "examples" / "tiny.par").read_text()


def _with_unknown_keys(n: int) -> str:
    extra = "".join(f"    zz_unknown_{i} = 1\n" for i in range(n))
    return TINY.replace("    optimizer = adamw\n", "    optimizer = adamw\n" + extra)


class _CountingText(str):
    """Spec text that counts how often it is split into lines."""

    splits = 0

    def splitlines(self, *args, **kwargs):
        type(self).splits += 1
        return super().splitlines(*args, **kwargs)


def test_rendering_many_diagnostics_splits_the_source_once():
    # was: each diagnostic split the whole text again (and SpecError rendered them all when
    # raised): 16,000 unknown keys took 13 s, 100,000 did not finish in 9 minutes
    n = 2000
    text = _CountingText("".join(f"k{i} = 1\n" for i in range(n)))
    diags = [Diagnostic("error", f"unknown key `k{i}`", Span("a.par", i + 1, 1, i + 1, 3)) for i in range(n)]
    _CountingText.splits = 0
    err = SpecError(diags, text)
    assert _CountingText.splits == 0          # nothing rendered on raise
    out = render_all(err.diagnostics, text)
    assert _CountingText.splits == 1
    assert out.count("error: unknown key") == n and f"k{n - 1} = 1\n^^" in out


def test_many_unknown_keys_are_all_found_and_the_cli_prints_a_capped_list(capsys, tmp_path):
    n = 3000
    with pytest.raises(SpecError) as e:
        api.compile(_with_unknown_keys(n), "big.par")
    assert sum("unknown key `zz_unknown_" in d.message for d in e.value.diagnostics) == n
    spec = tmp_path / "big.par"
    spec.write_text(_with_unknown_keys(n))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.count(": error: unknown key `zz_unknown_") == SHOWN
    assert err.rstrip().splitlines()[-1] == (f"... and {n - SHOWN:,} more ({n - SHOWN:,} errors); "
                                             f"fix the ones above and check again")
    # JSON lists every one (editors and CI filter it themselves)
    assert main(["check", str(spec), "--format", "json"]) == 1
    assert capsys.readouterr().out.count('"unknown key `zz_unknown_') == n
