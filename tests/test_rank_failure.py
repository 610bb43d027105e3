"""A rank that fails (issue 51): before, a kill -9 of one rank of `parcompile run` printed
69 to 96 lines with 2 or 3 tracebacks (the survivor's gloo error, torchrun's
ChildFailedError and its 30-line summary) and never said which rank died; a NaN loss's
clear line was followed by about 45 lines of torchrun's traceback and summary. Now one
line names the rank, its pid and its signal, says the other ranks were stopped and where
torchrun's log is (parcompile/torchrun.py); the program's own error is its one line; a
Python exception in one rank is its traceback once, then the line.

The launches are real (`parcompile run` of a 2-rank CPU spec under torchrun, gloo); the
failures are torch's own ``ProcessFailure`` objects read from error files written as the
ranks write them (parcompile/runtime/distributed/failure.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from parcompile.core.process import LAUNCHER_ENV
from parcompile.torchrun import first_failure, summary

SPEC = """
model small {
    layers = 1
    hidden = 32
    heads = 2
    ffn_hidden = 64
    vocab = 256
    seq_len = 16
    dtype = fp32
}
cluster local from "cpu" {
    gpus_per_node = 2
}
parallel {
    dp = 2
    micro_batch = 1
    global_batch = 2
}
train {
    lr = LR
    steps = STEPS
    data = "synthetic"
    log_every = 1
    grad_clip = 0
}
"""


def _failure(tmp_path, rank: int, exitcode: int, error: dict | None = None):
    """torch's ProcessFailure of local rank ``rank``, with an error file holding ``error``."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}.json"
    if error is not None:
        path.write_text(json.dumps(error))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def _recorded(tmp_path, monkeypatch, main, explained=()) -> tuple[int, dict]:
    """Run ``main`` under run_main as a rank of `parcompile run`: (exit status, its error file)."""
    from parcompile.runtime.distributed.failure import run_main

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv(LAUNCHER_ENV, str(tmp_path / "torchrun.log"))
    with pytest.raises(SystemExit) as e:
        run_main(main, explained)
    return e.value.code, json.loads(path.read_text())


def test_the_killed_rank_is_the_cause_not_the_survivor_whose_collective_failed(tmp_path):
    """torch's get_first_failure takes the earliest whole-second timestamp: the survivor's
    recorded gloo error (stamped when it was written) beat the SIGKILLed rank (stamped when
    the agent saw it) whenever a second boundary fell between."""
    survivor = {"message": {"message": "RuntimeError: Connection closed by peer",
                            "extraInfo": {"py_callstack": "Traceback ...", "timestamp": str(int(time.time()) - 1)}}}
    failures = {0: _failure(tmp_path, 0, 1, survivor), 1: _failure(tmp_path, 1, -signal.SIGKILL)}
    assert failures[0].timestamp < failures[1].timestamp
    rank, failure = first_failure(failures)
    assert rank == 1
    [line] = summary(rank, failure, 2, tmp_path / "torchrun.log")
    assert line == (f"error: rank 1 (pid 1001) was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer: "
                    f"see `dmesg`); torchrun stopped the other 1 rank(s); torchrun's log: {tmp_path}/torchrun.log")
    # the ranks torchrun stopped itself (SIGTERM) are never the cause, unless all were
    failures = {0: _failure(tmp_path, 0, -signal.SIGTERM), 1: _failure(tmp_path, 1, 3)}
    assert first_failure(failures)[0] == 1
    assert summary(1, failures[1], 2, tmp_path / "l")[-1].startswith("error: rank 1 (pid 1001) exited with status 3;")
    # two recorded exceptions in the same whole second: the error file written first (the
    # bug on rank 1; rank 0's gloo error followed when rank 1's sockets closed)
    now = int(time.time())
    errors = {r: {"message": {"message": m, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": str(now)}}}
              for r, m in ((0, "RuntimeError: Connection closed by peer"), (1, "ValueError: a bad row"))}
    failures = {r: _failure(tmp_path, r, 1, errors[r]) for r in (0, 1)}
    os.utime(tmp_path / "error1.json", (now + 0.2, now + 0.2))
    os.utime(tmp_path / "error0.json", (now + 0.25, now + 0.25))
    assert failures[0].timestamp == failures[1].timestamp
    assert first_failure(failures)[0] == 1


def test_a_rank_records_its_error_and_prints_nothing_under_the_launcher(tmp_path, monkeypatch, capfd):
    """The failing rank's exception reaches the error file with its traceback (torch's
    format: ProcessFailure reads it back) and the launcher's line prints it once."""
    from parcompile.runtime.train.step import TrainError

    def bug():
        raise ValueError("a bad row")

    code, data = _recorded(tmp_path, monkeypatch, bug)
    assert code == 1 and data["message"]["message"] == "ValueError: a bad row"
    failure = _failure(tmp_path, 0, 1, data)
    lines = summary(0, failure, 2, tmp_path / "torchrun.log")
    assert lines[0].startswith("Traceback (most recent call last):") and lines[0].endswith("ValueError: a bad row")
    assert lines[1].startswith("error: rank 0 (pid 1000) failed: ValueError: a bad row; torchrun stopped the other")

    def nan():
        raise TrainError("step 2: the loss is nan; training stopped", "lower lr")

    code, data = _recorded(tmp_path, monkeypatch, nan, (TrainError,))
    assert code == 1
    assert summary(0, _failure(tmp_path, 0, 1, data), 2, tmp_path / "l") == \
        ["error: step 2: the loss is nan; training stopped (lower lr)"]
    out, err = capfd.readouterr()
    assert out == err == ""


def test_an_error_file_that_cannot_be_written_leaves_the_ranks_line(tmp_path, monkeypatch, capfd):
    """A rank whose error file cannot be written (its directory gone) says its own error
    itself, under the launcher too, and exits 1: no traceback of the failed write (torch's
    ErrorHandler also carries on after such a write)."""
    from parcompile.runtime.distributed.failure import run_main
    from parcompile.runtime.train.step import TrainError

    def nan():
        raise TrainError("step 2: the loss is nan; training stopped", "lower lr")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "error.json"))
    monkeypatch.setenv(LAUNCHER_ENV, str(tmp_path / "torchrun.log"))
    with pytest.raises(SystemExit) as e:
        run_main(nan, (TrainError,))
    out, err = capfd.readouterr()
    assert e.value.code == 1 and out == "" and err == "error: step 2: the loss is nan; training stopped (lower lr)\n"


def _job_ranks(tag: str) -> dict[int, int]:
    """{global rank: pid} of the ranks whose environment holds ``tag`` (torch starts each
    rank in a session of its own; torchrun sets RANK and TORCHELASTIC_RUN_ID for it)."""
    ranks = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if tag.encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
                ranks.update({int(e[5:]): int(d) for e in env if e.startswith(b"RANK=")})
    return ranks


def _after_start_up(out: str) -> list[str]:
    """The lines after the start-up lines, the training steps left out."""
    lines = out.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("start-up "))
    return [line for line in lines[last + 1:] if not line.startswith("step ")]


@pytest.mark.torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_one_rank_is_one_line_naming_it(tmp_path):
    spec = tmp_path / "small.par"
    spec.write_text(SPEC.replace("LR", "1e-3").replace("STEPS", "100000000"))
    tag = f"PARCOMPILE_TEST_JOB={uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "parcompile", "run", str(spec), "-o", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PARCOMPILE_TEST_JOB=tag.split("=")[1]))
    try:
        seen = []
        for line in proc.stdout:            # rank 0 trains: both ranks are in the step's collectives
            seen.append(line)
            if re.match(r"step +2/", line):
                break
        ranks = _job_ranks(tag)
        assert sorted(ranks) == [0, 1], "".join(seen)
        os.kill(ranks[1], signal.SIGKILL)
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(120) == 1, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    [line] = _after_start_up(out)
    m = re.fullmatch(rf"error: rank 1 \(pid {ranks[1]}\) was killed by SIGKILL \(kill -9, or the kernel's "
                     r"out-of-memory killer: see `dmesg`\); torchrun stopped the other 1 rank\(s\); torchrun's log: "
                     rf"({re.escape(str(tmp_path))}/out/logs/run-[^/]+/torchrun\.log)", line)
    assert m, line
    log = open(m.group(1)).read()           # torchrun's own output is kept, its summary included
    assert f"exitcode  : -9 (pid: {ranks[1]})  (SIGKILL)" in log and "Sending process" in log, log


@pytest.mark.torchrun
def test_nan_loss_is_the_programs_line_and_nothing_after(tmp_path):
    spec = tmp_path / "nan.par"
    spec.write_text(SPEC.replace("LR", "1e30").replace("STEPS", "8"))
    run = subprocess.run([sys.executable, "-m", "parcompile", "run", str(spec), "-o", str(tmp_path / "out")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert run.returncode == 1, run.stdout
    assert "Traceback" not in run.stdout and "ChildFailedError" not in run.stdout, run.stdout
    [line] = _after_start_up(run.stdout)
    assert re.fullmatch(r"error: step \d+: the (loss|gradient norm) is (nan|inf); training stopped before saving "
                        r"anything of this step \(no checkpoint was saved\) \(lower lr, .*\)", line), run.stdout
    # the line names no log, so none is left under the build directory (review: they piled up)
    assert not (tmp_path / "out" / "logs").exists(), sorted((tmp_path / "out" / "logs").rglob("*"))


@pytest.mark.torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_a_serve_rank_is_one_line_and_the_server_exits(tmp_path):
    """`parcompile serve` launches its ranks the same way: before, 42 lines and a traceback
    after the kill; now the server's own line (503, then exiting) and the rank's line."""
    import threading

    import httpx

    from tests.serve_utils import free_port, stop_server, tiny_serve_spec

    spec = tmp_path / "s.par"
    spec.write_text(tiny_serve_spec(batch=2, prompt_len=8, max_new_tokens=8, kv_cache_tokens=256)
                    .replace("gpus_per_node = 1", "gpus_per_node = 2"))
    tag = f"PARCOMPILE_TEST_JOB={uuid.uuid4().hex}"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "parcompile", "serve", str(spec), "-o", str(tmp_path / "out"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PARCOMPILE_TEST_JOB=tag.split("=")[1]))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ranks = _job_ranks(tag)
        assert sorted(ranks) == [0, 1], "".join(lines)
        time.sleep(0.5)                     # the "serving" line is printed just before uvicorn answers
        before = len(lines)
        os.kill(ranks[1], signal.SIGKILL)
        assert proc.wait(120) == 1, "".join(lines)
        reader.join(10)
    finally:
        stop_server(proc)
    out = "".join(lines)
    assert "Traceback" not in out, out
    after = sorted(lines[before:])          # the server's line and the launcher's, in either order
    assert len(after) == 2, out
    assert after[0].startswith("error: rank 1 (pid %d) was killed by SIGKILL" % ranks[1]), out
    assert re.match(r"error: (replica 1 disconnected \(a rank died\)|the serve program exited with status 1); "
                    r"answering 503", after[1]), out


def test_a_data_error_at_run_time_is_one_line(tmp_path):
    """Data that went bad after `parcompile compile` (or a program started by its launch.sh or
    a plain torchrun, without `parcompile run`'s check of the data): the program says the
    data's path, line and what is wrong in one line, as `check` does, and exits 1. Was: the
    DataError's 20-line traceback, from every rank."""
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "hello there, a fine line of text"}\n' * 50)
    spec = tmp_path / "one.par"
    spec.write_text(SPEC.replace("LR", "1e-3").replace("STEPS", "2").replace('"synthetic"', '"corpus.jsonl"')
                    .replace("dp = 2", "dp = 1").replace("global_batch = 2", "global_batch = 1")
                    .replace("gpus_per_node = 2", "gpus_per_node = 1"))
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "parcompile", "compile", str(spec), "-o", str(out)], check=True,
                   capture_output=True)
    data.write_text('{"text": "hello there"}\n{"text": oops}\n')
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    env.pop(LAUNCHER_ENV, None)
    run = subprocess.run([sys.executable, str(out / "program.py")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.stderr.splitlines()[-1] == f"error: {data}:2: not valid JSON: Expecting value (column 10)", run.stderr
