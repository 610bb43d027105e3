"""One GPU: the GEMM shapes the GEMM-rate model misses, timed and named (issue 48).

The model (parcompile/analysis/gemm.py) is held to 114 published per-shape rates
(tests/test_gemm_rate.py); the rows it still misses by more than 10% are listed there apart
(``*_MISSED``), each with a guess at what the library ran. This script measures them on the GPU
at hand, as their sources measured (the L2 flushed before each timed run, a 256 MiB
``zero_()`` as stas00/ml-engineering's mamf-finder.py does; the median of ``--repeats`` CUDA-event
timings), and names the kernel that ran (``torch.profiler``: cuBLAS's ``nvjet_*`` /
``sm90_xmma_*`` names carry the tile, e.g. ``nvjet_tst_128x256_64x4_...``). Beside each it prints
the model's rate for the same shape on the preset of the GPU found, so a session with a GPU
can tell which tile each library chose and fix the model where it is wrong:

* the XLA bf16 row 1x1024x256x1024 (``torch.mm``), with its neighbours in k (2048, 4096);
* the MAMF FP8 tensorwise rows: H100 1024x9216x14336 and H200 1280x4096x12032
  (``torch._scaled_mm``, e4m3 operands, per-tensor scales, output in e4m3 as mamf-finder writes);
* the torchtitan Llama 3.1 8B tp-8 weight-gradient GEMM, 4096 x 1792 over 98,304 tokens, bf16
  and FP8 (whether cuBLAS runs it in one wave of wide tiles decides the FP8 rows' spread).

DeepGEMM's two missed rows (4096x4096x7168, masked 2x512x4096x7168) run DeepGEMM's own kernels:
time them with its tests/test_core.py at the README's commit (55ab91f), where it is installed.

Without a CUDA device it prints ``no CUDA device: not run`` and exits 0; ``--device cpu``
times the shapes, scaled down by ``--scale`` (multiples of 16), on the CPU instead (the rates
mean nothing; it exercises the code path, tests/test_benchmarks_smoke.py).

Run: ``python benchmarks/gemm_gpu.py [--repeats 20]`` from the repository root
with parcompile installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parcompile.analysis.gemm import GENERATION, gemm_seconds  # noqa: E402
from parcompile.config.presets import CLUSTER_PRESETS, fp8_peak  # noqa: E402
from gpu import preset_for  # noqa: E402  (benchmarks/gpu.py: a GPU's cluster preset from its name)

#: (name, batch, m, n, k, format): "16" bf16 torch.mm / bmm, "tensorwise" FP8 torch._scaled_mm
SHAPES = [
    ("XLA missed", 1, 1024, 256, 1024, "16"),
    ("XLA neighbour", 1, 1024, 256, 2048, "16"),
    ("XLA neighbour", 1, 1024, 256, 4096, "16"),
    ("XLA transpose", 1, 256, 1024, 1024, "16"),    # 73.7 TFLOP/s in XLA's 9bebee8 run, the missed row 67.9
    ("XLA transpose", 1, 512, 512, 1024, "16"),     # 72.5 there
    ("MAMF H100 FP8", 1, 1024, 9216, 14336, "tensorwise"),
    ("MAMF H200 FP8", 1, 1280, 4096, 12032, "tensorwise"),
    ("8B tp8 wgrad bf16", 1, 4096, 1792, 98304, "16"),
    ("8B tp8 wgrad FP8", 1, 4096, 1792, 98304, "tensorwise"),
]


def model_tflops(preset: str | None, b: int, m: int, n: int, k: int, fmt: str) -> float | None:
    """The GEMM-rate model's TFLOP/s for the shape on ``preset`` with the launch (None where the
    preset has no kernel facts)."""
    if preset not in GENERATION:
        return None
    p = CLUSTER_PRESETS[preset]
    fp8 = fmt != "16"
    peak = fp8_peak(preset, fmt) if fp8 else p.peak_flops["bf16"]
    if not peak:
        return None
    nbytes = 1 if fp8 else 2   # FP8 rows write e4m3 outputs, as mamf-finder.py does
    t = gemm_seconds(m, n, k, b, peak, p.sms, p.hbm_bw, GENERATION[preset], fmt, nbytes, nbytes)
    return 2 * b * m * n * k / t / 1e12


def operands(b: int, m: int, n: int, k: int, fmt: str, device: str):
    """A closure running the GEMM once: bf16 ``[b,] m x k @ k x n``, or FP8 e4m3 with per-tensor
    scales (B column-major, as ``torch._scaled_mm`` takes it)."""
    if fmt == "16":
        a = torch.randn(b, m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(b, k, n, device=device, dtype=torch.bfloat16)
        return (lambda: torch.mm(a[0], w[0])) if b == 1 else (lambda: torch.bmm(a, w))
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, w, one, one, out_dtype=torch.float8_e4m3fn)


def time_gemm(run, device: str, repeats: int) -> tuple[float, str]:
    """Median seconds of ``run`` with the L2 flushed before each, and the longest kernel's name
    (the GEMM's; "" on the CPU)."""
    for _ in range(3):
        run()
    if device == "cpu":
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return statistics.median(times), ""
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return statistics.median(times), kernels[0].key if kernels else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scale", type=int, default=16, help="CPU only: divide every dimension by this")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: not run")
        return 0
    props = torch.cuda.get_device_properties(0) if args.device == "cuda" else None
    name = props.name if props else "cpu"
    preset = preset_for(props.name, props.total_memory) if props else None
    print(f"device {name}; model preset {preset or 'none'}")
    print(f"{'row':20s} {'b x m x n x k':>24s} {'fmt':10s} {'TFLOP/s':>9s} {'model':>8s} {'error':>7s}  kernel")
    rows = []
    for label, b, m, n, k, fmt in SHAPES:
        if args.device == "cpu":
            m, n, k = (max(16, d // args.scale // 16 * 16) for d in (m, n, k))
        seconds, kernel = time_gemm(operands(b, m, n, k, fmt, args.device), args.device, args.repeats)
        got = 2 * b * m * n * k / seconds / 1e12
        want = model_tflops(preset, b, m, n, k, fmt)
        err = f"{100 * (want / got - 1):+6.1f}%" if want else "     -"
        print(f"{label:20s} {f'{b}x{m}x{n}x{k}':>24s} {fmt:10s} {got:9.2f} {want or 0:8.1f} {err}  {kernel}")
        rows.append(dict(row=label, batch=b, m=m, n=n, k=k, fmt=fmt, tflops=got, model=want, kernel=kernel))
    print("\n" + json.dumps({"device": name, "rows": rows}))   # one line for a caller to keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
