"""Launchers written beside every program (launch.sh, slurm.sbatch), and the accelerator each
cluster runs on.

The launchers are run for real: launch.sh's one-node line, its two-node rendezvous and its
``NNODES=1`` line, each from a directory other than the program's; slurm.sbatch as sbatch
runs it (a copy in a spool directory, the job in the submit directory) under stand-ins for
``srun`` and ``scontrol``, and under a real SLURM (slurmctld and slurmd on localhost, a
one-node cluster of this machine) where one is installed. The losses they train are compared
with the program run in this process, digit for digit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parcompile.cli import main
from parcompile.codegen.emit import render_launch, render_program, render_slurm
from parcompile.config.presets import CLUSTER_PRESETS
from parcompile.core.version import version
from parcompile.frontend import load_spec
from parcompile.runtime.distributed.context import choose_backend
from tests.program_utils import tiny_config

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
# launchers of one-node training, many-node training and serving (goldens show change)
GOLDEN_LAUNCHERS = ("tiny", "llama3_8b_2x8_h100", "tiny_serve")

SPEC = """model m {{
    layers = 2
    hidden = 32
    heads = 2
    vocab = 256
    seq_len = 16
    dtype = fp32
}}
cluster c from "cpu" {{ nodes = {nodes}, gpus_per_node = {gpus} }}
parallel {{ dp = {dp}, tp = {tp}, pp = {pp}, micro_batch = 1, global_batch = {batch} }}
train {{ steps = 2, lr = 1e-2, log_every = 1 }}
"""
LOSS = re.compile(r"^step\s+\d+/2 \| loss [0-9.]+", re.M)


def test_each_cluster_runs_on_its_accelerator():
    kinds = {name: tiny_config(1, 1, 1).cluster.model_copy(update={"preset": name}).device_kind
             for name in CLUSTER_PRESETS}
    assert kinds["cpu"] == "cpu" and kinds["ascend-910b"] == "npu"
    assert all(kinds[n] == "cuda" for n in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "gb200-nvl72",
                                            "mi300x"))
    cfg = tiny_config(1, 1, 1)
    from parcompile.driver import compile_config

    program = render_program(cfg, compile_config(cfg))
    assert 'DEVICE = "cpu"' in program and "rt.init_parallel(plan, device=DEVICE" in program


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


# --- helpers ---------------------------------------------------------------------------------

def _spec(nodes: int, gpus: int, tp: int = 1, pp: int = 1) -> str:
    """A two-layer model on ``nodes`` x ``gpus`` CPU processes (dp fills what tp x pp leave)."""
    dp = nodes * gpus // (tp * pp)
    return SPEC.format(nodes=nodes, gpus=gpus, dp=dp, tp=tp, pp=pp, batch=2 * dp)


def _compile(tmp_path: Path, name: str = "build", **kw) -> Path:
    spec = tmp_path / f"{name}.par"
    spec.write_text(_spec(**kw))
    out = tmp_path / name
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _torchrun(bin_dir: Path, python: str = sys.executable) -> Path:
    """A ``torchrun`` as pip writes it (first line: its Python), for this interpreter: a
    virtual environment over system packages has no torchrun script of its own."""
    return _executable(bin_dir / "torchrun", f"#!{python}\nimport sys\nfrom torch.distributed.run import main\n"
                                             "sys.exit(main())\n")


def _losses(metrics_dir: Path) -> dict[int, list[float]]:
    """rank -> losses, from the program's ``--metrics-dir`` files."""
    out = {int(p.stem[4:]): json.loads(p.read_text())["losses"] for p in metrics_dir.glob("rank*.json")}
    assert out, f"no rank files in {metrics_dir}"
    return out


def _in_process_losses(out: Path, monkeypatch, steps: int = 2) -> list[float]:
    """The losses of ``out/program.py`` (a world of 1) run in this process: the reference
    that `parcompile run` and every launcher must reproduce digit for digit."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location(f"launcher_program_{abs(hash(out))}", out / "program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--steps", str(steps), "--metrics", ""])["losses"]


# --- what the scripts say -------------------------------------------------------------------

@pytest.mark.parametrize("example", GOLDEN_LAUNCHERS)
def test_launcher_goldens(example, request):
    """launch.sh and slurm.sbatch of a one-node, a two-node and a serve example (goldens
    show change; `pytest --update-goldens` rewrites them)."""
    cfg, _ = load_spec(Path("examples") / f"{example}.par")
    for name, text in (("launch.sh", render_launch(cfg)), ("slurm.sbatch", render_slurm(cfg))):
        path = GOLDEN / example / name
        if request.config.getoption("--update-goldens"):
            path.write_text(text)
            continue
        assert path.exists(), f"golden file {path.relative_to(REPO)} is missing; run pytest --update-goldens"
        assert text == path.read_text(), f"{example}: {name} differs from {path.relative_to(REPO)}"


@pytest.mark.parametrize("nodes,gpus", [(1, 1), (1, 8), (2, 1), (8, 8)])
def test_launchers_say_what_they_run(nodes, gpus):
    """Every comment names the plan's own layout, the environment is named, the scripts
    parse. (The renderers take no output directory: the scripts hold no absolute path.)"""
    cfg, _ = load_spec(_spec(nodes, gpus), filename="a.par")
    launch, sbatch = render_launch(cfg), render_slurm(cfg)
    for text in (launch, sbatch):
        assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
        assert "\n# source /path/to/venv/bin/activate\n# conda activate <env>\n" in text
        assert "\nset -euo pipefail\n" in text
    world, procs = nodes * gpus, "process" if gpus == 1 else "processes"
    if nodes == 1:
        assert f"# One node ({gpus} {procs}): ./launch.sh" in launch
        assert "NODE_RANK" not in launch and "NNODES" not in launch   # nothing a one-node plan cannot use
        assert f"exec torchrun --standalone --nproc-per-node {gpus} " in launch
    else:
        assert f"# The plan spans {nodes} nodes of {gpus} {procs} (world {world})" in launch
        assert f"NODE_RANK=<0..{nodes - 1}>" in launch and f"all {world} processes" in launch
        assert "#   NNODES=1 ./launch.sh\n" in launch
        assert f"exec torchrun --standalone --nproc-per-node {world} " in launch
    assert f"#SBATCH --nodes={nodes}\n" in sbatch and "#SBATCH --ntasks-per-node=1\n" in sbatch
    assert f"--nnodes {nodes} --nproc-per-node {gpus} " in sbatch
    assert f"# {nodes} node{'s' if nodes > 1 else ''}, one task per node; each runs torchrun with {gpus} {procs}" in sbatch


def _preset_cfg(preset: str, nodes: int = 2, gpus: int = 8):
    """A two-layer spec on ``nodes`` x ``gpus`` devices of cluster preset ``preset``."""
    text = _spec(nodes, gpus).replace('cluster c from "cpu"', f'cluster c from "{preset}"')
    cfg, _ = load_spec(text, filename="a.par")
    return cfg


@pytest.mark.parametrize("preset", sorted(CLUSTER_PRESETS))
def test_launchers_say_what_changes_per_accelerator(preset):
    """Each preset's launchers name its devices, the variable that restricts them, its
    collective library's settings and its setup line, export what the stack needs (a value
    the caller set kept), and ask SLURM for GPUs only where SLURM allocates them as GPUs;
    the scripts parse. What each stack says is its row of config/presets.py ACCELERATORS."""
    cfg = _preset_cfg(preset)
    acc = cfg.cluster.accelerator
    launch, sbatch = render_launch(cfg), render_slurm(cfg)
    for text in (launch, sbatch):
        assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
        assert f"# Accelerator: {acc.name}; collectives through {acc.collectives}.\n" in text
        for var, _ in acc.comm_env:
            assert f"\n#   {var}: " in text
        for var, value, _ in acc.launch_env:
            assert f'\nexport {var}="${{{var}:-{value}}}"   # ' in text
        visible = {v for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                               "ASCEND_RT_VISIBLE_DEVICES") if v in text}
        assert visible == {v for layer in acc.visible_devices for v in layer}
        assert ("source /usr/local/Ascend/ascend-toolkit/set_env.sh" in text) == (preset == "ascend-910b")
        assert ("HCCL" in text) == (preset == "ascend-910b") and ("NCCL_" in text) == (acc.collectives in ("NCCL", "RCCL"))
    assert ("#SBATCH --gpus-per-node=8\n" in sbatch) == (acc.slurm_gpus and preset != "cpu")
    assert (launch.count("\nneed_devices 8\n"), "    need_devices 16\n" in launch) == \
        ((1, True) if acc.visible_devices else (0, False))


def _fake_torchrun(bin_dir: Path) -> Path:
    """A ``torchrun`` that prints what it was given instead of starting ranks."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    return _executable(bin_dir / "torchrun", "#!/usr/bin/env bash\n"
                       'echo "torchrun $* | HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-unset}"\n')


@pytest.mark.parametrize("visible, nnodes, code", [
    (None, "1", 0), ("0,1,2,3,4,5,6,7", None, 0), ("0,1", None, 2), ("0,1,2,3,4,5,6,7", "1", 2),
])
def test_ascend_launch_checks_visible_devices_and_sets_hccl(tmp_path, visible, nnodes, code):
    """launch.sh of a two-node Ascend plan, run (torchrun a stand-in that prints its
    arguments): ASCEND_RT_VISIBLE_DEVICES, when set, must name a device per process of the
    node (8 on one of two nodes, 16 with NNODES=1), and HCCL's connection timeout is the
    program's process-group timeout unless the caller set one."""
    from parcompile.core.process import PROCESS_GROUP_TIMEOUT_S

    cfg = _preset_cfg("ascend-910b")
    out = tmp_path / "build"
    out.mkdir()
    _executable(out / "launch.sh", render_launch(cfg))
    (out / "program.py").write_text("")
    _fake_torchrun(tmp_path / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HCCL_", "ASCEND_", "NNODES", "NODE_RANK"))}
    env.update(PATH=f"{tmp_path / 'bin'}:{env['PATH']}", PYTHONPATH=str(REPO), NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    if visible is not None:
        env["ASCEND_RT_VISIBLE_DEVICES"] = visible
    if nnodes is not None:
        env["NNODES"] = nnodes
    proc = subprocess.run([str(out / "launch.sh"), "--steps", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    if code:
        n = len(visible.split(","))
        procs = 16 if nnodes == "1" else 8
        assert proc.stderr == (f"launch.sh: ASCEND_RT_VISIBLE_DEVICES={visible} names {n} device(s) but this node "
                               f"runs {procs} processes, one per device: name {procs}, or unset it\n")
        return
    assert f"| HCCL_CONNECT_TIMEOUT={PROCESS_GROUP_TIMEOUT_S}\n" in proc.stdout
    assert ("--standalone --nproc-per-node 16" if nnodes == "1" else "--nnodes 2 --nproc-per-node 8 --node-rank 1") \
        in proc.stdout
    env["HCCL_CONNECT_TIMEOUT"] = "1800"   # the caller's own value wins
    again = subprocess.run([str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert "| HCCL_CONNECT_TIMEOUT=1800\n" in again.stdout


EIGHT, TWO = "0,1,2,3,4,5,6,7", "0,1"


@pytest.mark.parametrize("env, code, named", [
    ({}, 0, None),
    ({"CUDA_VISIBLE_DEVICES": TWO}, 2, "CUDA_VISIBLE_DEVICES"),     # HIP's alias, when HIP_ is unset
    ({"ROCR_VISIBLE_DEVICES": TWO}, 2, "ROCR_VISIBLE_DEVICES"),     # the ROCm runtime's, under HIP's
    ({"HIP_VISIBLE_DEVICES": TWO, "CUDA_VISIBLE_DEVICES": EIGHT}, 2, "HIP_VISIBLE_DEVICES"),
    ({"HIP_VISIBLE_DEVICES": EIGHT, "CUDA_VISIBLE_DEVICES": TWO}, 0, None),     # HIP_ wins: CUDA_ unread
    ({"ROCR_VISIBLE_DEVICES": TWO, "HIP_VISIBLE_DEVICES": EIGHT}, 2, "ROCR_VISIBLE_DEVICES"),
    ({"ROCR_VISIBLE_DEVICES": EIGHT, "CUDA_VISIBLE_DEVICES": EIGHT}, 0, None),
])
def test_rocm_launch_checks_every_variable_rocm_restricts_devices_by(tmp_path, env, code, named):
    """Tester: mi300x's launch.sh checked only HIP_VISIBLE_DEVICES. ROCm restricts devices at
    two layers (ROCm docs, GPU isolation techniques; torch.cuda._parse_visible_devices on
    ROCm): ROCR_VISIBLE_DEVICES (the ROCm runtime's), then HIP_VISIBLE_DEVICES, or
    CUDA_VISIBLE_DEVICES when HIP_'s is unset, indexing into what ROCr exposes. Each layer
    that is restricted must name a device per process of the node (8 here)."""
    cfg = _preset_cfg("mi300x")
    out = tmp_path / "build"
    out.mkdir()
    _executable(out / "launch.sh", render_launch(cfg))
    (out / "program.py").write_text("")
    _fake_torchrun(tmp_path / "bin")
    base = {k: v for k, v in os.environ.items() if not k.endswith("_VISIBLE_DEVICES") and k not in ("NNODES",)}
    base.update(PATH=f"{tmp_path / 'bin'}:{base['PATH']}", PYTHONPATH=str(REPO), NODE_RANK="0", MASTER_ADDR="h0")
    proc = subprocess.run([str(out / "launch.sh")], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    if code:
        assert proc.stderr == (f"launch.sh: {named}={env[named]} names 2 device(s) but this node runs 8 processes, "
                               f"one per device: name 8, or unset it\n")
    else:
        assert "--nnodes 2 --nproc-per-node 8 --node-rank 0" in proc.stdout


# --- launch.sh, run -------------------------------------------------------------------------

@pytest.mark.torchrun
def test_one_node_launchers_run_from_any_directory(tmp_path, monkeypatch):
    """A one-node plan, both launchers at once (one torchrun each), each from a directory
    other than the program's: launch.sh's one-node line (``./launch.sh``) by its path, and
    slurm.sbatch as sbatch runs it (``sbatch ../build/slurm.sbatch`` from another directory,
    arguments with a space, stand-ins for srun and scontrol). Each finds the program beside
    the script, takes relative arguments from the caller's (submit) directory, and trains
    the program's own losses, digit for digit (the program run in this process)."""
    out = _compile(tmp_path, nodes=1, gpus=1, tp=1, pp=1)
    caller = tmp_path / "caller"
    caller.mkdir()
    launch = subprocess.Popen([str(out / "launch.sh"), "--steps", "2", "--metrics-dir", "m"], cwd=caller,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sbatch = _submit_with_stubs(out, tmp_path, "../build/slurm.sbatch", ["--steps", "2", "--metrics-dir", "m d"],
                                background=True)
    reference = _in_process_losses(out, monkeypatch)
    logs = [p.communicate(timeout=300)[0] for p in (launch, sbatch)]
    assert [launch.returncode, sbatch.returncode] == [0, 0], logs
    assert len(LOSS.findall(logs[1])) == 2
    assert _losses(caller / "m") == {0: reference}
    assert _losses(tmp_path / "submit" / "m d") == {0: reference}


@pytest.mark.torchrun
def test_launch_sh_two_nodes_and_one_machine(tmp_path):
    """A two-node plan (pp 2 across the nodes): the per-node line on two "nodes" of this
    machine (NODE_RANK 0 and 1), and the ``NNODES=1`` line (both processes here) train
    the same losses on every rank. Plain ``./launch.sh`` says what to set, and launches nothing."""
    out = _compile(tmp_path, nodes=2, gpus=1, tp=1, pp=2)
    bare = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    r = subprocess.run([str(out / "launch.sh")], env=bare, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "set NODE_RANK to its rank (0 to 1" in r.stderr, r.stderr
    assert "NNODES=1 to run all 2 processes on this machine" in r.stderr
    r = subprocess.run([str(out / "launch.sh")], env=dict(bare, NODE_RANK="0"), capture_output=True, text=True)
    assert r.returncode == 2 and "set MASTER_ADDR" in r.stderr, r.stderr

    env = dict(bare, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([str(out / "launch.sh"), "--metrics-dir", str(tmp_path / "nodes")],
                              env=dict(env, NODE_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (0, 1)]
    one = subprocess.run([str(out / "launch.sh"), "--metrics-dir", str(tmp_path / "one")],
                         env=dict(bare, NNODES="1"), capture_output=True, text=True, timeout=300)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert len(LOSS.findall("".join(outputs))) == 2   # the last stage (node 1) logs both steps
    assert one.returncode == 0, one.stdout + one.stderr
    nodes = _losses(tmp_path / "nodes")
    assert set(nodes) == {0, 1} and len(nodes[1]) == 2
    assert _losses(tmp_path / "one") == nodes


def test_launch_sh_names_a_missing_environment(tmp_path):
    """No torchrun on PATH, or a torchrun whose Python cannot import parcompile: one line that
    says what to activate (no shell error, no traceback), and nothing launched."""
    out = _compile(tmp_path, nodes=1, gpus=1, tp=1, pp=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = dict(os.environ, PATH=f"{empty}:/usr/bin:/bin")
    if shutil.which("torchrun", path=env["PATH"]):
        pytest.skip("a torchrun in /usr/bin")
    r = subprocess.run([str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith("launch.sh: torchrun is not on PATH: activate the Python environment")
    # -I -S: a Python without site-packages nor PYTHONPATH, as in an environment without parcompile
    _torchrun(empty, f"{sys.executable} -IS")
    r = subprocess.run([str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"launch.sh: parcompile is not importable by torchrun's Python ({sys.executable} -IS): "
                        f"activate the environment with parcompile {version()} (see the top of this script), "
                        "or pip install parcompile there\n")


# --- slurm.sbatch under stand-ins -----------------------------------------------------------

def _submit_with_stubs(out: Path, tmp_path: Path, submitted_as: str, args: list[str], *, env: dict | None = None,
                       nnodes: str = "1", cwd: Path | None = None, torchrun: str | None = "real",
                       background: bool = False) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run ``out/slurm.sbatch`` as sbatch does: a copy in a spool directory, run in the
    submit directory (``cwd``) with the job's variables; ``scontrol show job`` answers
    ``Command=`` with the path it was submitted as, then the arguments (SLURM 22.05).
    ``torchrun``: "real" (this Python's), "record" (prints its arguments as JSON and
    launches nothing) or None (none on PATH but the system's). ``background``: return the
    running job (a Popen) instead of waiting for it."""
    spool = tmp_path / "spool" / "job00042"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "slurm.sbatch", spool / "slurm_script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "scontrol", f"""#!/usr/bin/env bash
case "$1 $2" in
    "show hostnames") echo 127.0.0.1 ;;
    "show job") printf '%s\\n' "JobId=$3 JobName=x" "   Command={submitted_as}{''.join(' ' + a for a in args)}" "   WorkDir=$PWD" ;;
    *) exit 1 ;;
esac
""")
    # srun: drop its own options, run the command once (one node, one task)
    _executable(bin_dir / "srun", '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    path = f"{bin_dir}:/usr/bin:/bin"
    if torchrun is not None:
        tr_dir = tmp_path / f"torchrun-{torchrun}"
        tr_dir.mkdir(exist_ok=True)
        if torchrun == "real":
            _torchrun(tr_dir)
        else:
            _executable(tr_dir / "torchrun", f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        path = f"{tr_dir}:{path}"
    cwd = cwd or tmp_path / "submit"
    cwd.mkdir(exist_ok=True)
    job = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node001", SLURM_NNODES=nnodes,
               SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(cwd), MASTER_PORT=str(_free_port()))
    job.pop("PARCOMPILE_DIR", None)
    job.update(env or {})
    cmd = ["bash", str(spool / "slurm_script"), *args]
    if background:
        return subprocess.Popen(cmd, cwd=cwd, env=job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=cwd, env=job, capture_output=True, text=True, timeout=300)


def test_slurm_sbatch_finds_its_program_or_says_how(tmp_path):
    """Where slurm.sbatch looks for its program, with a torchrun that only records its
    arguments: the script as submitted (relative or absolute, any arguments), PARCOMPILE_DIR,
    the working directory; else a message naming PARCOMPILE_DIR. A job of the wrong size,
    a run outside SLURM and a missing torchrun are refused with one line each."""
    out = _compile(tmp_path, nodes=1, gpus=2, tp=2, pp=1)
    program = str(out / "program.py")

    def submit(submitted_as, args, torchrun="record", **kw):
        return _submit_with_stubs(out, tmp_path, submitted_as, args, torchrun=torchrun, **kw)

    def ran(r) -> list[str]:
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    args = ["--steps", "2", "--data", "a b*", "x"]   # spaces and a glob: stripped from Command= as typed
    argv = ran(submit("../build/slurm.sbatch", args))
    assert argv[:3] == ["--nnodes", "1", "--nproc-per-node"] and argv[3] == "2"
    assert argv[-6:] == [program, *args] and "--rdzv-id" in argv and "42" in argv
    assert ran(submit(str(out / "slurm.sbatch"), []))[-1] == program
    # submitted from the output directory with no arguments (the working case)
    assert ran(submit("slurm.sbatch", [], cwd=out))[-1] == program
    # the script copied elsewhere: found through PARCOMPILE_DIR
    assert ran(submit("/nowhere/slurm.sbatch", ["--steps", "1"],
                      env={"PARCOMPILE_DIR": str(out)}))[-3:] == [program, "--steps", "1"]
    # a script read from standard input (no Command=): the working directory
    assert ran(submit("(null)", [], cwd=out))[-1] == program
    r = submit("/nowhere/slurm.sbatch", [])
    assert r.returncode == 2 and r.stdout == ""
    assert "cannot find program.py beside the script as submitted (/nowhere/slurm.sbatch)" in r.stderr
    assert "PARCOMPILE_DIR=<the directory parcompile compile wrote>" in r.stderr
    r = submit("x", [], env={"PARCOMPILE_DIR": str(tmp_path)})
    assert r.returncode == 2 and f"PARCOMPILE_DIR={tmp_path} has no program.py" in r.stderr
    r = submit("../build/slurm.sbatch", [], nnodes="2")
    assert r.returncode == 2 and "the plan runs on 1 node but the job has 2" in r.stderr
    r = submit("../build/slurm.sbatch", [], env={"SLURM_JOB_ID": ""})
    assert r.returncode == 2 and "not inside a SLURM job: submit it with sbatch" in r.stderr
    r = submit("../build/slurm.sbatch", [], torchrun=None)
    if not shutil.which("torchrun", path="/usr/bin:/bin"):
        assert r.returncode == 127 and r.stdout == "", r.stderr
        assert r.stderr.startswith("slurm.sbatch: torchrun is not on PATH: activate the Python environment")



def test_launchers_through_a_symbolic_link(tmp_path):
    """Both scripts run through a symbolic link (``ln -s build/launch.sh ~/bin/train``;
    ``sbatch ~/jobs/train.sbatch`` linking to build/slurm.sbatch) find the program beside the
    file the link names, not beside the link; a launch.sh copied away from its program says
    so in one line instead of starting torchrun's processes on a missing file."""
    out = _compile(tmp_path, nodes=1, gpus=2, tp=2, pp=1)
    program = str(out / "program.py")
    links = tmp_path / "links"
    links.mkdir()
    (links / "train").symlink_to(out / "launch.sh")
    (links / "train.sbatch").symlink_to(out / "slurm.sbatch")
    rec = tmp_path / "rec"
    rec.mkdir()
    _executable(rec / "torchrun", f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env = dict(os.environ, PATH=f"{rec}:/usr/bin:/bin")
    r = subprocess.run([str(links / "train"), "--steps", "1"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[-3:] == [program, "--steps", "1"]
    r = _submit_with_stubs(out, tmp_path, str(links / "train.sbatch"), [], torchrun="record")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[-1] == program
    if shutil.which("sh") and os.path.realpath(shutil.which("sh")) != os.path.realpath(shutil.which("bash") or ""):
        r = subprocess.run(["sh", str(out / "launch.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)   # another shell: one line that says to use bash, nothing launched
        assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
        assert r.stderr == "launch.sh: run it with bash (./launch.sh or bash launch.sh), not sh\n"
    shutil.copy(out / "launch.sh", links / "copied.sh")
    r = subprocess.run([str(links / "copied.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"launch.sh: no program.py beside this script in {links}: run the launch.sh that "
                        "parcompile compile wrote, in its output directory\n")


# --- slurm.sbatch under a real SLURM --------------------------------------------------------

def _slurm_missing() -> str | None:
    """Why a one-node SLURM cannot run here (None: it can)."""
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "scontrol", "srun") if not shutil.which(c)]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not on PATH; Debian: apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "slurmd launches jobs as root only (run the suite as root to include this test)"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this machine's name {socket.gethostname()!r} does not resolve (the rendezvous host)"
    plugins = subprocess.run(["bash", "-c", "ls /usr/lib/*/slurm*/auth_none.so /usr/lib/slurm*/auth_none.so"],
                             capture_output=True, text=True).stdout
    if not plugins.strip():
        return "this SLURM has no auth/none plugin (a test cluster without munge needs it)"
    return None


@pytest.fixture
def slurm_cluster(tmp_path_factory):
    """slurmctld and slurmd of a one-node cluster (this machine), private to the test: a
    config of its own (SLURM_CONF), free ports, no munge (auth/none), state in a temporary
    directory; both daemons stopped after. Yields the environment for sbatch/scontrol."""
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    for d in ("state", "spool", "log"):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=parcompile
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen([d, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for d in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 30
        while True:   # up when the node is idle
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(p.read_text()[-2000:] for p in (root / "log").iterdir())
                pytest.fail(f"the test SLURM did not come up (sinfo: {state!r}):\n{logs}")
            time.sleep(0.2)
        yield env
    finally:
        for d in reversed(daemons):
            d.terminate()
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


@pytest.mark.torchrun
def test_slurm_sbatch_under_a_real_slurm(slurm_cluster, tmp_path, monkeypatch):
    """sbatch from another directory, with --chdir elsewhere again: the job finds its program
    through `scontrol show job`, writes relative paths under --chdir, and trains the
    program's own losses."""
    out = _compile(tmp_path, nodes=1, gpus=1, tp=1, pp=1)
    submit, workdir = tmp_path / "submit", tmp_path / "work"
    submit.mkdir(), workdir.mkdir()
    r = subprocess.run(["sbatch", "--parsable", "--chdir", str(workdir), "--output", str(tmp_path / "job.log"),
                        "../build/slurm.sbatch", "--steps", "2", "--metrics-dir", "m d"],
                       cwd=submit, env=slurm_cluster, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while True:
        show = subprocess.run(["scontrol", "show", "job", job], env=slurm_cluster, capture_output=True,
                              text=True).stdout
        state = re.search(r"JobState=(\w+)", show)
        if state and state[1] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        assert time.monotonic() < deadline, show
        time.sleep(0.2)
    log = (tmp_path / "job.log").read_text()
    assert state[1] == "COMPLETED", show + log
    assert len(LOSS.findall(log)) == 2
    assert _losses(workdir / "m d") == {0: _in_process_losses(out, monkeypatch)}
