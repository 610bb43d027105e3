"""DeepSpeed's "Setting accelerator to CPU" warning (issue 47): the test extra installs
DeepSpeed, transformers imports it, and its accelerator auto-detection logged the warning on
every run of examples/make_tiny_hf.py and benchmarks/serve_load.py (and lm-eval). Our entry
points set DeepSpeed's own override, ``DS_ACCELERATOR=cpu``, where the machine has no
accelerator (parcompile/runtime/machine/device.py quiet_deepspeed_on_cpu), before
transformers is imported. The scripts run here as a user runs them, in a fresh Python whose
environment has no DS_ACCELERATOR (the suite's conftest sets it for the suite itself)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parcompile.runtime.machine import device
from tests.serve_utils import tiny_serve_spec

REPO = Path(__file__).resolve().parents[1]
WARNING = "Setting accelerator to CPU"

needs_deepspeed_on_cpu = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or any(device.is_available(t) for t in ("cuda", "xpu", "mps")),
    reason="the warning is DeepSpeed's on a machine without an accelerator")


def _fresh_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@needs_deepspeed_on_cpu
def test_deepspeed_would_warn_without_the_override():
    """The reference: importing DeepSpeed in a fresh Python without DS_ACCELERATOR warns."""
    r = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                       env=_fresh_env(), timeout=300)
    assert WARNING in r.stdout + r.stderr


@pytest.mark.slow
@needs_deepspeed_on_cpu
def test_make_tiny_hf_prints_no_deepspeed_warning(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_hf.py"), str(tmp_path / "hf")],
                       capture_output=True, text=True, env=_fresh_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert WARNING not in r.stdout + r.stderr, r.stderr[-3000:]


@pytest.mark.slow
@needs_deepspeed_on_cpu
def test_serve_load_checkpoint_prints_no_deepspeed_warning(tmp_path):
    spec = tmp_path / "s.par"
    spec.write_text(tiny_serve_spec(batch=2, prompt_len=8, max_new_tokens=8))
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import serve_load; "
            f"serve_load.hf_checkpoint(__import__('pathlib').Path({str(spec)!r}), "
            f"__import__('pathlib').Path({str(tmp_path / 'root')!r}), 2)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_fresh_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "root" / "hf" / "config.json").is_file()
    assert WARNING not in r.stdout + r.stderr, r.stderr[-3000:]


def test_the_override_is_set_only_where_deepspeed_would_choose_the_cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")                 # the user's choice stays
    assert not device.quiet_deepspeed_on_cpu() and os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(device, "is_available", lambda t: t == "cuda")   # a GPU: DeepSpeed picks it
    assert not device.quiet_deepspeed_on_cpu() and "DS_ACCELERATOR" not in os.environ
    monkeypatch.setattr(device, "is_available", lambda t: False)
    monkeypatch.setattr(device, "DEEPSPEED_DEVICE_PACKAGES", ("json",))   # an installed device package
    assert not device.quiet_deepspeed_on_cpu() and "DS_ACCELERATOR" not in os.environ
    monkeypatch.setattr(device, "DEEPSPEED_DEVICE_PACKAGES", ("no_such_package_xyz",))
    assert device.quiet_deepspeed_on_cpu() and os.environ["DS_ACCELERATOR"] == "cpu"
