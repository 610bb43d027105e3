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
  to torchrun's process group in turn.

:func:`run` is `parcompile run`'s whole use: start, wait, and on Ctrl-C or SIGTERM end
the job at once, quietly (SIGKILL to torchrun: its ranks follow by their death signal),
and return 130 or 143 as a shell does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Sequence

#: linux/prctl.h
_PR_SET_PDEATHSIG = 1


def _libc():
    """libc with errno, loaded before any fork (a child between fork and exec must not
    load libraries); None where there is no ``prctl`` (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "prctl") else None
    except OSError:
        return None


_LIBC = _libc()


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``, Linux; a no-op returning False elsewhere). ``parent`` is
    the pid the caller expects as its parent (default: the parent now); when the parent is
    already gone by the time the death signal is set, ``sig`` is sent at once, as the
    kernel would have. Returns True when the death signal is set."""
    if _LIBC is None:
        return False
    parent = os.getppid() if parent is None else parent
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:    # the parent died before the death signal was set
        os.kill(os.getpid(), sig)
    return True


def start(cmd: Sequence[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` (torchrun) in a new session, killed by the kernel when this process
    dies (see the module docstring). ``env``: its environment (default this one's)."""
    me = os.getpid()

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
    Returns the job's exit status."""
    try:
        return proc.wait(grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    for sig, wait_s in signals:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.wait(wait_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue
    return proc.wait()


class _Terminated(Exception):
    """SIGTERM arrived (raised by the handler :func:`run` installs)."""


def run(cmd: Sequence[str], env: dict | None = None, on_interrupt=None) -> int:
    """Run ``cmd`` (torchrun) to its end and return its exit status. On Ctrl-C (SIGINT) or
    SIGTERM the job is ended at once (:func:`end` with SIGKILL: torchrun prints nothing,
    its ranks die with it), ``on_interrupt(signal_name)`` is called (one line for the
    user) and 130 (SIGINT) or 143 (SIGTERM) is returned, as a shell reports them."""
    def terminated(signum, frame):
        raise _Terminated

    previous = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, terminated)
    proc = None
    try:
        try:
            proc = start(cmd, env)
            return proc.wait()
        except (KeyboardInterrupt, _Terminated) as e:
            # no second signal may stop the cleanup half-way
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if proc is not None:
                end(proc, 0.0, ((signal.SIGKILL, None),))
            name = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
            if on_interrupt is not None:
                on_interrupt(name)
            return 143 if name == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


__all__ = ["die_with_parent", "start", "end", "run"]
