"""Nothing typed in a spec reaches the generated program as code (issue 3, Reliability).

Names (the spec's file name becomes the program's name), data paths and checkpoint
directories flow into ``program.py`` and ``launch.sh``. Each hostile value below must give
a program that is valid Python, runs no statement of the attacker's, and keeps string
values byte for byte.
"""

from __future__ import annotations

import os

import ast
import subprocess
import warnings
from pathlib import Path

import pytest

import parcompile
from parcompile.codegen.emit import comment_text, render_launch, render_program
from tests.program_utils import assigned

REPO = Path(__file__).resolve().parent.parent
TINY = (REPO / "examples" / "tiny.par").read_text()

PAYLOAD = "__import__('os').system('echo PWNED')"
HOSTILE = [
    'a"b',
    "a'b",
    '"""; ' + PAYLOAD + '; """',
    "'''; " + PAYLOAD + "; '''",
    "x\n" + PAYLOAD + "\n",
    "x\r" + PAYLOAD,
    "x\u2028" + PAYLOAD,
    "{{ 7 * 7 }}{% raw %}",
    "\\N{BULLET}\\x00\\",
    "ünïcødé 模型 🚀",
    "$(echo PWNED)`echo PWNED`",
    "../../../etc/passwd",
]


def _spec_text(**train: str) -> str:
    """examples/tiny.par with extra `train` entries (values are already .par string literals)."""
    lines = [line for line in TINY.splitlines(keepends=True)
             if line.split("=")[0].strip() not in train]  # tiny.par's own `data` goes
    text = "".join(lines)
    extra = "".join(f"    {k} = {v}\n" for k, v in train.items())
    return text.replace("train {\n", "train {\n" + extra, 1)


def _par_string(value: str) -> str:
    """``value`` as a .par string literal (backslash escapes for `\\`, `"`, newlines)."""
    esc = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{esc}"'


def _assert_no_injection(program: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an invalid escape in a docstring is a mistake too
        compile(program, "program.py", "exec")
    tree = ast.parse(program)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "__import__"]
    assert calls == [], "an __import__ call reached program.py as code"
    # the module's docstring is one expression statement; everything typed stays inside strings
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    assert "PWNED" not in "".join(ast.unparse(n) for n in tree.body[1:] if not isinstance(n, ast.Assign))


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_spec_names_cannot_break_out_of_the_docstring(name, tmp_path):
    plan = parcompile.compile(TINY, filename=f"{name}.par")
    program = render_program(plan.config, plan, tmp_path)
    _assert_no_injection(program)
    launch = render_launch(plan.config)
    for line in launch.splitlines()[:4]:  # the comment header stays comment lines
        assert line.startswith("#")
    assert "PWNED" not in launch.split("\n", 4)[-1]
    assert comment_text(plan.config.name) in program


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_checkpoint_dir_is_kept_exactly_and_never_run(value, tmp_path, monkeypatch):
    # from deep inside tmp_path, so `../../../etc/passwd` names no real file (a file there is
    # an error: the checkpoint_dir must be a writable directory)
    (tmp_path / "a" / "b" / "c" / "d").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b" / "c" / "d")
    text = _spec_text(checkpoint_dir=_par_string(value))
    plan = parcompile.compile(text, filename="t.par")
    assert plan.config.train.checkpoint_dir == value
    program = render_program(plan.config, plan, tmp_path)
    _assert_no_injection(program)
    # relative to the program's directory (as every path is), naming the same place
    got = assigned(program, "TRAIN")["checkpoint_dir"]
    assert os.path.normpath(os.path.join(os.path.abspath(tmp_path), got)) == os.path.abspath(value)


@pytest.mark.parametrize("value", [v for v in HOSTILE if "/" not in v and "\0" not in v],
                         ids=lambda v: repr(v)[:20])
def test_data_paths_are_kept_exactly_and_never_run(value, tmp_path):
    data = tmp_path / value  # a real file with the hostile name
    data.write_bytes(b"hello world\n" * 100)
    spec = tmp_path / "spec.par"
    spec.write_text(_spec_text(data=_par_string(value)), encoding="utf-8")
    plan = parcompile.compile(spec)
    out = tmp_path / "build"
    program = render_program(plan.config, plan, out)
    _assert_no_injection(program)
    assert (out / assigned(program, "DATA")).resolve() == data.resolve()


def test_path_tricks_in_data_resolve_as_paths(tmp_path):
    (tmp_path / "corpus.txt").write_text("text " * 100)
    spec = tmp_path / "specs" / "s.par"
    spec.parent.mkdir()
    spec.write_text(_spec_text(data='"../corpus.txt"'))
    plan = parcompile.compile(spec)
    assert Path(plan.config.train.data).resolve() == (tmp_path / "corpus.txt").resolve()
    program = render_program(plan.config, plan, tmp_path / "out")
    _assert_no_injection(program)
    assert assigned(program, "DATA") == "../corpus.txt"


def test_compiled_files_are_utf8_and_a_hostile_name_runs_no_shell(tmp_path):
    name = "ünï $(touch PWNED) `touch PWNED`\n touch PWNED"
    plan = parcompile.compile(TINY, filename=f"{name}.par")
    files = plan.outputs(tmp_path)
    compile(files["program.py"], "program.py", "exec")
    proc = subprocess.run(["bash", "-n", "-c", files["launch.sh"]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    header = files["launch.sh"].splitlines()[:5]
    assert all(line.startswith("#") for line in header[:4]) and "touch" not in "\n".join(
        line for line in files["launch.sh"].splitlines() if not line.startswith("#"))


def test_model_and_cluster_names_are_identifiers():
    """Block names are words of the grammar: a quote or a space cannot be a name."""
    for bad in ('model "x" {', "model a b {", "model a;b {"):
        with pytest.raises(parcompile.SpecError):
            parcompile.compile(TINY.replace("model tiny {", bad, 1))


def test_an_output_directory_behind_a_symbolic_link_still_names_the_data(tmp_path, monkeypatch):
    """The program finds its files from its own directory with symbolic links resolved
    (``Path(__file__).resolve().parent``): an output directory reached through a link
    (``proj/out -> scratch/out``, a common /home -> /data setup) must still lead its relative
    paths to the spec's files. Was: the path was taken between the link's names, so the
    program's ``..`` climbed the real directory's parents and ``parcompile run`` failed with
    "scratch/data.txt: data file not found" (and a checkpoint or HF output would have gone to
    the wrong place)."""
    proj, scratch = tmp_path / "proj", tmp_path / "scratch" / "deep"
    scratch.mkdir(parents=True)
    proj.mkdir()
    (proj / "out").symlink_to(scratch)
    data = proj / "data.txt"
    data.write_text("hello world\n" * 100)
    spec = proj / "spec.par"
    spec.write_text(_spec_text(data='"data.txt"', checkpoint_dir='"ckpt"'))
    monkeypatch.chdir(proj)                      # a checkpoint_dir is relative to where one runs
    plan = parcompile.compile(spec)
    out = proj / "out" / "run1"                  # as the user names it: through the link
    program = render_program(plan.config, plan, out)
    here = out.resolve()                         # as the program finds itself
    assert (here / assigned(program, "DATA")).resolve() == data.resolve()
    ckpt = assigned(program, "TRAIN")["checkpoint_dir"]
    assert Path(os.path.normpath(here / ckpt)) == proj.resolve() / "ckpt"
