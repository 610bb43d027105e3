"""parcompile/jobs.py end: what it signals (issue 47's kill path). A job reaped by another
thread (the server's watcher waits on torchrun) while end's own wait times out must get no
signal: its pid, its process group's id and its children's may be other processes' by then."""

from __future__ import annotations

import signal
import subprocess
import sys

from parcompile import jobs


def test_end_signals_no_group_once_another_thread_reaped_the_job(monkeypatch):
    proc = jobs.start([sys.executable, "-c", "pass"])
    real_wait, calls = proc.wait, []

    def wait(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:       # the grace runs out as the watcher reaps it
            real_wait()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        return real_wait(timeout)

    sent = []
    monkeypatch.setattr(proc, "wait", wait)
    monkeypatch.setattr(jobs.os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(jobs.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert jobs.end(proc, 0.5, ((signal.SIGTERM, 1.0), (signal.SIGKILL, None))) == 0
    assert sent == []
    assert jobs.end(proc, 0.0, ((signal.SIGKILL, None),)) == 0 and sent == []
