"""`parcompile serve` stops within seconds on SIGINT or SIGTERM while its ranks start
(issue 47: with a 19 GB cache being allocated the front had not stopped within 8 s), and
leaves no process: one job signalled as soon as its rank exists (importing torch, before it
has set its death signal), one while its rank allocates the paged KV cache.

Real processes: `parcompile serve` of a one-rank CPU spec, started as a terminal starts a
job; the job's processes are found by an environment variable they all inherit
(tests/test_run_signals.py's way: torch starts each rank in a session of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.serve_utils import free_port, tiny_serve_spec
from tests.test_run_signals import AS_A_TERMINAL_JOB, _job, kill_job

pytestmark = [pytest.mark.torchrun,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")]

#: 3,000,000 tokens x 512 bytes: a 1.5 GB cache, a second or so to allocate on a loaded machine
SPEC = tiny_serve_spec(batch=4, prompt_len=16, max_new_tokens=48, kv_cache_tokens=3000000)


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def test_sigint_and_sigterm_while_the_ranks_start_stop_serve_at_once_and_leave_no_process(tmp_path):
    spec = tmp_path / "s.par"
    spec.write_text(SPEC)
    jobs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        value = uuid.uuid4().hex
        log = tmp_path / f"{sig.name}.txt"
        with open(log, "w") as out:
            front = subprocess.Popen(
                [sys.executable, "-c", AS_A_TERMINAL_JOB, "-m", "parcompile", "serve", str(spec), "-o",
                 str(tmp_path / sig.name), "--port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PARCOMPILE_TEST_JOB=value),
                start_new_session=True)
        jobs[sig] = (front, log, f"PARCOMPILE_TEST_JOB={value}")
    try:
        # SIGINT (the terminal's Ctrl-C, to the front's process group) as soon as the rank exists;
        # SIGTERM once the rank has started to allocate its cache (past torch's ~0.4 GB)
        ready = {signal.SIGINT: lambda pids: len(pids) >= 3,
                 signal.SIGTERM: lambda pids: len(pids) >= 3 and max(map(_rss, pids)) > 700 * 2**20}
        sent, deadline = {}, time.monotonic() + 300
        while len(sent) < len(jobs):      # both jobs watched at once: each is signalled at its moment
            for sig, (front, log, tag) in jobs.items():
                if sig in sent or not ready[sig](_job(tag)):
                    assert sig in sent or (front.poll() is None and "serving `" not in log.read_text()), \
                        log.read_text()
                    continue
                if sig == signal.SIGINT:
                    os.killpg(front.pid, sig)     # as the terminal sends Ctrl-C: to the front's process group
                else:
                    front.send_signal(sig)
                sent[sig] = time.monotonic()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        took = {}
        for sig, (front, log, tag) in jobs.items():
            status = front.wait(30)
            took[sig] = time.monotonic() - sent[sig]
            assert status == (130 if sig == signal.SIGINT else 143), log.read_text()
        time.sleep(0.3)      # the kernel reaps what was killed
        for sig, (front, log, tag) in jobs.items():
            assert _job(tag) == [], f"processes of the {sig.name} job were left running"
            assert (f"interrupted ({sig.name}) while the ranks started: stopped torchrun and its 1 rank(s)"
                    in log.read_text()), log.read_text()
        assert all(t < 6.0 for t in took.values()), took     # seconds, on a loaded 2-core machine
    finally:
        for front, log, tag in jobs.values():   # what a failing run left
            kill_job(tag)
