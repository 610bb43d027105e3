"""The GEMM-rate model: seconds of one matrix multiplication from its shape, dtype and GPU.

Every matmul the step-time estimate prices (dense and tensor-parallel linears, the router,
the LM head, the grouped expert GEMMs, unfused attention's batched GEMMs; 16-bit, FP8 and
MXFP8) is timed here (:func:`gemm_seconds`), not at one efficiency per dtype. A GEMM
``C[m, n] = A[m, k] B[k, n]``, ``batch`` times (a grouped GEMM's local experts, attention's
heads), runs as output tiles of ``tm x tn`` spread over the GPU's ``S`` streaming
multiprocessors (CUTLASS / cuBLAS / DeepGEMM), each SM computing one tile at a time:

* a tile's main loop over ``kk`` of k is its arithmetic at the SM's share of the achievable
  peak or its operands' feed (``tm + tn`` rows of ``kk`` elements into shared memory),
  whichever is longer: ``main(kk) = max(2 tm tn kk / (e P / S), (tm / ca + tn / cb) kk b / F)``
  (``P`` the datasheet peak of the dtype, ``e`` :attr:`GemmKernels.mainloop`, ``b`` bytes per
  operand element, ``F`` the SM's operand rate :attr:`GemmKernels.feed`, ``ca``, ``cb`` the
  SMs a TMA multicast shares an A or B tile over (DeepGEMM's, :func:`deepgemm_multicast`), and
  for a DeepGEMM kernel every row at most at its pipeline's bytes in flight over the HBM
  latency, :func:`pipeline_rate`); a tile costs ``main(k)`` plus its fixed prologue /
  epilogue :attr:`GemmKernels.tile_fixed`;
* a DeepGEMM kernel's whole arithmetic and operand traffic at most at its power budget
  (:func:`power_seconds`: the clock falls as the bytes per FLOP grow);
* tile and wave quantisation: ``tiles = batch ceil(m / tm) ceil(n / tn)`` run in
  ``ceil(tiles / S)`` waves, for the best tile of the generation's list
  (:attr:`GemmKernels.tiles`, what cuBLAS's heuristics pick from; DeepGEMM's own choice for
  its formats, :func:`deepgemm_config`);
* the kernel's epilogue grows with its output: the last wave's C tiles are written after
  their main loops at :attr:`GemmKernels.write` of the HBM bandwidth (``min(tiles, S) tm tn
  b_out / (w W)``, the drain no later tile hides);
* stream-K and split-K (:func:`schedule_seconds`, CUTLASS's sm90 stream-K decomposition): from
  :data:`STREAM_K_WAVES` full waves on, the last partial wave's and the previous wave's tiles'
  k-iterations are spread over all SMs; a single partial wave whose k is deep
  (``k >= split_k_depth sqrt(batch m n)``, :attr:`GemmKernels.split_k_depth`) is split over
  k; either way each unit covers at least 8 k-blocks, and the fp32 partial sums of a split
  tile are written and read back (``tm tn 4`` bytes per piece at the operand rate);
* memory-bound GEMMs (few rows: decode, an expert receiving few tokens) are priced by their
  bytes: the operands ``(m k + k n) b`` per batch at :attr:`GemmKernels.memory` of the HBM
  bandwidth (DeepGEMM's kernels at :attr:`GemmKernels.deepgemm_memory`) and the output
  ``m n b_out`` at :attr:`GemmKernels.write` of it;
* ``t = pnorm(compute, memory, p_roof) + launch`` (a roofline per GEMM whose two limits overlap
  imperfectly, :attr:`GemmKernels.roofline_p`, plus the kernel's launch,
  :attr:`GemmKernels.launch`).

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
from math import ceil, gcd, sqrt

from parcompile.analysis.efficiency import efficiency, engine
from parcompile.config.presets import CLUSTER_PRESETS, fp8_peak
from parcompile.ir.fp8 import enabled


@dataclass(frozen=True)
class GemmKernels:
    """One GPU generation's GEMM kernels (module docstring): candidate output ``tiles``
    (rows, cols), the fraction ``mainloop`` of the datasheet peak a tile's arithmetic runs at
    per format (``"16"``: bf16 / fp16; ``"tensorwise"``, ``"rowwise"``, ``"blockwise"``,
    ``"mxfp8"``: FP8 GEMMs by scaling, of the FP8 / MXFP8 peak), the operand ``feed`` into an
    SM (bytes/s per SM), the ``memory`` fraction of the HBM bandwidth a streaming GEMM's
    operands reach, the fixed seconds per kernel ``launch``, the ``source`` of each number,
    the fixed seconds per tile ``tile_fixed`` (its prologue and epilogue), the fraction
    ``write`` of the HBM bandwidth the output is written at, the ``split_k_depth`` from which
    a one-wave GEMM is split over k (0: never), the formats ``deepgemm`` runs (DeepGEMM's
    tiles, no stream-K), the HBM ``latency`` its pipeline hides (seconds), the fraction
    ``deepgemm_memory`` of the HBM bandwidth its streaming reaches (0: ``memory``), the
    exponent ``roofline_p`` of the :func:`pnorm` that joins a GEMM's compute and memory times
    (0: their maximum), and the power budget of the ``deepgemm`` kernels (:func:`power_seconds`):
    ``power_peak``, the fraction of the datasheet peak the SMs reach at their highest clock with
    no operand traffic (0: no power bound), and ``power_byte``, the operand bytes/s the budget
    sustains alone."""

    tiles: tuple[tuple[int, int], ...]
    mainloop: dict
    feed: float
    memory: float
    launch: float
    source: str
    tile_fixed: float = 0.0
    write: float = 1.0
    split_k_depth: float = 0.0
    deepgemm: tuple[str, ...] = ()
    latency: float = 0.0
    deepgemm_memory: float = 0.0
    roofline_p: float = 0.0
    power_peak: float = 0.0
    power_byte: float = 0.0


_HOPPER_SRC = (
    "mainloop 16, tensorwise and blockwise, feed, memory, deepgemm_memory, write, launch, tile_fixed, latency, "
    "split_k_depth, roofline_p: fitted together (one set, no row apart; issue 48's third fit: the fewest rows "
    "outside 10%, then the least squared error) to three sources of measured GEMMs on the GH100 (132 SMs): bf16, "
    "OpenXLA's H100 matmul table (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/"
    "matmul_interpolator_data.h at 372d578, key sm_90, cuBLAS via XLA, b x m x n x k from 256 to 4096); FP8 "
    "with 1x128 / 128x128 block scales, DeepGEMM's README tables on the H800 SXM5 (deepseek-ai/DeepGEMM "
    "README.md at 55ab91f: normal and grouped GEMMs by M, N, K, TFLOPS; timed per kernel by its bench_kineto, so "
    "without the launch; its masked rows with every group m rows, tests/test_core.py at 55ab91f); tensorwise "
    "FP8 between stas00/ml-engineering's MAMF rows (compute/accelerator/README.md at 744d01e: H100 SXM 1,402.6 "
    "TFLOP/s at 1024x9216x14336, the model 10% higher; H200 SXM 1,453.4 at 1280x4096x12032, 16% lower, its 2.4 "
    "waves priced as 3; bf16 H100 794.5 at 2048x2048x13312); memory 0.93 over a roofline p-norm of 5.7 (a "
    "streaming GEMM alone reaches 0.93 of the HBM; where its compute time is close it is stretched: the "
    "4x4096x256x2048 row, 2.73 TB/s over all its bytes), deepgemm_memory 0.72 (DeepGEMM's README GB/s "
    "column: 0.63-0.80 of the 3.35 TB/s on its memory-bound small-M rows); tiles: the Hopper warp-specialised "
    "kernels' 64-256 x 32-256 output tiles (CUTLASS sm90 collective builders); stream-K: CUTLASS's sm90 "
    "decomposition (include/cutlass/gemm/kernel/tile_scheduler_params.h at 0046e36: the tail and one full wave, "
    "min_iters_per_sk_unit_ = 8) from 4 waves on (STREAM_K_WAVES); split_k_depth 13: where the XLA table shows "
    "cuBLAS splitting k (256x256x4096 split, 512x256x4096 and 256x256x2048 not); deepgemm (blockwise): "
    "DeepGEMM's get_best_configs at 55ab91f (deep_gemm/jit_kernels/gemm.py: BLOCK_M 64 for m <= 64 else 128, "
    "128 for a contiguous grouped GEMM, "
    "BLOCK_N 16-128 by 8, 144 and 160, fewest waves then the fullest last wave then the smaller BLOCK_N; 4-8 "
    "pipeline stages by shared memory; TMA multicast of 2 for m >= 512 and one group); DeepGEMM's power budget "
    "(power_seconds): power_peak 1980/1830, the SMs' highest clock over the one the tensor peaks count, not "
    "fitted (NVIDIA's H100 SXM figures, datasheet 67 and 1,979 TFLOPS with sparsity, Hopper whitepaper 66.9 and "
    "989.4: 66.9 TFLOPS FP32 = 16,896 cores x 2 x 1.98 GHz; 989.4 TFLOPS bf16 dense / (528 tensor cores x "
    "1,024) = 1.83 GHz), power_byte 18.75 TB/s of operands and blockwise 0.709 refitted on DeepGEMM's 28 rows "
    "(session 24: 1 outside 10%, was 2; mean |error| 4.6%, was 5.7%; the bound slows the masked groups without "
    "multicast, which let the mainloop rise), judged on the per-shape tables of DeepGEMM pull requests 74 and 81 "
    "(17 H800 rows, 128 x 128 and 128 x 160 tiles; 2 outside 10%, was 8, by the mainloop's rise); rowwise: "
    "0.55, torchao's "
    "rowwise-scaled CUTLASS GEMM, fitted with fp8_rowwise_clock on the torchtitan float8 rowwise rows; mxfp8 "
    "(not on Hopper) as tensorwise")
_AMPERE_SRC = (
    "mainloop: stas00/ml-engineering's MAMF table (compute/accelerator/README.md at 744d01e: A100 SXM "
    "bf16 271.2 of "
    "312 TFLOPS at 1024x10240x5120, torch 2.6; the model 268) over the model's own tile overheads; launch, "
    "tile_fixed: hopper's first fit (assumed); feed: 120 GB/s per SM, chosen with efficiency.py's gemm_clock "
    "on the A100 rows of analysis/calibration.py (60-400 GB/s move their mean error by 0.8%); memory: "
    "STREAM-like 0.80; write: as memory (assumed); no split-K (no calibration rows); tiles: CUTLASS sm80's "
    "64-256 x 64-256 threadblock tiles")
_BLACKWELL_SRC = (
    "mainloop: stas00/ml-engineering's MAMF table (compute/accelerator/README.md at 744d01e: B200 SXM "
    "bf16 1,745 of 2,250 TFLOPS, 77.6%, at 1792x16128x3072) over the model's tile overheads; FP8 / MXFP8 "
    "the same fraction of their peak (assumed; the table's B200 FP8 row, 3,432.5 TFLOPS at "
    "15360x4096x3072, is within 2% of it: tests/test_gemm_rate.py); tiles: "
    "tcgen05's 128-256 x 64-256 (two-SM) tiles; feed 150 GB/s per SM, memory 0.80, launch 4 us: assumed "
    "(no Blackwell GEMM row fitted; not hopper's, whose first fit, b8717bb, had 109 GB/s, 1.0, 3.5 us); "
    "write as memory (assumed)")

#: the Hopper GEMM kernels' output tiles (CUTLASS's sm90 warp-specialised kernels: M 64, 128 or 256,
#: one, two or four 64-row WGMMAs; N 32 to 256), largest first (the bound in :func:`gemm_seconds`
#: then skips more)
_HOPPER_TILES = ((128, 256), (256, 128), (64, 256), (128, 128), (64, 128), (128, 64), (64, 64), (64, 32))

#: kernel facts per GPU generation (:class:`GemmKernels`); :data:`GENERATION` maps the presets
KERNELS: dict[str, GemmKernels] = {
    "ampere": GemmKernels(((64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128)),
                          {"16": 0.89}, 120e9, 0.80, 3.5e-6, _AMPERE_SRC, 1.8e-6, 0.80),
    "hopper": GemmKernels(_HOPPER_TILES,
                          {"16": 0.9175, "tensorwise": 0.8289, "blockwise": 0.709, "rowwise": 0.55,
                           "mxfp8": 0.8289}, 109.9e9, 0.93, 3.418e-6, _HOPPER_SRC, 1.509e-6,
                          0.6694, 13.18, ("blockwise",), 1.08e-6, deepgemm_memory=0.7219,
                          roofline_p=5.687, power_peak=1980 / 1830, power_byte=18.75e12),
    "blackwell": GemmKernels(((128, 64), (128, 128), (128, 256), (256, 128), (256, 256)),
                             {"16": 0.84, "tensorwise": 0.78, "blockwise": 0.80, "rowwise": 0.55,
                              "mxfp8": 0.78}, 150e9, 0.80, 4e-6, _BLACKWELL_SRC, 0.0, 0.80),
}
#: from this many full waves of tiles on, the last partial wave and the one before it are spread
#: over all SMs (stream-K); below it the tiles run in whole waves. CUTLASS's own heuristic splits
#: any tail under half a wave (tile_scheduler_params.h get_num_sk_tiles at NVIDIA/cutlass
#: 7107b05), one partial wave included: that puts 37 of test_gemm_rate's 78 XLA bf16 rows over
#: 10% fast; from one full wave on, it prices the H200 FP8 MAMF row within 10% but the H100 FP8
#: MAMF row at +10.0% and the torchtitan 8B FSDP+TP rows fast (benchmarks/cost_model.py: bf16
#: -9.0%, FP8 tensorwise +11.4%), all of them cuBLAS(Lt) GEMMs (issue 48): cuBLAS's choice lies
#: between the two
STREAM_K_WAVES = 4
#: CUTLASS's stream-K scheduler: the fewest k-blocks one stream-K (or split-K) unit computes
#: (tile_scheduler_params.h ``min_iters_per_sk_unit_``)
MIN_ITERS_PER_SK_UNIT = 8
#: bytes of one k-block of an operand row (CUTLASS sm90 / DeepGEMM: 64 bf16 or 128 FP8 elements)
K_BLOCK_BYTES = 128
#: bytes per element of a split tile's partial sums (fp32 accumulators)
PARTIAL_BYTES = 4
#: DeepGEMM's pipeline depths, deepest first (get_best_configs at 55ab91f: the most stages whose
#: shared memory fits, :func:`deepgemm_config`)
DEEPGEMM_STAGES = (8, 7, 6, 5, 4)
#: DeepGEMM's BLOCK_N candidates (get_best_configs at 55ab91f: 16 to 128 by 8, then 144 and 160)
DEEPGEMM_BLOCK_N = tuple(range(16, 129, 8)) + (144, 160)
#: shared memory one SM90 thread block may use, bytes (get_best_configs' ``sm90_capacity``)
SM90_SMEM = 232448

#: cluster preset -> GPU generation (:data:`KERNELS`)
GENERATION = {"a100-40gb": "ampere", "a100-80gb": "ampere", "h100-sxm": "hopper", "h200": "hopper",
              "b200": "blackwell", "gb200-nvl72": "blackwell"}


def deepgemm_config(m: int, n: int, k: int, batch: int, sms: int, masked: bool = False) -> tuple[int, int, int]:
    """DeepGEMM's output tile and pipeline depth (BLOCK_M, BLOCK_N, stages) for ``batch`` GEMMs
    of ``m x n`` over ``k`` FP8 elements on ``sms`` SMs (deepseek-ai/DeepGEMM
    deep_gemm/jit_kernels/gemm.py get_best_configs and get_smem_size at 55ab91f, the commit of
    the README tables the model is held to): BLOCK_M 64 for ``m <= 64`` else 128, but always
    128 for several groups in the contiguous layout (``batch > 1``, not ``masked``: its
    ``is_grouped_contiguous`` call, rows aligned to get_m_alignment_for_contiguous_layout's 128); of
    :data:`DEEPGEMM_BLOCK_N`, the fewest waves of tiles, then the fullest last wave, then the
    smallest BLOCK_N; the most of :data:`DEEPGEMM_STAGES` whose shared memory (a bf16 output tile,
    per stage an A and a B k-block of 128 and A's fp32 scales, B's scales over k, doubled where
    BLOCK_N does not divide 128) fits :data:`SM90_SMEM`; 4 stages only where BLOCK_N does not
    divide 128 and ``128 / gcd(128, BLOCK_N) <= 4`` (the code-size rule). The groups' tiles are
    ranked together: the masked kernel's ``num_groups`` times one group's, the contiguous one's
    single GEMM over the groups' aligned rows (the same count)."""
    bm = 64 if m <= 64 and (masked or batch == 1) else 128

    def rank(bn: int) -> tuple[int, int, int]:
        tiles = batch * ceil(m / bm) * ceil(n / bn)
        return ceil(tiles / sms), -(tiles % sms or sms), bn
    bn = min(DEEPGEMM_BLOCK_N, key=rank)
    return bm, bn, deepgemm_stages(bm, bn, k)


def deepgemm_stages(bm: int, bn: int, k: int) -> int:
    """DeepGEMM's pipeline depth for a ``bm x bn`` tile over ``k`` (get_best_configs and
    get_smem_size at 55ab91f, :func:`deepgemm_config`): the most of :data:`DEEPGEMM_STAGES` whose
    shared memory fits :data:`SM90_SMEM`, 4 only where ``bn`` does not divide 128 and
    ``128 / gcd(128, bn) <= 4``."""
    stages = DEEPGEMM_STAGES
    if 128 % bn and 128 // gcd(128, bn) <= 4:
        stages = (4,)
    b_scales = ceil(k / 128) * 4 * (1 if 128 % bn == 0 else 2)
    for depth in stages:
        smem = bm * bn * 2 + depth * (bm * 128 + bm * 4 + bn * 128) + ceil(b_scales / 8) * 8 + depth * 16
        if smem <= SM90_SMEM:
            return depth
    return stages[-1]


def deepgemm_multicast(m: int, n: int, bm: int, bn: int, groups: int, sms: int) -> tuple[int, int]:
    """How many SMs share each A and each B tile a DeepGEMM GEMM loads (get_best_configs at
    55ab91f: TMA multicast over a cluster of 2, for ``m >= 512`` and one group, on the larger
    block's side first where that side's dimension holds whole pairs of blocks): (A, B)."""
    if m < 512 or groups != 1 or sms % 2:
        return 1, 1
    legal = {"A": n % (2 * bn) == 0, "B": m % (2 * bm) == 0}
    for side in ("A", "B") if bm > bn else ("B", "A"):
        if legal[side]:
            return (2, 1) if side == "A" else (1, 2)
    return 1, 1


def pipeline_rate(kn: GemmKernels, fmt: str, tm: int, tn: int, clock: float, stages: int) -> float:
    """Bytes/s of operands one SM's pipeline can have arrive for a ``tm x tn`` tile: for a
    DeepGEMM format its ``stages`` k-blocks of ``tm + tn`` rows in flight over the HBM latency
    (Little's law, :attr:`GemmKernels.latency`; :func:`deepgemm_config`), which bounds the
    small-M tiles (64 x 16-48); unbounded for the other kernels (their ``feed`` bounds them)."""
    if fmt in kn.deepgemm and kn.latency:
        return stages * (tm + tn) * K_BLOCK_BYTES * clock / kn.latency
    return float("inf")


def pnorm(a: float, b: float, p: float) -> float:
    """``max(a, b)`` where ``p`` is 0, else the p-norm ``(a^p + b^p)^(1/p)``: two limits that
    overlap imperfectly (the closer they are, the more the slower one is exceeded: by
    ``2^(1/p)`` where equal)."""
    if not p:
        return max(a, b)
    hi = max(a, b)
    return hi * (1 + (min(a, b) / hi) ** p) ** (1 / p) if hi > 0 else 0.0


def power_seconds(kn: GemmKernels, flops: float, fetched: float, peak: float, clock: float = 1.0) -> float:
    """Seconds the power budget allows a DeepGEMM kernel (:attr:`GemmKernels.deepgemm`) for
    ``flops`` of its tiles' arithmetic (padding included) and ``fetched`` bytes of operands its
    SMs load (a multicast tile once per cluster), ``peak`` the format's datasheet FLOP/s and
    ``clock`` as in :func:`gemm_seconds`: the energy of both against the budget,
    ``(flops / (power_peak peak) + fetched / power_byte) / clock``
    (:attr:`GemmKernels.power_peak`, :attr:`GemmKernels.power_byte`); 0 where the generation
    sets no ``power_peak``.

    Under the power cap the SMs' clock falls as the operand traffic grows, so a wider tile (fewer
    bytes per FLOP) or a multicast runs faster than the same arithmetic fed with more bytes. The
    bound only adds time (:func:`gemm_seconds` takes the larger of it and the waves): a kernel
    fetching many bytes per FLOP (the masked layout's groups, without multicast) runs slower than
    its waves say; the bound counts the kernel's tiles, not its waves, so a last partial wave adds
    only its own tiles to it. Sources: DeepGEMM's
    128 x 160 tiles against its 128 x 128, "to alleviate L2 cache pressure", 5-27% faster on the
    H800 (deepseek-ai/DeepGEMM pull request 74, opened 2025-03-25), and its author's account of
    the 256 x 128 tile (pull request 81: fewer L2 and HBM accesses "enhance the SM's
    computational frequency"); in DeepGEMM's README rows at 55ab91f, one masked group of 1,024
    rows (multicast) runs 1,233 TFLOP/s and two of 512 (no multicast) 1,040."""
    if not kn.power_peak:
        return 0.0
    return (flops / (kn.power_peak * peak) + fetched / kn.power_byte) / clock


def schedule_seconds(tiles: int, k: int, sms: int, tile, partial: float, k_blocks: int, split_k: bool,
                     stream_k: bool = True) -> float:
    """Seconds of ``tiles`` output tiles over ``sms`` SMs, ``tile(kk)`` the seconds of one
    tile over ``kk`` of k and ``partial`` those of one fp32 partial tile written or read:
    data-parallel waves, or (CUTLASS's sm90 stream-K heuristic, tile_scheduler_params.h
    get_num_sk_tiles / get_num_sk_units at 0046e36) from :data:`STREAM_K_WAVES` full waves on
    the last partial wave spread with the wave before it over all SMs (``stream_k``), or a single partial
    wave split over k (``split_k``), each unit at least :data:`MIN_ITERS_PER_SK_UNIT` of the
    ``k_blocks``, each split tile's partial sums written and read back."""
    full, tail = divmod(tiles, sms)
    best = (full + (tail > 0)) * tile(k)
    if not tail or k_blocks <= MIN_ITERS_PER_SK_UNIT:
        return best
    if stream_k and full >= STREAM_K_WAVES:
        sk = tiles - (full - 1) * sms
        units = min(sms, sk * k_blocks // MIN_ITERS_PER_SK_UNIT)
        pieces = units / sk
        best = min(best, (full - 1) * tile(k) + tile(sk * k / units) + (pieces * partial if pieces > 1 else 0.0))
    if split_k and not full:
        splits = min(sms, tiles * k_blocks // MIN_ITERS_PER_SK_UNIT) // tiles
        if splits > 1:
            best = min(best, tile(k / splits) + splits * partial)
    return best


@lru_cache(maxsize=1 << 16)
def gemm_seconds(m: int, n: int, k: int, batch: int, peak: float, sms: int, hbm_bw: float, kernels: str,
                 fmt: str = "16", in_bytes: int = 2, out_bytes: int = 2, clock: float = 1.0,
                 masked: bool = False) -> float:
    """Seconds of ``batch`` GEMMs ``[m, k] x [k, n]`` (module docstring's formula) on a GPU of
    ``sms`` SMs, dense peak ``peak`` FLOP/s for the format (16-bit, or the FP8 / MXFP8 peak)
    and ``hbm_bw`` bytes/s, with :data:`KERNELS` ``[kernels]`` at format ``fmt``; operands of
    ``in_bytes``, output of ``out_bytes`` per element; ``clock``: the SMs' clock over the one
    the kernel facts were measured at (a power-limited or throttled part: the arithmetic, the
    operand feed and the per-tile time scale with it, the HBM does not); ``masked``: DeepGEMM's
    ``batch`` GEMMs in its masked grouped layout (else, ``batch > 1``, its contiguous one:
    :func:`deepgemm_config`). 0 for an empty GEMM. Cached by shape.

    Raises:
        KeyError: ``kernels`` or ``fmt`` is not in :data:`KERNELS`."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    kn = KERNELS[kernels]
    per_sm = kn.mainloop[fmt] * peak * clock / sms
    fixed, drain_bw, feed = kn.tile_fixed / clock, kn.write * hbm_bw, kn.feed * clock
    dg = fmt in kn.deepgemm
    split_k = not dg and kn.split_k_depth > 0 and k >= kn.split_k_depth * sqrt(batch * m * n)
    k_blocks = ceil(k * in_bytes / K_BLOCK_BYTES)
    best = float("inf")
    configs = (deepgemm_config(m, n, k, batch, sms, masked),) if dg else ((tm, tn, 0) for tm, tn in kn.tiles)
    for tm, tn, stages in configs:
        tiles = batch * ceil(m / tm) * ceil(n / tn)
        drain = min(tiles, sms) * tm * tn * out_bytes / drain_bw
        if drain + 2 * tm * tn * k * tiles / (per_sm * sms) >= best:
            continue   # no schedule beats the tiles' arithmetic spread evenly over the SMs (the power bound only adds)
        # the masked kernel asks with one group's m and the groups, the contiguous one with the
        # groups' rows aligned to BLOCK_M (128) as one GEMM (m_grouped_gemm.py at 55ab91f)
        ca, cb = deepgemm_multicast(m if masked else batch * ceil(m / tm) * tm, n, tm, tn, batch if masked else 1,
                                    sms) if dg else (1, 1)
        # seconds per element of k: the operands fetched into the SM (a multicast tile once per
        # cluster) at its feed, and every row its pipeline holds within the latency bound
        per_k = max((tm / ca + tn / cb) * in_bytes / feed,
                    (tm + tn) * in_bytes / pipeline_rate(kn, fmt, tm, tn, clock, stages))

        def tile(kk: float, tm=tm, tn=tn, per_k=per_k) -> float:
            return max(2 * tm * tn * kk / per_sm, per_k * kk) + fixed
        sched = schedule_seconds(tiles, k, sms, tile, tm * tn * PARTIAL_BYTES / feed, k_blocks, split_k, not dg)
        if dg and kn.power_peak:
            sched = max(sched, power_seconds(kn, 2 * tm * tn * k * tiles, (tm / ca + tn / cb) * in_bytes * k * tiles,
                                             peak, clock))
        best = min(best, drain + sched)
    stream = kn.deepgemm_memory if dg and kn.deepgemm_memory else kn.memory
    memory = batch * ((m * k + k * n) * in_bytes / (stream * hbm_bw) + m * n * out_bytes / drain_bw)
    return pnorm(best, memory, kn.roofline_p) + kn.launch


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
