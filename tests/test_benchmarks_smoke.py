"""Every script in benchmarks/ runs at its smallest setting (issue 30, item 15): a refactor
of what a benchmark uses cannot break it unseen (`benchmarks/overhead.py` crashed on the
programs' lost `LAYERS` constant and nothing noticed).

Each runs as ``python benchmarks/NAME.py ARGS`` does (``runpy`` in this process: no second
start of torch), and must exit 0 and print its figures. The figures themselves are not
checked: timings belong to the benchmarks. Those that launch torchrun (memory.py) or a
server (serve_load.py) are marked ``torchrun``. gpu.py needs a GPU: here it runs its CPU
path (``--device cpu --tiny``: the same compile, program import and timing loop); so does
gemm_gpu.py (``--device cpu``: its shapes scaled down, the same timing and model lines).
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

#: name -> (arguments of its smallest run, a line its output must hold)
SMOKE = {
    "code_size": ([], "functions over 80 lines:"),
    "cost_model": ([], "Llama 3.1 405B"),
    "cpu_estimate": (["--smoke"], "op_overhead"),
    "data": (["--mb", "0.02", "--vocab", "300", "--global-batch", "2", "--seq-len", "16", "--steps", "2",
              "--repeats", "1"], "TrainBatches.batch"),
    "gemm_gpu": (["--device", "cpu", "--repeats", "2", "--scale", "64"], "8B tp8 wgrad FP8"),
    "gpu": (["--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1"], '"gpu": "cpu"'),
    "overhead": (["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "2", "--ffn", "64", "--vocab",
                  "256", "--seq", "16", "--batch", "1", "--steps", "3", "--warmup", "1", "--repeats", "1",
                  "--target", "0"], "ratio program / plain"),
    "planning": (["--smoke"], "search Llama-3 70B on 32 GPUs"),
    "search": (["--only", "70b"], "best:"),
    "serve_gpu": ([], "largest error"),
}
LAUNCHING = {
    # the HTTP front alone against a stand-in engine (a child process)
    "front_cost": (["--clients", "2", "--requests", "2", "--max-tokens", "4", "--step-ms", "1"], "streamed: 2 clients"),
    "memory": (["--smoke"], "model states equal the plan exactly"),
}
SERVE_SPEC = """model tiny {
    layers = 1
    hidden = 32
    heads = 2
    ffn_hidden = 64
    vocab = 256
    seq_len = 16
}
cluster local from "cpu" {
    gpus_per_node = 1
}
serve {
    batch = 2
    prompt_len = 4
    max_new_tokens = 4
    kv_cache_tokens = 64
    block_size = 4
}
"""


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(SMOKE) | set(LAUNCHING) | {"serve_load"}


def _run(name: str, args: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [str(BENCH / f"{name}.py"), *args])
    monkeypatch.syspath_prepend(str(BENCH))   # as `python benchmarks/NAME.py` puts its folder first
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(BENCH / f"{name}.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        torch.set_num_threads(threads)   # overhead.py and gpu.py set their own
    out = capsys.readouterr()
    assert code == 0, f"benchmarks/{name}.py {' '.join(args)} exited {code}:\n{out.out[-3000:]}\n{out.err[-3000:]}"
    return out.out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "cost_model" else n   # ~50 s
                                  for n in sorted(SMOKE)])
def test_benchmark_smoke(name, capsys, monkeypatch):
    args, expected = SMOKE[name]
    assert expected in _run(name, args, capsys, monkeypatch)


@pytest.mark.torchrun
@pytest.mark.parametrize("name", sorted(LAUNCHING))
def test_launching_benchmark_smoke(name, capsys, monkeypatch):
    args, expected = LAUNCHING[name]
    assert expected in _run(name, args, capsys, monkeypatch)


@pytest.mark.torchrun
def test_serve_load_smoke(tmp_path, capsys, monkeypatch):
    spec = tmp_path / "tiny.par"
    spec.write_text(SERVE_SPEC)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = _run("serve_load", [str(spec), "--clients", "2", "--seconds", "0.5", "--prompt-tokens", "1",
                              "--max-tokens", "2", "--shared-prefix", "4"], capsys, monkeypatch)
    assert "continuous batching:" in out
    # every prompt (5 tokens) starts with the same 4, one block of 4: after each client's first
    # request (they may run together, before the block is cached), each finds it cached; the
    # warm-up request (3 tokens) finds nothing
    hit, queried = (int(x.replace(",", "")) for x in re.search(r"prefix cache: ([\d,]+) of ([\d,]+)", out).groups())
    n = (queried - 3) // 5
    assert (queried - 3) % 5 == 0 and n > 2 and 4 * (n - 2) <= hit <= 4 * (n - 1)
    assert out.count("measured / plan: TTFT") == 2   # the plan's prediction beside both phases


def test_serve_load_help_is_whole_and_every_option_says_what_it_does():
    """issue 47: `benchmarks/serve_load.py --help` was cut mid-sentence (the docstring's first
    line) and several options had no help."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_load", BENCH / "serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen = {}

    def parse(self, args=None, namespace=None):
        seen["parser"] = self
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse
    try:
        with pytest.raises(SystemExit):
            mod.main([])
    finally:
        argparse.ArgumentParser.parse_args = original
    parser = seen["parser"]
    assert parser.description.endswith("measured / predicted."), parser.description
    assert [a.dest for a in parser._actions if not a.help] == []
