"""Lowering a plan to files: ``program.py`` (jinja2), ``launch.sh``, ``plan.json``, ``report.md``.

Decisions are made here, in Python, as plain data (local sizes, dtypes, paths); the
templates only format them (DESIGN: codegen first turns the plan into data). Nothing a
user typed reaches the program unchecked: strings are written with ``repr`` and numbers
come from the validated config.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import jinja2

from parcompile.config.schema import SpecConfig
from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.heads import kv_heads_per_rank
from parcompile.core.version import version
from parcompile.diagnostics import Diagnostic

TEMPLATES = Path(__file__).parent / "templates"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


# What the plan models but the generated program does not run yet: (config key, test,
# what the program does instead, the issue that brings it).
_NOT_IN_PROGRAM = (
)


def program_gaps(cfg: SpecConfig, severity: str = "warning") -> list[Diagnostic]:
    """Features of ``cfg`` that the plan accounts for but the generated program does not run
    yet, one diagnostic each (a warning for `compile`, an error for `run` and `verify`).

    The plan's memory and traffic figures describe the full feature; the program runs
    without it, so its measured memory and collectives differ from the plan's.
    """
    out = []
    for key, test, what, instead, issue in _NOT_IN_PROGRAM:
        if test(cfg):
            out.append(Diagnostic(severity, f"the generated program does not run {what} yet", cfg.span(key),
                                  note=f"{instead}; the plan's figures assume {what} (issue {issue})"))
    return out


def comment_text(text: str) -> str:
    """``text`` made safe inside a Python docstring and a shell comment line.

    Spec names come from file names, which may hold anything but ``/``: a quote, a
    backslash or a line break could close the program's docstring or start a new line of
    ``launch.sh``. Those characters (and every other non-printable one) become ``?``;
    printable unicode stays. String *values* that programs use are never written this
    way: they go through :func:`repr`.
    """
    return "".join("?" if (not ch.isprintable() or ch in '"\\`$') else ch for ch in text)


def torchrun_command(cfg: SpecConfig, script: str = "program.py") -> str:
    """The exact torchrun line for this plan (single node: standalone rendezvous)."""
    c = cfg.cluster
    if c.nodes == 1:
        return f"torchrun --standalone --nproc-per-node {c.gpus_per_node} {script}"
    return (f"torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} "
            f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT {script}")


def _data_path(data: str | None, out_dir: Path | None) -> str | None:
    """A data source, tokenizer or checkpoint path as the program should open it: relative
    to the program's directory when that is known (so generated files hold no absolute
    paths); names (``synthetic``, ``bytes``, ``builtin:...``) stay as they are.

    The program resolves a relative path against its own directory
    (:func:`parcompile.runtime.data.resolve_source`); the front end resolved the spec's
    paths against the spec's directory."""
    if data is None or data in ("synthetic", "bytes") or data.startswith("builtin:") or out_dir is None:
        return data
    # abspath, not resolve: symbolic links in the user's path stay as the user wrote them
    return os.path.relpath(os.path.abspath(data), os.path.abspath(out_dir))


def program_context(cfg: SpecConfig, plan: dict, out_dir: Path | None = None) -> dict:
    """The plain data the program template formats (see module docstring)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    padded = plan["model"]["padded_vocab"]
    train = {
        "optimizer": t.optimizer, "lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
        "steps": t.steps, "lr_schedule": t.lr_schedule, "warmup_steps": t.warmup_steps,
        "min_lr": t.min_lr, "betas": list(t.betas), "eps": t.eps, "log_every": max(t.log_every, 1),
        "checkpoint_dir": _data_path(t.checkpoint_dir, out_dir), "checkpoint_every": t.checkpoint_every,
        "eval_every": t.eval_every, "eval_batches": t.eval_batches,
    }
    data = _data_path(cfg.train.data, out_dir)
    data_format = {"tokenizer": _data_path(t.tokenizer, out_dir), "data_format": t.data_format,
                   "text_field": t.text_field}
    rope_dim = int(m.head_dim * m.rotary_fraction) // 2 * 2
    sp = bool(p.sequence_parallel and p.tp > 1)
    zero_comment = {0: "replicated over dp: all-reduce of gradients",
                    1: "ZeRO-1: optimizer states sharded over dp",
                    2: "ZeRO-2: optimizer states and gradients sharded over dp",
                    3: "ZeRO-3: optimizer states, gradients and parameters sharded over dp"}[p.zero]
    moe = m.experts > 0
    aux = m.router_aux_loss / (p.num_microbatches * (p.tp if sp else 1)) if moe else 0.0
    return {
        "moe": moe,
        "experts_local": m.experts // p.ep if moe else 0,
        "aux_loss_scale": repr(aux),
        "zero_comment": zero_comment,
        "sp": sp,
        # sequence parallelism: column-parallel layers keep the sequence-split input and
        # gather it again in backward (under full recomputation the layer keeps its input only)
        "keep_split": sp and p.recompute != "full",
        "t_attn": m.seq_len // p.cp,
        "t_local": m.seq_len // p.cp // (p.tp if sp else 1),
        "enter_comment": ("all-gather the sequence over tp; backward: reduce-scatter" if sp
                          else "backward: all-reduce over tp" if p.tp > 1 else "tp = 1: no communication"),
        "leave_comment": ("reduce-scatter the sequence over tp; backward: all-gather" if sp
                          else "all-reduce over tp" if p.tp > 1 else "tp = 1: no communication"),
        "name": comment_text(cfg.name),
        "version": version(),
        "spec_file": comment_text(Path(cfg.filename).name),
        "world": p.world_size,
        "torchrun_cmd": torchrun_command(cfg),
        "m": m,
        "p": p,
        "t": t,
        "num_microbatches": p.num_microbatches,
        "padded_vocab": padded,
        "heads_local": m.heads // p.tp,
        "kv_local": kv_heads_per_rank(m.kv_heads, p.tp),
        "ffn_local": m.ffn_hidden // p.tp,
        "rope_dim": rope_dim,
        "out_std": repr(0.02 / math.sqrt(2 * m.layers)),
        "torch_dtype": TORCH_NAMES[m.dtype],
        "force_cpu": cfg.cluster.is_cpu,
        "device": cfg.cluster.device_kind,
        "device_comment": {"cpu": "gloo on CPU processes, even where a GPU exists",
                           "cuda": "NCCL on GPUs (gloo on the CPU where none is present)",
                           "npu": "HCCL on Ascend NPUs through torch_npu"}[cfg.cluster.device_kind],
        "train_repr": repr(train),
        "data_repr": repr(data),
        "eval_data_repr": repr(_data_path(t.eval_data, out_dir)),
        "data_format_repr": repr(data_format),
        "init_from_repr": repr(_data_path(t.init_from, out_dir)),
        "hf_output_repr": repr(_data_path(t.hf_output, out_dir)),
        "model_keys_repr": repr(_model_keys(m)),
        "peak_flops_repr": repr(cfg.cluster.peak_flops),
    }


def _model_keys(m) -> dict:
    """The resolved model block as plain values (``hf_output`` builds its config.json from it)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in m.model_dump().items()}


def render_program(cfg: SpecConfig, plan: dict, out_dir: Path | None = None) -> str:
    """The text of ``program.py`` for a training plan."""
    return _env.get_template("program.py.j2").render(**program_context(cfg, plan, out_dir))


def program_name(cfg: SpecConfig) -> str:
    """The generated program's file name: ``program.py`` (train) or ``serve.py`` (serve)."""
    return "serve.py" if cfg.workload == "serve" else "program.py"


def render_launch(cfg: SpecConfig) -> str:
    """``launch.sh``: torchrun on one node, or multi-node with rendezvous from the environment
    (``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    script = program_name(cfg)
    return _env.get_template("launch.sh.j2").render(
        name=comment_text(cfg.name), version=version(), spec_file=comment_text(Path(cfg.filename).name),
        nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node, script=script,
        example_args=("--prompt 'Once upon a time' --max-new-tokens 32" if script == "serve.py"
                      else "--steps 10 --metrics-dir out/"),
    )


def render_slurm(cfg: SpecConfig) -> str:
    """``slurm.sbatch``: one task per node, ``srun torchrun`` with c10d rendezvous on the
    allocation's first node (``scontrol show hostnames``)."""
    kind = cfg.cluster.device_kind
    gpu_line = {"cuda": f"--gpus-per-node={cfg.cluster.gpus_per_node}",
                "npu": None, "cpu": None}[kind]
    job = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in cfg.name)[:64] or "parcompile"
    return _env.get_template("slurm.sbatch.j2").render(
        name=comment_text(cfg.name), version=version(), spec_file=comment_text(Path(cfg.filename).name),
        nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node, script=program_name(cfg),
        gpu_line=gpu_line, job_name=job,
    )


def serve_context(cfg: SpecConfig, plan: dict, out_dir: Path | None = None) -> dict:
    """The plain data the serve template formats (see module docstring)."""
    m, p, s = cfg.model, cfg.parallel, cfg.serve
    sv = plan["serve"]
    weights = _data_path(s.weights, out_dir)
    kv_dtype = s.kv_dtype or m.dtype
    return {
        "name": comment_text(cfg.name),
        "version": version(),
        "spec_file": comment_text(Path(cfg.filename).name),
        "world": p.world_size,
        "torchrun_cmd": torchrun_command(cfg, "serve.py"),
        "m": m,
        "p": p,
        "s": s,
        "batch_per_replica": sv["batch_per_replica"],
        "padded_vocab": plan["model"]["padded_vocab"],
        "heads_local": m.heads // p.tp,
        "kv_local": plan["model"]["kv_heads_per_rank"],
        "kv_replicas": plan["model"]["kv_head_replicas"],
        "kv_bytes_per_token": sv["kv_bytes_per_token"],
        "kv_dtype": kv_dtype,
        "ffn_local": m.ffn_hidden // p.tp,
        "rope_dim": int(m.head_dim * m.rotary_fraction) // 2 * 2,
        "torch_dtype": TORCH_NAMES[m.dtype],
        "force_cpu": cfg.cluster.is_cpu,
        "prompt_repr": repr(s.prompt),
        "weights_repr": repr(weights),
        "weights_doc": comment_text(weights) if weights else f"drawn from seed {s.seed} (the training init)",
    }


def render_serve(cfg: SpecConfig, plan: dict, out_dir: Path | None = None) -> str:
    """The text of ``serve.py`` for a serving plan."""
    return _env.get_template("serve.py.j2").render(**serve_context(cfg, plan, out_dir))


def write_files(out_dir: Path, files: dict[str, str], executable: tuple[str, ...] = (),
                stale: tuple[str, ...] = ()) -> None:
    """Write ``files`` (name -> text, UTF-8) into ``out_dir`` so that nothing is half-written.

    All files are written to a temporary sibling directory first. A new ``out_dir`` is
    that directory renamed into place in one atomic step; an existing one gets each file
    by an atomic rename (a reader sees each file old or new, never partly written). On any
    failure the temporary directory is removed and ``out_dir`` is left as it was (a
    directory this call would have created does not appear). Names in ``stale`` that
    ``files`` lacks are removed from an existing ``out_dir`` (outputs of an earlier plan
    that this one does not produce).

    Raises:
        OSError: the directory cannot be created or written.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in files.items():
            path = tmp / name
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755 if name in executable else 0o644)
        if not out_dir.exists():
            tmp.chmod(0o755)
            try:
                os.rename(tmp, out_dir)
                return
            except OSError:  # created meanwhile by someone else: fall back to file by file
                pass
        out_dir.mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, out_dir / name)
        for name in stale:
            if name not in files and (out_dir / name).is_file():
                (out_dir / name).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
