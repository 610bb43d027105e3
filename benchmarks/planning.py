"""Compile and search times (issue 9). Prints figures; not a timed test.

* compile one plan of Llama-3.1 405B on 16,384 H100s in-process (groups included);
* a full search for Llama-3 70B on 1,024 H100s (every layout key `auto`);
* a full search for Mixtral 8x22B on 256 H100s (skipped, saying why, if the model
  cannot be searched).

Run: ``python benchmarks/planning.py``. Wall times include whatever else the machine
runs; the CPU times (``time.process_time``) are this process's own work. ``--smoke`` (the
test suite's run) compiles the 405B plan once and searches Llama-3 70B on 32 GPUs only.
"""

from __future__ import annotations

import argparse
import sys
import time

import parcompile
from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec
from parcompile.layout_search import search

AUTO = """parallel {
    tp = auto
    pp = auto
    cp = auto
    virtual_stages = auto
    micro_batch = auto
    zero = auto
    recompute = auto
    schedule = auto
    sequence_parallel = auto
    global_batch = %d
}
"""

LLAMA405B = """model llama from "llama3.1-405b" { }
cluster h100 from "h100-sxm" { nodes = 2048 }
parallel {
    tp = 8
    pp = 16
    dp = auto
    sequence_parallel = true
    zero = 1
    recompute = full
    schedule = 1f1b
    stage_layers = [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7, 7]
    micro_batch = 1
    global_batch = 2048
}
"""


def bench_compile(repeats: int = 3) -> None:
    if repeats > 1:
        parcompile.compile(LLAMA405B)   # warm imports and caches of the process
    best = best_cpu = js = js_cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        plan = parcompile.compile(LLAMA405B)
        best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        plan.to_json()
        js, js_cpu = min(js, time.perf_counter() - t), min(js_cpu, time.process_time() - c)
    print(f"compile Llama-3.1 405B on 16,384 H100s (tp 8, pp 16, dp 128, 126 layers split 8 x 14 + 7 x 2): {best:.3f} s "
          f"(CPU {best_cpu:.3f} s; best of {repeats}; plan.to_json() {js:.3f} s more, CPU {js_cpu:.3f} s)")


def bench_search(name: str, model: str, nodes: int, batch: int) -> None:
    text = f'model m from "{model}" {{ }}\ncluster c from "h100-sxm" {{ nodes = {nodes} }}\n' + AUTO % batch
    try:
        cfg, _ = load_spec(text)
        t, c = time.perf_counter(), time.process_time()
        res = search(cfg)
    except SpecError as e:
        print(f"search {name} on {nodes * 8} GPUs: skipped: {e.diagnostics[0].message}")
        return
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    print(f"search {name} on {nodes * 8} GPUs: {dt:.2f} s (CPU {cpu:.2f} s), {res.enumerated} layouts, {res.valid} valid, "
          f"{res.fitting} fit; best {res.best.degrees_text()} ({res.best.step_time:.2f} s/step, "
          f"MFU {res.best.mfu * 100:.1f}%)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one compile and one small search (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        bench_compile(repeats=1)
        bench_search("Llama-3 70B", "llama3-70b", 4, 64)
        return 0
    bench_compile()
    bench_search("Llama-3 70B", "llama3-70b", 128, 1024)
    bench_search("Mixtral 8x22B", "mixtral-8x22b", 32, 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
