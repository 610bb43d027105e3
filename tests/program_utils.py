"""Helpers for tests that build and import generated programs (no torchrun)."""

from __future__ import annotations

import ast
import importlib.util
import itertools
from pathlib import Path

from parcompile.codegen.emit import render_program, write_files
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, SpecConfig, TrainConfig
from parcompile.driver import compile_config

_counter = itertools.count()


def tiny_config(dp=1, tp=1, pp=1, *, model=None, parallel=None, train=None, name="t") -> SpecConfig:
    """A small training spec on the `cpu` cluster (world = dp * tp * pp)."""
    mk = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=16, dtype="fp32")
    mk.update(model or {})
    pk = dict(dp=dp, tp=tp, pp=pp, micro_batch=2, global_batch=2 * dp * max(pp, 1) * 2)
    pk.update(parallel or {})
    tk = dict(steps=3, lr=1e-2, seed=1)
    tk.update(train or {})
    world = pk["dp"] * pk["tp"] * pk["pp"] * pk.get("cp", 1)
    return SpecConfig(
        name=name, model=ModelConfig(**mk),
        cluster=ClusterConfig(name="cpu", preset="cpu", nodes=1, gpus_per_node=world),
        parallel=ParallelConfig(**pk), train=TrainConfig(**tk),
    )


def build_program(cfg: SpecConfig, out: Path):
    """Compile ``cfg``, write plan.json and program.py into ``out``, import the program.

    Returns (module, plan dict).
    """
    plan = compile_config(cfg)
    return import_program(cfg, plan, out), plan.data


def import_program(cfg: SpecConfig, plan, out: Path):
    """Write ``plan`` (a compiled Plan, perhaps edited) and its program.py into ``out`` and
    import the program under a fresh module name; returns the module."""
    write_files(out, {"plan.json": plan.to_json(), "program.py": render_program(cfg, plan, out)})
    spec = importlib.util.spec_from_file_location(f"parcompile_test_program_{next(_counter)}", out / "program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_one_launch(world: int, jobs: list[tuple[Path, list[str]]], jobs_file: Path,
                      timeout_s: float = 600.0, torchrun_args: tuple[str, ...] = ()) -> str:
    """Run generated programs one after another in ONE torchrun launch of ``world`` ranks
    (:mod:`parcompile.runtime.distributed.batch`: each ``program.py``'s ``main(argv)`` on one process
    group), in order, so a later job may read what an earlier one wrote (a checkpoint).
    Starting torchrun costs more than a tiny program's run on CI's 2 cores.

    ``jobs``: ``(program.py path, argv)``; ``torchrun_args``: torchrun's own options (``--tee 1``:
    each rank's stdout lines prefixed ``[default<rank>]:``). Returns the launch's stdout (every job's log).
    Raises AssertionError naming the first job that did not complete, with the output."""
    import json

    from parcompile.verification import _torchrun   # verify's launch: gloo, one thread per rank

    jobs_file.write_text(json.dumps([{"program": str(p), "argv": [str(a) for a in argv]} for p, argv in jobs]))
    proc = _torchrun(world, [*torchrun_args, "-m", "parcompile.runtime.distributed.batch", str(jobs_file)], timeout_s)
    done_file = jobs_file.with_name(jobs_file.name + ".done")
    done = int(done_file.read_text()) if done_file.exists() else 0
    assert proc.returncode == 0 and done == len(jobs), (
        f"job {done} ({jobs[min(done, len(jobs) - 1)]}) did not complete:\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def assigned(program: str, name: str) -> object:
    """The literal value a generated program's module-level ``NAME = ...`` assigns (read with
    ``ast``, never executed)."""
    for node in ast.parse(program).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned in the program")
