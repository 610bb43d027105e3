"""Shared pytest setup: parcompile's own pytest plugin (:mod:`parcompile.testing`), which
adds `--update-goldens` (regenerate tests/golden/ and the other golden files instead of
comparing; PARCOMPILE_UPDATE_GOLDENS=1 does the same for the golden helpers) and the
`parcompile_golden` fixture; and pytester, which runs a user's suite with that plugin."""

pytest_plugins = ["parcompile.testing", "pytester"]

import os

# The `cpu` preset takes this machine's figures (parcompile/frontend/host.py); the suite and
# its golden files pin the preset's fixed, machine-independent ones (subprocesses inherit
# it), whatever the developer's shell says. Tests of the host figures set
# PARCOMPILE_CPU_PROBE themselves.
os.environ["PARCOMPILE_CPU_PROBE"] = "fixed"

# DeepSpeed (the test extra installs it) warns "Setting accelerator to CPU" on every import by
# transformers, here and in the subprocesses (lm-eval): DS_ACCELERATOR=cpu where there is no
# accelerator (parcompile/runtime/machine/device.py quiet_deepspeed_on_cpu)
from parcompile.runtime.machine.device import quiet_deepspeed_on_cpu  # noqa: E402

quiet_deepspeed_on_cpu()

import signal

import pytest


def _signal_state() -> tuple:
    """SIGINT's and SIGTERM's handlers and the main thread's blocked signals."""
    mask = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])) if hasattr(signal, "pthread_sigmask") else None
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), mask


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    """Every test leaves the process's SIGINT and SIGTERM handlers and its signal mask as it
    found them (restored, then the test fails): a child process inherits an ignored or
    blocked signal, so a leak would make a later `parcompile run` ignore Ctrl-C
    (tests/test_run_signals.py), and an embedding user's process stop answering it."""
    before = _signal_state()
    yield
    after = _signal_state()
    if after != before:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
        if before[2] is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before[2])
        pytest.fail(f"the test changed the process's signal state: (SIGINT handler, SIGTERM handler, blocked) "
                    f"{before} -> {after}", pytrace=False)


def pytest_collection_modifyitems(config, items):
    """Every test marked ``torchrun`` (a torchrun job or a real server: about 10 s a launch) is
    also ``slow``: ``pytest -m "not slow"`` is the quick loop (README), the rest marked by hand."""
    for item in items:
        if item.get_closest_marker("torchrun") is not None:
            item.add_marker(pytest.mark.slow)

