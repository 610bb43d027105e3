"""`parcompile compile` writes its outputs atomically (issue 3, Reliability).

A spec with errors writes nothing; a failure while writing leaves neither the output
directory nor a temporary one behind; a successful compile over an existing directory
replaces each file whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from parcompile.cli import main
from parcompile.codegen import emit

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny.par"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A scratch directory holding tiny.par, and the working directory of the test."""
    shutil.copy(TINY, tmp_path / "tiny.par")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_spec_with_errors_writes_nothing(workdir, capsys):
    (workdir / "bad.par").write_text((workdir / "tiny.par").read_text().replace("tp = 2", "tp = 3"))
    assert main(["compile", "bad.par"]) == 1
    assert "error: tp = 3 does not divide" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.iterdir()) == ["bad.par", "tiny.par"]  # no build/
    assert main(["compile", "bad.par", "-o", "out/deep"]) == 1
    assert not (workdir / "out").exists()


def test_failure_while_writing_leaves_no_directory(workdir, monkeypatch, capsys):
    real = Path.write_text
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    assert main(["compile", "tiny.par", "-o", "build/tiny"]) == 2  # a usage error, no traceback
    assert "cannot write build/tiny/: No space left on device" in capsys.readouterr().err
    assert len(calls) == 3
    assert list((workdir / "build").iterdir()) == []  # neither build/tiny nor a temporary sibling


def test_recompile_replaces_every_file_and_keeps_others(workdir, capsys):
    assert main(["compile", "tiny.par", "-o", "build/tiny"]) == 0
    out = workdir / "build" / "tiny"
    first = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}   # k8s/ is a directory
    assert {"plan.json", "report.md", "graph.txt", "program.py", "launch.sh"} <= set(first)
    (out / "plan.json").write_text("stale")
    (out / "metrics.json").write_text("a run's output")
    assert main(["compile", "tiny.par", "-o", "build/tiny"]) == 0
    assert (out / "plan.json").read_text() == first["plan.json"]
    assert (out / "metrics.json").read_text() == "a run's output"
    assert sorted(p.name for p in (workdir / "build").iterdir()) == ["tiny"]  # no temporary left
    assert (out / "launch.sh").stat().st_mode & 0o111


def test_write_files_is_one_rename_for_a_new_directory(tmp_path, monkeypatch):
    renames = []
    real = emit.os.rename
    monkeypatch.setattr(emit.os, "rename", lambda a, b: (renames.append((a, b)), real(a, b)))
    emit.write_files(tmp_path / "new", {"a.txt": "1", "b.txt": "2"})
    assert len(renames) == 1 and sorted(p.name for p in (tmp_path / "new").iterdir()) == ["a.txt", "b.txt"]


def test_odd_spec_names_do_not_escape_build(workdir):
    (workdir / "...par").write_text((workdir / "tiny.par").read_text())  # stem ".."
    assert main(["compile", "...par"]) == 0
    assert (workdir / "build" / "spec" / "plan.json").exists()
    assert not (workdir / "plan.json").exists()
