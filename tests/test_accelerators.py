"""The generated program's device layer on an accelerator that is not CUDA (issue 32).

A fake Ascend NPU stands in for the real one: torch's ``privateuse1`` backend renamed
``npu`` (``torch.utils.rename_privateuse1_backend``), a Python ``torch.npu`` device module
that records every call (``torch._register_device_module``), and an importable
``torch_npu``. Every ``torch.cuda`` function the runtime could reach raises (an exception no
``except Exception`` swallows). The program compiled for the ``ascend-910b`` preset is
imported (its module level sets the allocator's variables) and its device statements run as
it runs them: ``rt.init_parallel(plan, device=DEVICE)``, ``rt.synchronize(ctx.device)``,
``rt.allocator_peaks(ctx.device)``, ``rt.peak_memory(ctx)`` into ``RunLog.step``.

Twice, because the runtime asks ``torch.accelerator`` first and the device module only
where ``torch.accelerator`` does not serve the device type:

- ``module``: torch's real ``torch.accelerator``. A backend registered from Python alone has
  no device guard ("PyTorch is not linked with support for npu devices"), so every call
  lands in the fake ``torch.npu``;
- ``accelerator``: a ``torch.accelerator`` stand-in that serves the device (what
  torch_npu's C++ hooks give on a real Ascend): the calls go there, not to ``torch.npu``.

The renaming cannot be undone in a process, so each case runs in a subprocess of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parcompile.cli import main
from parcompile.config.presets import ACCELERATORS, CLUSTER_PRESETS
from parcompile.runtime.machine.device import BACKENDS, backend_for

REPO = Path(__file__).resolve().parent.parent

SPEC = """model m {{
    layers = 2
    hidden = 32
    heads = 2
    vocab = 256
    seq_len = 16
    dtype = bf16
}}
cluster c from "{preset}" {{ nodes = 1, gpus_per_node = 1 }}
parallel {{ micro_batch = 1, global_batch = 2 }}
train {{ steps = 2, lr = 1e-2, log_every = 1 }}
"""

MIB = 2**20

FAKE_DEVICE = r'''
import importlib.util, json, os, sys, types
import torch

class CudaCalled(BaseException):   # not an Exception: no `except Exception` in the runtime swallows it
    pass

cuda_calls = []
def forbid(name):
    def f(*a, **k):
        cuda_calls.append(name)
        raise CudaCalled(f"torch.cuda.{name} called")
    return f
for name in ("is_available", "device_count", "set_device", "current_device", "synchronize", "max_memory_allocated",
             "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats", "reset_peak_memory_stats",
             "get_device_properties", "mem_get_info", "empty_cache", "init", "is_initialized"):
    setattr(torch.cuda, name, forbid(name))

calls = []
def recorder(where, name, value):
    def f(*a, **k):
        calls.append([where, name, [str(x) for x in a]])
        return value
    return f

torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("fake_npu")
for name, value in (("is_available", True), ("device_count", 8), ("current_device", 0), ("set_device", None),
                    ("synchronize", None), ("max_memory_allocated", 123 * 2**20), ("max_memory_reserved", 456 * 2**20)):
    setattr(npu, name, recorder("npu", name, value))
torch._register_device_module("npu", npu)
sys.modules["torch_npu"] = types.ModuleType("torch_npu")   # what the runtime imports for an npu plan

if sys.argv[1] == "accelerator":   # a torch.accelerator that serves npu, as torch_npu's C++ hooks make it
    for name, value in (("is_available", True), ("device_count", 8), ("current_device_index", 2),
                        ("set_device_index", None), ("synchronize", None),
                        ("max_memory_allocated", 7 * 2**20), ("max_memory_reserved", 9 * 2**20)):
        setattr(torch.accelerator, name, recorder("accelerator", name, value))

out = sys.argv[2]
spec = importlib.util.spec_from_file_location("program", os.path.join(out, "program.py"))
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)          # module level: the allocator's variables, DEVICE
rt = program.rt
plan = json.load(open(os.path.join(out, "plan.json")))
ctx = rt.init_parallel(plan, device=program.DEVICE)   # the program's own statements, in its order
rt.synchronize(ctx.device)
peaks = rt.allocator_peaks(ctx.device)
record = rt.RunLog(None, plan, program.PEAK_FLOPS, 32, enabled=False).step(1, 2, 5.0, 1e-2, 1.0, 0.5,
                                                                            rt.peak_memory(ctx))
from parcompile.runtime.machine.device import choose_backend
backend = choose_backend(device=program.DEVICE)   # what a launched rank's process group would use
print(json.dumps({"device": str(ctx.device), "backend": [backend[0], str(backend[1])], "count": rt.device_count("npu"),
                  "calls": calls, "cuda_calls": cuda_calls, "peaks": peaks, "record": record,
                  "env": {k: os.environ.get(k) for k in ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}}))
'''


@pytest.fixture(scope="module")
def ascend_program(tmp_path_factory) -> Path:
    """A one-rank program compiled for the ``ascend-910b`` preset."""
    tmp = tmp_path_factory.mktemp("ascend")
    (tmp / "a.par").write_text(SPEC.format(preset="ascend-910b"))
    assert main(["compile", str(tmp / "a.par"), "-o", str(tmp / "out")]) == 0
    return tmp / "out"


def _run_fake(mode: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "PARCOMPILE_DEVICE"))}
    env.update(PYTHONPATH=str(REPO), LOCAL_RANK="2", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", FAKE_DEVICE, mode, str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _names(calls: list, where: str) -> list[str]:
    return [name for w, name, _ in calls if w == where]


def test_program_names_no_cuda_off_cuda(ascend_program):
    text = (ascend_program / "program.py").read_text()
    assert "cuda" not in text.lower()
    assert 'DEVICE = "npu"' in text and "rt.synchronize(ctx.device)" in text
    # every statement that touches the device goes through the runtime
    assert not re.search(r"torch\.(npu|xpu|accelerator)\b", text)


def test_fake_npu_through_its_device_module(ascend_program):
    got = _run_fake("module", ascend_program)
    assert got["cuda_calls"] == []
    assert got["device"] == "npu:2" and got["backend"] == ["hccl", "npu:2"] and got["count"] == 8
    npu = _names(got["calls"], "npu")
    assert _names(got["calls"], "accelerator") == []
    assert ["npu", "set_device", ["2"]] in got["calls"]
    assert ["npu", "synchronize", ["npu:2"]] in got["calls"]
    assert {"max_memory_allocated", "max_memory_reserved"} <= set(npu)
    assert got["peaks"] == {"allocated": 123 * MIB, "reserved": 456 * MIB}
    assert got["record"]["peak_memory"] == [123 * MIB] and got["record"]["peak_memory_reserved"] == [456 * MIB]
    assert got["env"] == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": None}


def test_fake_npu_through_torch_accelerator(ascend_program):
    got = _run_fake("accelerator", ascend_program)
    assert got["cuda_calls"] == []
    assert got["device"] == "npu:2" and got["backend"] == ["hccl", "npu:2"]
    acc = _names(got["calls"], "accelerator")
    assert ["accelerator", "set_device_index", ["2"]] in got["calls"]
    assert ["accelerator", "synchronize", ["npu:2"]] in got["calls"]
    assert {"max_memory_allocated", "max_memory_reserved", "device_count"} <= set(acc)
    # torch.accelerator serves the device: its module is not called for any of these
    assert not {"set_device", "synchronize", "max_memory_allocated"} & set(_names(got["calls"], "npu"))
    assert got["peaks"] == {"allocated": 7 * MIB, "reserved": 9 * MIB}
    assert got["record"]["peak_memory"] == [7 * MIB]


def test_backend_per_device_type():
    assert [backend_for(t) for t in ("cuda", "npu", "xpu", "cpu", "mps")] == ["nccl", "hccl", "xccl", "gloo", "gloo"]
    assert backend_for("some_new_device") == "gloo"
    # torch's own defaults agree where it has one
    import torch.distributed as dist

    for device, backend in dist.Backend.default_device_backend_map.items():
        assert BACKENDS.get(device, backend) == backend, device


def test_every_preset_has_a_stack_whose_device_has_a_backend():
    for name, preset in CLUSTER_PRESETS.items():
        acc = ACCELERATORS[preset.stack]
        assert acc.device in BACKENDS, name
    assert ACCELERATORS[CLUSTER_PRESETS["mi300x"].stack].device == "cuda"        # ROCm's torch calls it cuda
    assert ACCELERATORS[CLUSTER_PRESETS["ascend-910b"].stack].device == "npu"


def test_exports_launch_with_the_stacks_variables():
    """`parcompile export --to megatron / megatron-bridge` launch with what the stack's own
    launchers export: HCCL's connection timeout on Ascend, nothing of HCCL elsewhere."""
    from parcompile.core.process import PROCESS_GROUP_TIMEOUT_S
    from parcompile.driver import compile_config
    from parcompile.exporters import export
    from parcompile.frontend import load_spec

    for preset, expected in (("ascend-910b", f"HCCL_CONNECT_TIMEOUT={PROCESS_GROUP_TIMEOUT_S} "), ("h100-sxm", None)):
        cfg, _ = load_spec(SPEC.format(preset=preset).replace("gpus_per_node = 1", "gpus_per_node = 2")
                           .replace("micro_batch = 1", "tp = 2, micro_batch = 1"))
        plan = compile_config(cfg)
        for target in ("megatron", "megatron-bridge"):
            launch = export(plan, target).launch
            assert "CUDA_DEVICE_MAX_CONNECTIONS=1 " in launch   # Megatron asserts it under tp (MindSpeed too)
            assert (expected in launch) if expected else ("HCCL" not in launch), (preset, target, launch)
