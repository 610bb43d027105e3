"""Shared pytest setup: parcompile's own pytest plugin (:mod:`parcompile.testing`), which
adds `--update-goldens` (regenerate tests/golden/ and the other golden files instead of
comparing; PARCOMPILE_UPDATE_GOLDENS=1 does the same for the golden helpers) and the
`parcompile_golden` fixture; and pytester, which runs a user's suite with that plugin."""

pytest_plugins = ["parcompile.testing", "pytester"]

import os

# The `cpu` preset takes this machine's figures (parcompile/config/host.py); the suite and
# its golden files pin the preset's fixed, machine-independent ones (subprocesses inherit
# it), whatever the developer's shell says. Tests of the host figures set
# PARCOMPILE_CPU_PROBE themselves.
os.environ["PARCOMPILE_CPU_PROBE"] = "fixed"

import signal
import warnings

import pytest


def _signal_state() -> tuple:
    """SIGINT's and SIGTERM's handlers and the main thread's blocked signals."""
    mask = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])) if hasattr(signal, "pthread_sigmask") else None
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), mask


def _kernel_signals() -> dict:
    """The kernel's view of this process's ignored and blocked signals (Linux /proc: SigIgn,
    SigBlk, hex masks), which C code can change behind :func:`signal.getsignal`'s back."""
    try:
        with open("/proc/self/status") as f:
            return {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k in ("SigIgn", "SigBlk")}
    except OSError:
        return {}


_KERNEL_AT_START = _kernel_signals()
_kernel_warned: list[str] = []


@pytest.fixture(autouse=True)
def _signals_left_as_found(request):
    """Every test leaves the process's SIGINT and SIGTERM handlers and its signal mask as it
    found them (restored, then the test fails): a child process inherits an ignored or
    blocked signal, so a leak made a later `parcompile run` ignore Ctrl-C
    (tests/test_run_signals.py), and an embedding user's process would stop answering it."""
    before = _signal_state()
    yield
    kernel = _kernel_signals()
    if kernel != _KERNEL_AT_START and not _kernel_warned:
        # (a warning, once: a full suite has run `parcompile run` with SIGINT ignored, and
        # which test or fixture set it so is not known yet; the handlers and mask above are
        # checked per test and were not it)
        _kernel_warned.append(request.node.nodeid)
        warnings.warn(f"ignored / blocked signals changed since the session started, first seen after "
                      f"{request.node.nodeid}: {_KERNEL_AT_START} -> {kernel}")
    after = _signal_state()
    if after != before:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
        if before[2] is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before[2])
        pytest.fail(f"the test changed the process's signal state: (SIGINT handler, SIGTERM handler, blocked) "
                    f"{before} -> {after}", pytrace=False)
