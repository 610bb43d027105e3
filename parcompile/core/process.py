"""This process's link to its parent: the death signal (Linux ``prctl``), shared by the
jobs this tool starts (:mod:`parcompile.jobs`) and the ranks (:mod:`parcompile.runtime`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: linux/prctl.h
_PR_SET_PDEATHSIG = 1

#: seconds a rank's process groups wait for a peer before the job ends
#: (``parcompile.runtime.init_parallel``); the Ascend launchers give HCCL's connection
#: timeout the same (``HCCL_CONNECT_TIMEOUT``, config/presets.py ``ACCELERATORS``)
PROCESS_GROUP_TIMEOUT_S = 600

#: set by `parcompile run` / `parcompile serve`'s launcher (:mod:`parcompile.torchrun`, to its
#: log's path) in the environment every rank inherits: a rank's error is then reported by
#: the launcher, from the rank's error file, not printed by the rank
#: (:func:`parcompile.runtime.distributed.failure.run_main`)
LAUNCHER_ENV = "PARCOMPILE_TORCHRUN_LOG"


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


LIBC = _libc()


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``, Linux; a no-op returning False elsewhere). ``parent`` is
    the pid the caller expects as its parent (default: the parent now); when the parent is
    already gone by the time the death signal is set, ``sig`` is sent at once, as the
    kernel would have. Returns True when the death signal is set."""
    if LIBC is None:
        return False
    parent = os.getppid() if parent is None else parent
    if LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:    # the parent died before the death signal was set
        os.kill(os.getpid(), sig)
    return True


__all__ = ["LAUNCHER_ENV", "LIBC", "die_with_parent"]
