"""The torchrun jobs this tool starts (`parcompile run`, `parcompile serve`): they end with it.

One mechanism for both commands, three parts:

* :func:`start` launches torchrun in a session of its own (so the terminal's Ctrl-C reaches
  only this process, which then ends the job in order: no rank prints a traceback) with
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` set in the child before ``exec`` (Linux): when this
  process dies, even by SIGKILL, the kernel kills torchrun;
* the ranks are torchrun's children, each in a session of its own (torch's
  ``SubprocessHandler``), so no process group holds them: every rank sets the same death
  signal for itself when it starts (:func:`die_with_parent`, called by
  :func:`parcompile.runtime.init_parallel`), and dies when torchrun does;
* :func:`end` ends a job: ``grace_s`` to exit by itself, then each signal of ``signals``
  to torchrun's process group in turn; SIGKILL also to each rank's process group
  (:func:`_kill_ranks`), so that a rank that has not yet set its death signal dies too.

:func:`sigterm_interrupts` makes SIGTERM a ``KeyboardInterrupt`` (:class:`Terminated`)
for both commands, so one path ends the job on either signal. :func:`run` is `parcompile
run`'s whole use: start, wait, and on Ctrl-C or SIGTERM end
the job at once, quietly (SIGKILL to torchrun: its ranks follow by their death signal),
and return 130 or 143 as a shell does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Sequence

from parcompile.core.process import LIBC as _LIBC, die_with_parent


def start(cmd: Sequence[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` (torchrun) in a new session, killed by the kernel when this process
    dies (see the module docstring). ``env``: its environment (default this one's), with
    ``PYTHONUNBUFFERED=1`` unless it sets it: torchrun and its ranks write to this process's
    stdout, and a rank's start-up progress (:mod:`parcompile.runtime.progress`) or a print
    without ``flush`` must reach a pipe (a CI log, a test) as it happens, not at the rank's end."""
    me = os.getpid()
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")

    def in_child() -> None:   # between fork and exec: only the prctl system call
        die_with_parent(signal.SIGKILL, parent=me)

    return subprocess.Popen(list(cmd), env=env, start_new_session=True,
                            preexec_fn=in_child if _LIBC is not None else None)


def end(proc: subprocess.Popen, grace_s: float = 0.0,
        signals: Sequence[tuple[int, float | None]] = ((signal.SIGTERM, 10.0), (signal.SIGKILL, None))) -> int:
    """End the job ``proc`` (from :func:`start`): wait ``grace_s`` seconds for it to exit,
    then send each ``(signal, wait_s)`` of ``signals`` to its process group and wait
    ``wait_s`` (None: until it exits) before the next. SIGTERM lets torchrun stop its ranks
    itself; the ranks of a torchrun that was SIGKILLed die by their death signal. A
    Ctrl-C while waiting moves on to the next signal at once (never leaves the job).
    Returns the job's exit status.

    Nothing is signalled once ``proc`` has been reaped (another thread's ``wait``, as
    :class:`parcompile.server.engines.Engines`' watcher, may reap it while this one's wait
    times out): its pid, and so its process group's id and its children, may be another
    process's by then (``Popen.send_signal`` skips a reaped process alike, CPython
    Lib/subprocess.py)."""
    try:
        return proc.wait(grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    for sig, wait_s in signals:
        if proc.poll() is not None:      # reaped meanwhile: its ids may be reused
            return proc.returncode
        if sig == signal.SIGKILL:
            _kill_ranks(proc.pid)
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.wait(wait_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue
    return proc.wait()


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (Linux: ``/proc/PID/task/TID/children``); [] elsewhere."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def _kill_ranks(pid: int) -> None:
    """SIGKILL the process group of each child of torchrun ``pid`` (each rank leads a session
    of its own, and what a rank started is in it), torchrun first stopped (SIGSTOP: it starts
    no rank meanwhile). The ranks' death signal would follow torchrun's death only where a
    rank has set it: one still importing torch has not (issue 47: a start-up interrupted
    must leave no process)."""
    try:
        os.killpg(pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        return
    for child in _children(pid):
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (raised by :func:`sigterm_interrupts`' handler): a
    ``KeyboardInterrupt``, so what ends a job on Ctrl-C ends it on SIGTERM too."""


@contextlib.contextmanager
def sigterm_interrupts():
    """Within: SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) in the main
    thread instead of killing the process before it has ended its job (`run` and
    `serve` alike). The previous handler is restored on exit."""
    def terminated(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(cmd: Sequence[str], env: dict | None = None, on_interrupt=None) -> int:
    """Run ``cmd`` (torchrun) to its end and return its exit status. On Ctrl-C (SIGINT) or
    SIGTERM the job is ended at once (:func:`end` with SIGKILL: torchrun prints nothing,
    its ranks die with it), ``on_interrupt(signal_name)`` is called (one line for the
    user) and 130 (SIGINT) or 143 (SIGTERM) is returned, as a shell reports them."""
    previous_int = signal.getsignal(signal.SIGINT)
    proc = None
    try:
        with sigterm_interrupts():
            try:
                proc = start(cmd, env)
                return proc.wait()
            except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM (Terminated)
                # no second signal may stop the cleanup half-way
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                if proc is not None:
                    end(proc, 0.0, ((signal.SIGKILL, None),))
                name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
                if on_interrupt is not None:
                    on_interrupt(name)
                return 143 if name == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGINT, previous_int)


__all__ = ["Terminated", "die_with_parent", "end", "run", "sigterm_interrupts", "start"]
