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
