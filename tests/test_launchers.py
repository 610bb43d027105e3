"""Launchers written beside every program, and the accelerator each cluster runs on."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parcompile.cli import main
from parcompile.codegen.emit import render_program
from parcompile.config.presets import CLUSTER_PRESETS
from parcompile.runtime.context import choose_backend
from tests.program_utils import tiny_config

SPEC = """model m {{
    layers = 2
    hidden = 32
    heads = 2
    vocab = 256
    seq_len = 16
    dtype = fp32
}}
cluster c from "cpu" {{ nodes = {nodes}, gpus_per_node = {gpus} }}
parallel {{ dp = 1, tp = {tp}, pp = {pp}, micro_batch = 1, global_batch = 2 }}
train {{ steps = 2, lr = 1e-2, log_every = 1 }}
"""
LOSS = re.compile(r"^step\s+\d+/2 \| loss [0-9.]+", re.M)


def test_each_cluster_runs_on_its_accelerator():
    kinds = {name: tiny_config(1, 1, 1).cluster.model_copy(update={"preset": name}).device_kind
             for name in CLUSTER_PRESETS}
    assert kinds["cpu"] == "cpu" and kinds["ascend-910b"] == "npu"
    assert all(kinds[n] == "cuda" for n in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "mi300x"))
    cfg = tiny_config(1, 1, 1)
    from parcompile.driver import compile_config

    program = render_program(cfg, compile_config(cfg))
    assert 'DEVICE = "cpu"' in program and "rt.init_parallel(plan, device=DEVICE)" in program


def test_backend_choice_at_run_time(monkeypatch):
    monkeypatch.delenv("PARCOMPILE_DEVICE", raising=False)
    assert choose_backend(device="cpu") == ("gloo", torch.device("cpu"))
    if not torch.cuda.is_available():   # a GPU plan tried on this machine falls back to gloo
        assert choose_backend(device="cuda") == ("gloo", torch.device("cpu"))
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="torch_npu is not installed"):
            choose_backend(device="npu")
    monkeypatch.setenv("PARCOMPILE_DEVICE", "cpu")
    assert choose_backend(device="npu") == ("gloo", torch.device("cpu"))


def _compile(tmp_path: Path, **kw) -> Path:
    spec = tmp_path / "s.par"
    spec.write_text(SPEC.format(**kw))
    out = tmp_path / "build"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    return out


@pytest.mark.torchrun
def test_launch_sh_rendezvous_across_two_nodes(tmp_path):
    """Two "nodes" on this machine: launch.sh with NNODES=2 and NODE_RANK 0 and 1."""
    out = _compile(tmp_path, nodes=2, gpus=1, tp=1, pp=2)
    env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    procs = [subprocess.Popen(["bash", str(out / "launch.sh")], env=dict(env, NODE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert len(LOSS.findall("".join(outputs))) == 2   # the last stage (node 1) logs both steps


@pytest.mark.torchrun
def test_slurm_sbatch_runs_one_torchrun_per_node(tmp_path):
    """slurm.sbatch under stand-ins for srun and scontrol (one node of 2 processes)."""
    out = _compile(tmp_path, nodes=1, gpus=2, tp=2, pp=1)
    text = (out / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=1" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    # srun: drop its own options, run the command once (one node, one task)
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    # torchrun of this interpreter (a venv over system packages has no torchrun script of its own)
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node001",
               SLURM_NNODES="1", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(out), MASTER_PORT="29612")
    r = subprocess.run(["bash", str(out / "slurm.sbatch")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(LOSS.findall(r.stdout)) == 2
