"""The command line as a user meets it: exit codes, diagnostics without tracebacks,
byte-stable outputs, and the generated program run end to end under torchrun."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.cli import main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
BAD = """model m {
    layers = 4
    hidden = 64
    heads = 4
    vocab = 256
    seq_len = 16
}
cluster c from "cpu" {
    gpus_per_node = 8
}
parallel {
    tp = 3
    dp = 2
}
"""


def _cli(*args, cwd=REPO, timeout=600):
    return subprocess.run([sys.executable, "-m", "parcompile", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_examples(spec, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", str(spec.relative_to(REPO))]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"examples/{spec.name}: ok: ") and "parameters" in out


def test_errors_are_diagnostics_not_tracebacks(tmp_path):
    spec = tmp_path / "bad.par"
    spec.write_text(BAD)
    r = _cli("check", spec, cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.splitlines()
    i = next(k for k, line in enumerate(lines) if ":12:10: error:" in line)
    assert lines[i].startswith(f"{spec}:12:10: error: ") and "tp = 3" in lines[i]
    assert lines[i + 1] == "    tp = 3" and lines[i + 2] == " " * 9 + "^"
    assert any(line.startswith("  help: ") for line in lines[i + 3:i + 5])
    assert "world_size" in r.stderr  # the second error of the spec is reported in the same run


def test_check_json_lines(tmp_path):
    spec = tmp_path / "bad.par"
    spec.write_text(BAD)
    r = _cli("check", spec, "--format", "json", cwd=tmp_path)
    assert r.returncode == 1
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert records and all(d["severity"] == "error" for d in records)
    assert {(d["line"], d["column"]) for d in records} >= {(12, 10)}


def test_usage_errors_exit_2(tmp_path):
    assert _cli("check", tmp_path / "missing.par").returncode == 2
    assert _cli("frobnicate").returncode == 2
    assert _cli("--help").returncode == 0


def test_plan_json_is_deterministic_and_matches_the_api(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples/llama3_8b_2x8_h100.par", "--json"]) == 0
    first = capsys.readouterr().out
    assert main(["plan", "examples/llama3_8b_2x8_h100.par", "--format", "json"]) == 0
    assert capsys.readouterr().out == first
    assert first == parcompile.compile(Path("examples/llama3_8b_2x8_h100.par")).to_json()
    data = json.loads(first)
    assert data["format"] == "parcompile.plan/1" and data["world_size"] == 16
    assert str(REPO) not in first  # no absolute paths


def test_plan_text_and_dot(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples/tiny.par"]) == 0
    assert "# Plan `tiny`" in capsys.readouterr().out
    assert main(["plan", "examples/tiny.par", "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph plan {") and "cluster_stage1" in dot and dot.rstrip().endswith("}")


def test_compile_writes_every_file_identically(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for out in (tmp_path / "a", tmp_path / "b"):
        assert main(["compile", "examples/tiny.par", "-o", str(out)]) == 0
    names = sorted(p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert names == ["graph.txt", "k8s/configmap.yaml", "k8s/jobset.yaml", "launch.sh", "plan.json", "program.py",
                     "report.html", "report.md", "slurm.sbatch", "timeline.svg", "trace.json"]
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    py_compile.compile(str(tmp_path / "a" / "program.py"), doraise=True)
    assert os.access(tmp_path / "a" / "launch.sh", os.X_OK)
    assert not list(tmp_path.glob(".a.*")), "temporary directory left behind"
    header = (tmp_path / "a" / "program.py").read_text().splitlines()[:8]
    assert any("parcompile 0.1.0" in h for h in header) and any("torchrun" in h for h in header)


@pytest.mark.torchrun
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_launch_script_trains_the_tiny_example_and_checkpoints(tmp_path, monkeypatch):
    """The README's main job (examples/tiny.par: 8 processes, gloo, real text) through the
    launch.sh `compile` writes, run from another directory: the loss falls over 12 steps,
    and its DCP checkpoint holds the global weights of the run. (`parcompile run` is this
    torchrun line after `compile`: test_training_jobs' README workflow and test_resume run it.)"""
    import torch.distributed.checkpoint as dcp

    from parcompile.verification import load_global

    monkeypatch.chdir(REPO)
    assert main(["compile", "examples/tiny.par", "-o", str(tmp_path / "p")]) == 0
    r = subprocess.run(["bash", str(tmp_path / "p" / "launch.sh"), "--steps", "12", "--checkpoint-dir", "ckpt",
                        "--metrics-dir", "metrics"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(line.split("loss")[1].split("|")[0]) for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 3
    assert losses[-1] < losses[0] - 0.5, losses
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics"   # relative arguments: the caller's directory
    final = {name: ts[0] for name, ts in load_global(metrics, "params").items()}
    state = {name: torch.zeros_like(t) for name, t in final.items()}
    from parcompile.runtime.state.checkpoint import newest

    path, step = newest(ckpt)
    assert step == 12 and path.name == "step_00000012"
    # the run ends saying what it did and where its outputs went (issue 47)
    lines = r.stdout.splitlines()
    assert lines[-4].startswith("done: 12 steps in ") and f", final loss {losses[-1]:.4f}" in lines[-4]
    name, where = lines[-1].split()
    assert name == "checkpoint" and (tmp_path / where).resolve() == path.resolve()   # as the caller named it
    assert all(len(line) <= 80 for line in lines if line.startswith("step"))   # the CPU's step line
    dcp.load(state, checkpoint_id=str(path))
    assert set(state) == set(final)
    for name, t in final.items():
        torch.testing.assert_close(state[name], t, atol=0, rtol=0, msg=name)


def test_check_json_says_ok_for_a_valid_spec(monkeypatch, capsys):
    """Editors and CI get a positive signal: one JSON line, the text summary as its message."""
    monkeypatch.chdir(REPO)
    assert main(["check", "examples/tiny.par"]) == 0
    summary = capsys.readouterr().out.strip()
    assert main(["check", "examples/tiny.par", "--format", "json"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["severity"] == "ok" and record["file"] == "examples/tiny.par"
    assert record["message"] == summary and record["world_size"] == 8 and record["warnings"] == 0
    assert record["degrees"]["tp"] == 2 and record["fits"] is True


def test_check_json_lists_warnings_before_the_ok_line(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "w.par"
    spec.write_text((REPO / "examples" / "tiny.par").read_text().replace("vocab", "top_k = 2\n    vocab", 1))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "w.par", "--format", "json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["severity"] for r in records] == ["warning", "ok"] and records[1]["warnings"] == 1


def test_plan_json_and_format_must_agree(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples/tiny.par", "--json", "--format", "dot"]) == 2
    assert "--json is short for --format json; it cannot be combined with --format dot" in capsys.readouterr().err
    assert main(["plan", "examples/tiny.par", "--json", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 8


@pytest.mark.parametrize("output", ["", "  "])
def test_compile_to_an_empty_output_is_a_usage_error(output, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["compile", str(REPO / "examples" / "tiny.par"), "-o", output]) == 2
    assert "-o needs a directory name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_report_and_summary_words_agree_with_their_numbers(tmp_path, monkeypatch, capsys):
    """`1 rank`, `1 micro-batch`, `(1 rank each)`: no `1 ranks`."""
    spec = tmp_path / "one.par"
    spec.write_text('model m { layers = 2, hidden = 64, heads = 4, vocab = 256, seq_len = 16 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\n')
    monkeypatch.chdir(tmp_path)
    assert main(["check", "one.par"]) == 0
    out = capsys.readouterr().out
    assert "ok: 1 rank (" in out and "1 micro-batch," in out
    assert main(["plan", "one.par"]) == 0
    report = capsys.readouterr().out
    assert "1 rank, order" in report and "(1 rank each)" in report and "1 micro-batch, bubble" in report
    assert "1 ranks" not in report and "1 micro-batches" not in report


def test_compile_into_a_directory_whose_plan_json_is_a_fifo_does_not_wait(tmp_path):
    """Before: `compile -o DIR` read DIR/plan.json whole to learn whether parcompile wrote it:
    a FIFO there blocked forever (/dev/zero linked there: read until the kernel killed it).
    Now only a regular, size-limited file is read; the FIFO is no plan of ours."""
    import threading

    from parcompile.plan import _holds_a_plan

    os.mkfifo(tmp_path / "plan.json")
    got = []
    t = threading.Thread(target=lambda: got.append(_holds_a_plan(tmp_path / "plan.json")), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        with open(tmp_path / "plan.json", "w"):
            pass
    assert got == [False]
    (tmp_path / "plan.json").unlink()
    parcompile.compile(REPO / "examples" / "tiny.par").write(tmp_path)
    assert _holds_a_plan(tmp_path / "plan.json")   # its own plan.json is still recognised


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here: an Ascend plan runs")
@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_refuses_a_plan_whose_device_package_is_missing(tmp_path, capsys, monkeypatch, command):
    """An Ascend plan on a machine without torch_npu: one error at the `cluster` block with
    the fix, before torchrun starts a rank (each rank used to raise its own traceback);
    PARCOMPILE_DEVICE=cpu, the fix it names, lifts it."""
    from parcompile.runtime.machine.device import missing_plugin

    spec = tmp_path / "npu.par"
    work = "serve { batch = 2, prompt_len = 8, max_new_tokens = 8 }" if command == "serve" else "train { steps = 1 }"
    spec.write_text('model m { layers = 2, hidden = 64, heads = 4, vocab = 256, seq_len = 32, dtype = fp32 }\n'
                    f'cluster c from "ascend-910b" {{ nodes = 1, gpus_per_node = 2 }}\nparallel {{ tp = 2 }}\n{work}\n')
    monkeypatch.delenv("PARCOMPILE_DEVICE", raising=False)
    assert main([command, str(spec), "-o", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert "running: torchrun" not in out and "Traceback" not in err
    assert "npu.par:2:1: error: this plan runs on Ascend NPUs (CANN, torch_npu), and torch_npu is not installed" in err
    assert f"PARCOMPILE_DEVICE=cpu parcompile {command} ..." in err
    assert missing_plugin("npu") == "torch_npu" and missing_plugin("cuda") is None
    monkeypatch.setenv("PARCOMPILE_DEVICE", "cpu")
    assert missing_plugin("npu") is None


def test_help_names_training_and_serving(capsys):
    """issue 47: `parcompile --help` called the tool a compiler of "parallel training plans";
    serving is half of it."""
    assert main(["--help"]) == 0          # the CLI's main returns its exit status
    text = " ".join(capsys.readouterr().out.split())
    assert "parallel training and serving plans" in text and "serve" in text


@pytest.mark.parametrize("given", ["", "  ", "a_file"])
def test_run_refuses_a_checkpoint_dir_it_cannot_use_before_launching(given, tmp_path, monkeypatch, capsys):
    """`run --checkpoint-dir ""` was dropped in silence (an empty string is falsy): the run
    trained and saved no checkpoint, where the spec's `checkpoint_dir = ""` is an error. A
    file in its place was found only by the program's preflight, after torchrun had started
    every rank and built the model. Both are now usage errors before anything launches."""
    from parcompile import jobs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("mine")
    spec = tmp_path / "one.par"
    spec.write_text('model m { layers = 2, hidden = 32, heads = 2, vocab = 256, seq_len = 16, dtype = fp32 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\ntrain { steps = 1 }\n')
    monkeypatch.setattr(jobs, "run", lambda *a, **k: pytest.fail("torchrun launched"))
    assert main(["run", "one.par", "-o", "out", "--checkpoint-dir", given]) == 2
    out, err = capsys.readouterr()
    assert "running: torchrun" not in out and "--checkpoint-dir" in err
    assert (tmp_path / "a_file").read_text() == "mine"
