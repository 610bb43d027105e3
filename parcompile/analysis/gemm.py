"""The GEMM-rate model: seconds of one matrix multiplication from its shape, dtype and GPU.

Every matmul the step-time estimate prices (dense and tensor-parallel linears, the router,
the LM head, the grouped expert GEMMs, unfused attention's batched GEMMs; 16-bit, FP8 and
MXFP8) is timed here (:func:`gemm_seconds`), not at one efficiency per dtype. A GEMM
``C[m, n] = A[m, k] B[k, n]``, ``batch`` times (a grouped GEMM's local experts, attention's
heads), runs as output tiles of ``tm x tn`` spread over the GPU's ``S`` streaming
multiprocessors (CUTLASS / cuBLAS / DeepGEMM), each SM computing one tile at a time:

* a tile's time is its arithmetic at the SM's share of the achievable peak plus its
  operands' feed (``tm + tn`` rows of ``k`` elements from L2 into shared memory):
  ``t_tile = 2 tm tn k / (e P / S) + (tm + tn) k b / F`` (``P`` the datasheet peak of the
  dtype, ``e`` :attr:`GemmKernels.mainloop`, ``b`` bytes per operand element, ``F``
  :attr:`GemmKernels.feed` bytes/s per SM): large tiles amortise the feed, small ones fill
  the SMs;
* tile and wave quantisation: ``tiles = batch ceil(m / tm) ceil(n / tn)`` run in
  ``ceil(tiles / S)`` waves; the compute time is ``waves * t_tile`` for the best tile of
  the generation's list (:attr:`GemmKernels.tiles`, what the libraries' heuristics pick
  from);
* memory-bound GEMMs (few rows: decode, an expert receiving few tokens) are priced by their
  bytes: ``(m k + k n) b + m n b_out`` per batch at ``memory`` of the HBM bandwidth;
* ``t = max(compute, memory) + launch`` (a roofline per GEMM, plus the kernel's fixed
  prologue / epilogue and launch gap, :attr:`GemmKernels.launch`).

A training GEMM runs three times per step (forward ``m x k . k x n``, input gradient
``m x n . n x k``, weight gradient ``k x m . m x n``: the tokens become the reduction dim);
:meth:`GemmPricer.train_seconds` gives their mean, the estimate's "forward" (the backward
costs twice it, :mod:`parcompile.analysis.estimate`).

The kernel facts per GPU generation (:data:`KERNELS`) are calibrated on published per-shape
GEMM measurements (each cited in :attr:`GemmKernels.source`; ``tests/test_gemm_rate.py`` holds
the model to their rows); the SM counts and peaks are the datasheets'
(:mod:`parcompile.config.presets`). A cluster preset without kernel facts (``mi300x``,
``ascend-910b``, ``cpu``, a cluster without a preset) keeps the estimate's flat rule
(:func:`parcompile.analysis.estimate.chunk_times`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil

from parcompile.analysis.efficiency import efficiency, engine
from parcompile.config.presets import CLUSTER_PRESETS, fp8_peak
from parcompile.ir.fp8 import enabled


@dataclass(frozen=True)
class GemmKernels:
    """One GPU generation's GEMM kernels (module docstring): candidate output ``tiles``
    (rows, cols), the fraction ``mainloop`` of the datasheet peak a tile's arithmetic runs at
    per format (``"16"``: bf16 / fp16; ``"tensorwise"``, ``"rowwise"``, ``"blockwise"``,
    ``"mxfp8"``: FP8 GEMMs by scaling, of the FP8 / MXFP8 peak), the operand ``feed`` into an
    SM (bytes/s per SM), the ``memory`` fraction of the HBM bandwidth a streaming GEMM reaches,
    the fixed seconds per kernel ``launch``, and the ``source`` of each number."""

    tiles: tuple[tuple[int, int], ...]
    mainloop: dict
    feed: float
    memory: float
    launch: float
    source: str
    tile_fixed: float = 0.0


_HOPPER_SRC = (
    "mainloop 16 and blockwise, feed, memory, launch, tile_fixed: fitted to two tables of measured GEMMs on "
    "the GH100 (132 SMs): bf16, OpenXLA's H100 matmul table "
    "(tensorflow/tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at 372d578, "
    "key sm_90, cuBLAS via XLA, b x m x n x k from 256 to 4096) and FP8 with 1x128 / 128x128 block scales, "
    "DeepGEMM's README tables on the H800 SXM5 (deepseek-ai/DeepGEMM README.md at 55ab91f: normal and "
    "grouped GEMMs by M, N, K, TFLOPS); tiles: the Hopper warp-specialised kernels' 64-256 x 64-256 "
    "output tiles (CUTLASS sm90 collective builders, DeepGEMM's BLOCK_M 64/128/256 and BLOCK_N up to 256); "
    "tensorwise (and mxfp8, not on Hopper): 0.87, where the FP8 rows of analysis/calibration.py put it with "
    "efficiency.py's fp8_clock (stas00/ml-engineering's MAMF table, compute/accelerator/README.md at "
    "744d01e: 1,402.6 of 1,979 TFLOP/s at 1024x9216x14336 on the H100 SXM, which the model puts 14% higher, "
    "and the H200's 1,453.4 at 1280x4096x12032, 13% lower); rowwise: 0.55, "
    "torchao's rowwise-scaled CUTLASS GEMM, fitted with fp8_rowwise_clock on the torchtitan float8 rowwise rows; "
    "memory: the fit's 1.0 of the HBM bandwidth (DeepGEMM's small-M rows reach 2.4-2.7 of 3.35 TB/s with "
    "their launch counted in the fixed time)")
_AMPERE_SRC = (
    "mainloop: stas00/ml-engineering's MAMF table (compute/accelerator/README.md at 744d01e: A100 SXM "
    "bf16 271.2 of "
    "312 TFLOPS at 1024x10240x5120, torch 2.6; the model 268) over the model's own tile overheads; launch, "
    "tile_fixed: hopper's (assumed); feed: 120 GB/s per SM, chosen with efficiency.py's gemm_clock on the "
    "A100 rows of analysis/calibration.py (60-400 GB/s move their mean error by 0.8%); memory: STREAM-like "
    "0.80; tiles: CUTLASS sm80's 64-256 x 64-256 threadblock tiles")
_BLACKWELL_SRC = (
    "mainloop: stas00/ml-engineering's MAMF table (compute/accelerator/README.md at 744d01e: B200 SXM "
    "bf16 1,745 of 2,250 TFLOPS, 77.6%, at 1792x16128x3072) over the model's tile overheads; FP8 / MXFP8 "
    "the same fraction of their peak (assumed; the table's B200 FP8 row, 3,432.5 TFLOPS at "
    "15360x4096x3072, is within 2% of it: tests/test_gemm_rate.py); tiles: "
    "tcgen05's 128-256 x 64-256 (two-SM) tiles; feed, memory, launch as hopper's (assumed)")

#: kernel facts per GPU generation (:class:`GemmKernels`); :data:`GENERATION` maps the presets
KERNELS: dict[str, GemmKernels] = {
    "ampere": GemmKernels(((64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128)),
                          {"16": 0.89}, 120e9, 0.80, 3.5e-6, _AMPERE_SRC, 1.8e-6),
    "hopper": GemmKernels(((64, 32), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (128, 256), (256, 128)),
                          {"16": 0.83, "tensorwise": 0.87, "blockwise": 0.66, "rowwise": 0.55,
                           "mxfp8": 0.87}, 109e9, 1.0, 3.5e-6, _HOPPER_SRC, 1.8e-6),
    "blackwell": GemmKernels(((128, 64), (128, 128), (128, 256), (256, 128), (256, 256)),
                             {"16": 0.84, "tensorwise": 0.78, "blockwise": 0.80, "rowwise": 0.55,
                              "mxfp8": 0.78}, 150e9, 0.80, 4e-6, _BLACKWELL_SRC),
}
#: from this many waves of tiles on, the last partial wave is split over all SMs (stream-K)
STREAM_K_WAVES = 4

#: cluster preset -> GPU generation (:data:`KERNELS`)
GENERATION = {"a100-40gb": "ampere", "a100-80gb": "ampere", "h100-sxm": "hopper", "h200": "hopper",
              "b200": "blackwell", "gb200-nvl72": "blackwell"}


@lru_cache(maxsize=1 << 16)
def gemm_seconds(m: int, n: int, k: int, batch: int, peak: float, sms: int, hbm_bw: float, kernels: str,
                 fmt: str = "16", in_bytes: int = 2, out_bytes: int = 2, clock: float = 1.0) -> float:
    """Seconds of ``batch`` GEMMs ``[m, k] x [k, n]`` (module docstring's formula) on a GPU of
    ``sms`` SMs, dense peak ``peak`` FLOP/s for the format (16-bit, or the FP8 / MXFP8 peak)
    and ``hbm_bw`` bytes/s, with :data:`KERNELS` ``[kernels]`` at format ``fmt``; operands of
    ``in_bytes``, output of ``out_bytes`` per element; ``clock``: the SMs' clock over the one
    the kernel facts were measured at (a power-limited or throttled part: the arithmetic, the
    operand feed and the per-tile time scale with it, the HBM does not). 0 for an empty GEMM.
    Cached by shape.

    Raises:
        KeyError: ``kernels`` or ``fmt`` is not in :data:`KERNELS`."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    kn = KERNELS[kernels]
    per_sm = kn.mainloop[fmt] * peak * clock / sms
    feed, fixed = kn.feed * clock, kn.tile_fixed / clock
    best = float("inf")
    for tm, tn in kn.tiles:
        tile = max(2 * tm * tn * k / per_sm, (tm + tn) * k * in_bytes / feed) + fixed
        tiles = batch * ceil(m / tm) * ceil(n / tn)
        waves = ceil(tiles / sms) if tiles < STREAM_K_WAVES * sms else tiles / sms
        best = min(best, waves * tile)
    moved = batch * ((m * k + k * n) * in_bytes + m * n * out_bytes)
    return max(best, moved / (kn.memory * hbm_bw)) + kn.launch


def grouped_gemm_seconds(m: int, n: int, k: int, groups: int, streams: int, peak: float, sms: int, hbm_bw: float,
                         kernels: str, fmt: str = "16", in_bytes: int = 2, out_bytes: int = 2,
                         clock: float = 1.0) -> float:
    """Seconds of a grouped GEMM: ``groups`` GEMMs ``[m, k] x [k, n]`` (a mixture-of-experts
    layer's local experts, ``m`` the rows each receives), as its library schedules them
    (arguments as :func:`gemm_seconds`):

    * ``streams = 0``: one grouped kernel (torch ``_grouped_mm``, CUTLASS's grouped GEMM,
      DeepGEMM's) spreads every group's tiles over the SMs: :func:`gemm_seconds` with
      ``batch = groups``, one launch;
    * ``streams = s > 0``: one GEMM kernel per group, group ``i`` on stream ``i % s``
      (Transformer Engine's ``multi_stream_cublas_gemm``,
      :data:`parcompile.analysis.efficiency.TE_GEMM_STREAMS`): the groups run in rounds of ``s``
      concurrent kernels whose tiles share the SMs, each kernel quantised to its own tiles
      (``ceil(m / tm)`` row tiles per group), a launch per round:
      ``floor(groups / s) * t(batch = s) + t(batch = groups mod s)``.

    0 for an empty GEMM.

    Raises:
        KeyError: ``kernels`` or ``fmt`` is not in :data:`KERNELS`."""
    args = (peak, sms, hbm_bw, kernels, fmt, in_bytes, out_bytes, clock)
    if streams <= 0 or groups <= streams:
        return gemm_seconds(m, n, k, groups, *args)
    full, rest = divmod(groups, streams)
    return full * gemm_seconds(m, n, k, streams, *args) + gemm_seconds(m, n, k, rest, *args)


@dataclass(frozen=True)
class GemmPricer:
    """The GEMM rates of one cluster and training precision (:func:`gemm_pricer`): the
    datasheet's 16-bit ``peak`` and ``fp8_peak`` (FLOP/s; 0: no FP8 GEMMs), ``hbm_bw``, ``sms``,
    the generation ``kernels`` (:data:`KERNELS`), the FP8 format ``fp8_fmt``, the model's bytes
    per element ``dtype_bytes``, and the ``clock`` (``fp8_clock``) the 16-bit (FP8) GEMMs run
    at in a training step over the isolated measurements' (:func:`gemm_seconds`)."""

    peak: float
    hbm_bw: float
    sms: int
    kernels: str
    fp8_peak: float = 0.0
    fp8_fmt: str = "tensorwise"
    dtype_bytes: int = 2
    clock: float = 1.0
    fp8_clock: float = 1.0
    #: how the engine's grouped expert GEMMs run (:func:`grouped_gemm_seconds`' ``streams``:
    #: :attr:`~parcompile.analysis.efficiency.Engine.expert_gemm_streams`)
    expert_streams: int = 0

    def seconds(self, m: int, n: int, k: int, batch: int = 1, fp8: bool = False, grouped: bool = False) -> float:
        """Seconds of ``batch`` GEMMs ``[m, k] x [k, n]``; ``fp8``: an FP8 GEMM (operands of
        1 byte at the FP8 peak and clock); ``grouped``: the ``batch`` GEMMs are a grouped
        expert GEMM, scheduled as the engine runs it (:func:`grouped_gemm_seconds`)."""
        if fp8:
            args = (self.fp8_peak, self.sms, self.hbm_bw, self.kernels, self.fp8_fmt, 1, self.dtype_bytes,
                    self.fp8_clock)
        else:
            args = (self.peak, self.sms, self.hbm_bw, self.kernels, "16", self.dtype_bytes, self.dtype_bytes,
                    self.clock)
        if grouped:
            return grouped_gemm_seconds(m, n, k, batch, self.expert_streams, *args)
        return gemm_seconds(m, n, k, batch, *args)

    def train_seconds(self, m: int, n: int, k: int, batch: int = 1, fp8: bool = False, grouped: bool = False) -> float:
        """The mean of a training GEMM's three (module docstring): forward ``(m, n, k)``, input
        gradient ``(m, k, n)``, weight gradient ``(k, n, m)``, seconds (``grouped``:
        :meth:`seconds`)."""
        return (self.seconds(m, n, k, batch, fp8, grouped) + self.seconds(m, k, n, batch, fp8, grouped)
                + self.seconds(k, n, m, batch, fp8, grouped)) / 3

    def rate(self, m: int, n: int, k: int, batch: int = 1, fp8: bool = False) -> float:
        """FLOP/s of ``batch`` GEMMs ``[m, k] x [k, n]`` (:meth:`seconds`)."""
        return 2 * batch * m * n * k / self.seconds(m, n, k, batch, fp8)


def gemm_pricer(cfg) -> GemmPricer | None:
    """The :class:`GemmPricer` of ``cfg`` (a SpecConfig): its preset's datasheet peaks (16-bit,
    and the FP8 / MXFP8 peak of ``train.fp8_recipe`` where it trains in FP8) and SM count, at
    the clock a training step sustains (:attr:`~parcompile.analysis.efficiency.Efficiency.gemm_clock`,
    ``fp8_clock``, ``fp8_rowwise_clock``) times ``cluster.peak_flops`` over the datasheet's (a
    spec that lowers the peak, a power-limited part, lowers the clock), its engine's grouped
    GEMM schedule (:attr:`~parcompile.analysis.efficiency.Engine.expert_gemm_streams`). None for a cluster
    whose preset has no kernel facts (:data:`GENERATION`): the estimate's flat rule."""
    cl = cfg.cluster
    gen = GENERATION.get(cl.preset or "")
    if gen is None:
        return None
    eff = efficiency(cl)
    f8 = enabled(cfg)
    fmt = cfg.train.fp8_recipe if f8 else "tensorwise"
    preset = CLUSTER_PRESETS[cl.preset]
    peak = preset.peak_flops[cfg.model.dtype]
    power = cl.peak_flops / peak
    clock8 = eff.fp8_rowwise_clock if fmt == "rowwise" else eff.fp8_clock
    return GemmPricer(peak, cl.hbm_bw, preset.sms, gen, (fp8_peak(cl.preset, fmt) or 0.0) if f8 else 0.0, fmt,
                      cfg.model.dtype_bytes, eff.gemm_clock * power, clock8 * power,
                      engine(cl).expert_gemm_streams)


def gemm_assumptions(cfg) -> dict:
    """plan.json ``estimate.assumptions.gemm_rate`` for ``cfg`` (a SpecConfig whose GEMMs the
    GEMM-rate model timed, :func:`gemm_pricer` not None): the generation's ``kernels``
    (:data:`KERNELS`), the ``sms``, the ``clock`` the 16-bit GEMMs run at (and ``fp8_clock``,
    ``fp8_format`` where it trains in FP8), and the ``source`` of the kernel facts and of the
    clocks. Raises TypeError where :func:`gemm_pricer` is None."""
    g = gemm_pricer(cfg)
    out = {"kernels": g.kernels, "sms": g.sms, "clock": g.clock}
    if g.fp8_peak:
        out.update(fp8_clock=g.fp8_clock, fp8_format=g.fp8_fmt)
    out["source"] = f"{KERNELS[g.kernels].source}; {efficiency(cfg.cluster).gemm_source}"
    return out
