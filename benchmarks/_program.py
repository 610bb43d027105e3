"""Shared by the benchmarks that run a generated program in this process (overhead.py, gpu.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def build(text: str, out: Path, name: str):
    """Compile the spec ``text``, write plan.json, program.py and the spec into ``out`` and
    import the program. Returns (config, plan dict, program module)."""
    from parcompile.codegen.emit import render_program, write_files
    from parcompile.driver import compile_config
    from parcompile.frontend import load_spec

    cfg, _ = load_spec(text, f"{name}.par")
    plan = compile_config(cfg)
    write_files(out, {"plan.json": plan.to_json(), "program.py": render_program(cfg, plan, out),
                      f"{name}.par": text})
    spec = importlib.util.spec_from_file_location(f"parcompile_{name}_program", out / "program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cfg, plan.data, module
