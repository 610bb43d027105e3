"""`parcompile run` ends its job with it (issue 30, item 11): after SIGINT (the terminal's
Ctrl-C, sent to the whole foreground process group), SIGTERM or SIGKILL of `parcompile run`
while the ranks train, no process of the job is left, and Ctrl-C prints one line.

Real processes: `parcompile run` of a one-rank CPU spec, started as a terminal starts a job
(a process group of its own); the job's processes are found by an environment variable
they all inherit (torch starts each rank in a session of its own, so no process group or
parent link holds them all)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torchrun,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")]

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
    gpus_per_node = 1
}
parallel {
    micro_batch = 1
    global_batch = 1
}
train {
    lr = 1e-3
    steps = 100000000
    data = "synthetic"
    log_every = 1
}
"""


#: exec python with the rest of argv, SIGINT and SIGTERM at their default actions and no signal
#: blocked, as an interactive shell starts a foreground job. A child inherits an ignored or
#: blocked signal: under a pytest started in the background by a script (`pytest &`: a
#: non-interactive shell starts background jobs with SIGINT ignored), `parcompile run`
#: rightly kept ignoring it (POSIX: nohup and background jobs rely on that), and the Ctrl-C
#: job ran on past the 60 s wait.
AS_A_TERMINAL_JOB = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.pthread_sigmask(signal.SIG_SETMASK, []); "
                     "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _job(tag: str) -> list[int]:
    """The pids of the processes whose environment holds ``tag``."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if tag.encode() in Path(f"/proc/{d}/environ").read_bytes():
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def kill_job(tag: str) -> None:
    """SIGKILL every process of the job tagged ``tag`` (:func:`_job`): what a failing test left."""
    for pid in _job(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_signals_to_run_leave_no_process_and_ctrl_c_prints_one_line(tmp_path):
    """Three jobs at once (one launch each, side by side): SIGINT, SIGTERM, SIGKILL."""
    spec = tmp_path / "small.par"
    spec.write_text(SPEC)
    jobs = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        value = uuid.uuid4().hex
        log = tmp_path / f"{sig.name}.txt"
        with open(log, "w") as out:
            run = subprocess.Popen(
                [sys.executable, "-c", AS_A_TERMINAL_JOB, "-m", "parcompile", "run", str(spec), "-o",
                 str(tmp_path / sig.name)],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PARCOMPILE_TEST_JOB=value),
                start_new_session=True)   # a job of its own, as a terminal starts one
        jobs[sig] = (run, log, f"PARCOMPILE_TEST_JOB={value}")
    try:
        deadline = time.monotonic() + 300
        for sig, (run, log, tag) in jobs.items():
            while not re.search(r"^step +2/", log.read_text(), re.M):   # the rank trains
                assert run.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert len(_job(tag)) == 3, log.read_text()   # parcompile, torchrun, the rank
        before = {sig: len(log.read_text()) for sig, (run, log, tag) in jobs.items()}
        for sig, (run, log, tag) in jobs.items():
            if sig == signal.SIGINT:
                os.killpg(run.pid, sig)   # as the terminal sends Ctrl-C: to every process of its group
            else:
                run.send_signal(sig)
        status = {sig: run.wait(60) for sig, (run, log, tag) in jobs.items()}
        deadline = time.monotonic() + 10       # the kernel delivers the death signals at once
        while any(_job(tag) for run, log, tag in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {sig.name: _job(tag) for sig, (run, log, tag) in jobs.items()} == \
            {sig.name: [] for sig in jobs}, "processes of a job were left running"
        assert status == {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}
        for sig in (signal.SIGINT, signal.SIGTERM):
            log = jobs[sig][1]
            after = [line for line in log.read_text()[before[sig]:].splitlines() if not line.startswith("step ")]
            assert after == [f"interrupted ({sig.name}): stopped torchrun and its 1 rank(s)"], after
            assert not (tmp_path / sig.name / "logs").exists()   # an interrupted launch's log is removed (issue 51)
    finally:
        for run, log, tag in jobs.values():   # what a failing run left
            kill_job(tag)
