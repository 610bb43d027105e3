"""One GPU, world 1: the generated program's measured throughput against its plan (issue 15).

A Llama-shaped model in bf16 (``--model 1b``: Llama 3.2 1B's shape, about 1.24 B
parameters; ``--model 3b``: Llama 3.2 3B's) is compiled for one GPU of a cluster preset
(``--cluster``; by default the preset of the GPU found: H200 -> ``h200``, H100 ->
``h100-sxm``, A100 -> ``a100-80gb`` / ``a100-40gb``, B200 -> ``b200``, MI300X -> ``mi300x``),
and its ``program.py`` runs in this process for ``--steps`` steps on synthetic data. Each
step is timed from one collective-counter reset (the first thing a step does) to the next,
after a device synchronisation; the first ``--warmup`` steps are dropped. It prints a table
of the plan's estimate (plan.json ``estimate``: step time, tokens/s, MFU; ``memory``: the
stage's total) against what was measured: median step time, tokens/s =
global_batch * seq_len / step time, MFU = ``compute.model_flops_per_step`` / step time /
the preset's peak FLOP/s, and the allocator's peak.

Takes well under 5 minutes (most of it is drawing the initial weights on the CPU).
Without a CUDA device it prints ``no CUDA device: not run`` and exits 0; ``--device cpu
--tiny`` runs a tiny model of the same kind on the CPU instead (the plan is still the
GPU's, so the comparison means nothing; it exercises the code path).

Run: ``python benchmarks/gpu.py [--model 1b|3b] [--cluster h200] [--steps 20] [--micro-batch 4]
[--global-batch 8] [--seq 2048] [--keep DIR]`` from the repository root with parcompile
installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _program import build as build_program

MODELS = {
    # meta-llama/Llama-3.2-1B config.json: 16 layers, tied embeddings
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, theta=500000.0, tied="true"),
    # meta-llama/Llama-3.2-3B config.json: 28 layers, tied embeddings
    "3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192, vocab=128256, theta=500000.0, tied="true"),
    # a tiny model of the same kind (--tiny), for the code path on a CPU
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, theta=10000.0, tied="true"),
}

SPEC = """
model bench {{
    layers         = {layers}
    hidden         = {hidden}
    heads          = {heads}
    kv_heads       = {kv_heads}
    ffn_hidden     = {ffn}
    vocab          = {vocab}
    seq_len        = {seq}
    dtype          = bf16
    norm           = rmsnorm
    activation     = swiglu
    position       = rope
    rope_theta     = {theta}
    tie_embeddings = {tied}
}}

cluster gpu from "{cluster}" {{
    nodes         = 1
    gpus_per_node = 1
}}

parallel {{
    dp = 1
    tp = 1
    pp = 1
    micro_batch  = {micro_batch}
    global_batch = {global_batch}
    recompute    = {recompute}
}}

train {{
    optimizer = adamw
    lr        = 1e-4
    steps     = {steps}
    seed      = 1
    data      = "synthetic"
    log_every = 5
}}
"""


def preset_for(name: str, memory: int) -> str:
    """The cluster preset of a GPU from its name (``torch.cuda.get_device_name``)."""
    n = name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100-sxm"
    if "B200" in n:
        return "b200"   # GB200 (its name says B200 too) plans with `--cluster gb200-nvl72`
    if "A100" in n:
        return "a100-80gb" if memory > 60 * 2**30 else "a100-40gb"
    if "MI300" in n:
        return "mi300x"
    print(f"note: no cluster preset for {name!r}; using h100-sxm's numbers (pass --cluster)")
    return "h100-sxm"


def run(module, steps: int, sync) -> tuple[list[float], dict]:
    """``module.main()`` for ``steps`` steps: (per-step seconds, the rank's record)."""
    from parcompile import runtime as rt

    marks: list[float] = []
    original = rt.COUNTER.reset

    def mark():
        sync()
        marks.append(time.perf_counter())
        original()

    rt.COUNTER.reset = mark
    try:
        record = module.main(["--steps", str(steps), "--no-resume"])
    finally:
        rt.COUNTER.reset = original
    sync()
    marks.append(time.perf_counter())
    # the last interval also holds the end of main (state gathering, teardown): dropped
    return [b - a for a, b in zip(marks, marks[1:-1])], record


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("1b", "3b"), default="1b")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (for --device cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cluster", default=None, help="cluster preset (default: from the GPU's name)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; --tiny 64)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 4; --tiny 2)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 8; --tiny 4)")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps dropped from the timing")
    ap.add_argument("--keep", default=None, help="write the spec, plan.json and program.py here (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 1:
        ap.error("--steps must exceed --warmup + 1")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: not run")
        return 0
    if args.device == "cpu":
        os.environ["PARCOMPILE_DEVICE"] = "cpu"     # the program's backend choice: gloo on the CPU
        gpu_name = "cpu"
        cluster = args.cluster or "h100-sxm"
        sync = lambda: None  # noqa: E731
    else:
        props = torch.cuda.get_device_properties(0)
        gpu_name = props.name
        cluster = args.cluster or preset_for(props.name, props.total_memory)
        sync = torch.cuda.synchronize
    model = MODELS["tiny" if args.tiny else args.model]
    seq = args.seq or (64 if args.tiny else 2048)
    mb = args.micro_batch or (2 if args.tiny else 4)
    gb = args.global_batch or (4 if args.tiny else 8)
    text = SPEC.format(**model, seq=seq, cluster=cluster, micro_batch=mb, global_batch=gb,
                       recompute=args.recompute, steps=args.steps)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        t0 = time.perf_counter()
        cfg, plan, module = build_program(text, out, "gpu_bench")
        print(f"compiled in {time.perf_counter() - t0:.1f} s: {plan['model']['params'] / 1e9:.2f} B parameters; "
              f"program in {out}", flush=True)
        t0 = time.perf_counter()
        times, record = run(module, args.steps, sync)
        total = time.perf_counter() - t0
    steady = times[args.warmup:]
    step = statistics.median(steady)
    est = plan["estimate"]
    tokens = gb * seq
    peak = cfg.cluster.peak_flops
    flops = plan["compute"]["model_flops_per_step"]
    mem_plan = plan["memory"]["per_stage"][0].get("total")
    cuda_peak = (record.get("allocator_peak") or {}).get("allocated")   # the program's record (runtime/machine/device.py allocator_peaks)
    losses = record["losses"]

    m = cfg.model
    print(f"\n{gpu_name}, cluster preset {cluster} (peak {peak / 1e12:.1f} TFLOP/s bf16); torch {torch.__version__}")
    print(f"model: {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads}, ffn {m.ffn_hidden}, "
          f"vocab {m.vocab}, seq {seq}, bf16; micro-batch {mb}, global batch {gb} ({tokens} tokens/step), "
          f"recompute {args.recompute}")
    print(f"{args.steps} steps in {total:.1f} s (first {args.warmup} dropped); loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"step times min {min(steady):.4f} / median {step:.4f} / max {max(steady):.4f} s")
    rows = [
        ("step time (s)", est["step_time"], step, "{:.4f}"),
        ("tokens/s", est["tokens_per_s"], tokens / step, "{:,.0f}"),
        ("MFU", est["mfu"], flops / step / peak, "{:.3f}"),
        ("TFLOP/s per GPU", est["tflops_per_gpu"], flops / step / 1e12, "{:.1f}"),
        ("peak memory (GiB)", None if mem_plan is None else mem_plan / 2**30,
         None if cuda_peak is None else cuda_peak / 2**30, "{:.1f}"),
    ]
    print(f"\n{'':20} {'plan':>12} {'measured':>12} {'measured/plan':>14}")
    for name, p, q, fmt in rows:
        ps = "-" if p is None else fmt.format(p)
        qs = "-" if q is None else fmt.format(q)
        rs = "-" if p is None or q is None or not p else f"{q / p:.2f}"
        print(f"{name:20} {ps:>12} {qs:>12} {rs:>14}")
    summary = {"gpu": gpu_name, "cluster": cluster, "step_time": step, "tokens_per_s": tokens / step,
               "mfu": flops / step / peak, "plan": {k: est[k] for k in ("step_time", "tokens_per_s", "mfu")},
               "cuda_peak_allocated": cuda_peak, "plan_memory_total": mem_plan}
    print("\n" + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
