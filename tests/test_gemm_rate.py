"""The GEMM-rate model (parcompile/analysis/gemm.py) against published per-shape GEMM
measurements, one test per source: each row typed from its table (TFLOP/s), the model's rate
for the same shape, dtype and GPU within 10%. The rows the model still misses by more are listed
apart (``*_MISSED``) with why, and held within 20% so that a change that makes them worse still
fails. DeepGEMM's tables are here whole (28 rows); OpenXLA's H100 table has 375 bf16 rows (b 1, 2,
4; m, n, k 256 to 4096), of which 78 are here: the first 40 typed for the first fit, 38 more read
after it (review, issue 48) to see whether the sample hid misses. Issue 48's second fit (a tile's
prologue / epilogue and the output drain, CUTLASS's stream-K and split-K with their partial sums,
DeepGEMM's own tiles and pipeline) brought 15 of the 19 rows missed before within 10% (was: 7 XLA
rows 11-17% fast, the split-K row at half its rate, 9 DeepGEMM rows 10-22%, both GH100 FP8 MAMF
rows 13-15%); 9 of 114 rows were missed after it, by 10-19%. The third (session 23): DeepGEMM's
tiles, pipeline depths and TMA multicast as its source at the README's commit chooses them (BLOCK_N
144 and 160, the smaller BLOCK_N on a tie, 4-8 stages by shared memory: the model had BLOCK_N up to
128, the larger on a tie, 8 stages), the masked rows as that commit benchmarks them (every group
``m`` rows: the model had priced a random draw of a later test), a roofline whose compute and memory
limits overlap imperfectly (a p-norm) and DeepGEMM's own streaming fraction of the HBM (its README's
GB/s column: 0.67-0.80 of it on the memory-bound rows), then every Hopper number refitted together:
4 of 114 rows are missed, by 12-16% (mean |error| 4.5%, was 5.2%). The fourth (session 24): a
DeepGEMM kernel's power budget (gemm.py power_seconds: under the power cap the clock falls as the
operand bytes per FLOP grow, so a kernel that fetches more bytes per FLOP, a masked layout's groups
without TMA multicast, runs slower than its waves alone say), its two numbers and the blockwise
mainloop refitted on DeepGEMM's 28 rows: 3 of 114 are missed (DeepGEMM 1 of 28, was 2; mean |error|
over them 4.6%, was 5.7%). The bound slows 5 of the 28 rows (the masked 4 x 256 and 2 x 512 of n 4096
by 5% and 11%, the three of k 16384 by at most 1.4%); it is what let the mainloop rise
0.677 -> 0.709 (without it that mainloop puts the masked 2 x 512 row at +16%), and the rise is
what brought the wide-tile rows up (4096 x 4096 x 7168 -12% -> -8%). Per-shape tables
DeepGEMM's contributors published on the H800 with the tile they ran (pull requests 74 and 81)
judge it, never fitted on (:data:`DEEPGEMM_PR_H800_FP8`).

Each source is compared as it measured: DeepGEMM's rows without the launch (its bench_kineto
times the kernel alone), MAMF's with the output in the operands' dtype (mamf-finder.py writes
``out=C``, C of the benchmarked dtype, so FP8 rows write 1-byte outputs). Both flush the L2
before each timed run (DeepGEMM deep_gemm/utils.py bench_kineto ``flush_l2`` at 55ab91f;
stas00/ml-engineering compute/accelerator/benchmarks/mamf-finder.py benchmark_mm at 744d01e:
a 256 MiB ``l2_cache.zero_()``); OpenXLA's generator does not, but alternates two argument
sets "to prevent caching" and copies each run's arguments to the device before it
(tensorflow/tensorflow third_party/xla/xla/tools/matmul_perf_table_gen.cc at 02e4039
MatmulPerfTableGen::Profile and Measure: args_small / args_large, the profiler's median kernel
time over 5 rounds of the two; a later version of the generator than the table at 372d578;
openxla/xla xla/service/hlo_runner.cc at f52c7af HloRunner::ExecuteWithExecutable:
TransferLiteralsToDevice per call). The H100's L2 is 50 MiB (stas00/ml-engineering
compute/accelerator/README.md at 744d01e, "Caches")."""

import pytest

from parcompile.analysis.gemm import KERNELS, STREAM_K_WAVES, GemmKernels, gemm_seconds

H100 = dict(peak=989e12, sms=132, hbm_bw=3.35e12, kernels="hopper")     # config/presets.py h100-sxm
H100_FP8 = dict(H100, peak=1979e12)
A100 = dict(peak=312e12, sms=108, hbm_bw=2.039e12, kernels="ampere")    # config/presets.py a100-80gb


def rate(m, n, k, batch=1, fmt="16", in_bytes=2, launch=True, out_bytes=2, masked=False, **gpu) -> float:
    """TFLOP/s of the model for ``batch`` GEMMs [m, k] x [k, n], ``out_bytes`` per output
    element; ``launch`` False: the kernel alone (a profiler's kernel time, without the launch)."""
    t = gemm_seconds(m, n, k, batch, gpu["peak"], gpu["sms"], gpu["hbm_bw"], gpu["kernels"], fmt, in_bytes,
                     out_bytes, masked=masked)
    return 2 * batch * m * n * k / (t - (0.0 if launch else KERNELS[gpu["kernels"]].launch)) / 1e12


# OpenXLA's measured matmul table, H100 (key "sm_90"), bf16 x bf16 -> bf16, cuBLAS through XLA:
# tensorflow/tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at
# 372d578bb861cc5804e56d37d93aec931a59762c (flops in FLOP/s; here TFLOP/s). (b, m, n, k, TFLOP/s)
XLA_H100_BF16 = [
    (2, 256, 2048, 2048, 332.2), (2, 1024, 2048, 1024, 493.4), (1, 256, 2048, 4096, 285.9),
    (2, 512, 2048, 2048, 525.3), (4, 1024, 2048, 2048, 712.7), (1, 2048, 2048, 2048, 632.0),
    (1, 4096, 4096, 256, 392.2), (2, 2048, 4096, 1024, 678.7), (2, 4096, 4096, 2048, 763.0),
    (1, 4096, 4096, 4096, 783.3), (1, 512, 4096, 1024, 373.3), (1, 256, 1024, 4096, 172.3),
    (1, 4096, 2048, 512, 447.0), (4, 4096, 1024, 1024, 673.8), (2, 4096, 1024, 4096, 750.6),
    (1, 2048, 1024, 2048, 523.3), (2, 4096, 2048, 4096, 783.2), (1, 1024, 2048, 2048, 524.3),
    (1, 1024, 4096, 4096, 738.5), (4, 4096, 2048, 2048, 759.3), (1, 2048, 4096, 4096, 753.6),
    (1, 4096, 512, 2048, 521.7), (1, 256, 4096, 1024, 225.2), (2, 4096, 4096, 1024, 693.0),
    (1, 512, 4096, 2048, 522.2), (1, 1024, 1024, 1024, 236.3), (1, 4096, 1024, 2048, 632.0),
    (4, 1024, 4096, 4096, 773.5), (1, 256, 512, 4096, 91.7), (1, 256, 256, 256, 6.45),
    (1, 512, 256, 512, 21.8), (1, 2048, 256, 2048, 216.1),
]
#: short-k (256-512) and thin-n shapes the first fit priced 11-17% fast (its tile prologue and
#: epilogue were one fixed time per tile), within 10% since the output drain (issue 48)
XLA_H100_BF16_SHORT_K = [
    (1, 1024, 2048, 256, 139.5), (1, 4096, 512, 512, 238.8), (1, 4096, 1024, 512, 343.7),
    (2, 2048, 256, 4096, 378.6), (1, 2048, 2048, 512, 345.5), (2, 4096, 1024, 256, 301.6),
]
#: rows of the same table read after the first fit (see the module docstring)
XLA_H100_BF16_LATER = [
    (4, 512, 256, 256, 42.37), (1, 256, 2048, 256, 41.84), (2, 2048, 256, 512, 139.23),
    (4, 2048, 1024, 2048, 710.6), (1, 4096, 1024, 1024, 488.06),
    (1, 4096, 4096, 512, 543.1), (1, 256, 4096, 4096, 412.0), (1, 512, 512, 512, 40.7),
    (1, 1024, 1024, 512, 145.6), (4, 256, 256, 4096, 171.6), (2, 1024, 1024, 4096, 649.6),
    (1, 2048, 512, 4096, 451.2), (1, 512, 1024, 512, 80.5), (2, 512, 512, 256, 43.35),
    (1, 1024, 512, 4096, 298.9), (4, 256, 256, 2048, 117.7), (1, 256, 256, 1024, 19.46),
    (1, 256, 512, 256, 11.46), (2, 256, 256, 256, 11.55), (2, 256, 256, 4096, 91.3),
    (1, 512, 256, 4096, 91.06), (1, 256, 256, 2048, 31.13), (2, 256, 256, 2048, 60.35),
    (1, 512, 512, 4096, 174.5), (2, 512, 256, 4096, 168.6), (1, 256, 512, 2048, 62.37),
    (1, 512, 256, 2048, 60.13), (4, 512, 256, 4096, 293.05), (2, 256, 512, 4096, 175.2),
    (1, 1024, 256, 4096, 169.7), (1, 256, 256, 512, 11.46), (1, 512, 512, 2048, 114.7),
    (1, 512, 512, 1024, 71.2), (1, 256, 512, 1024, 39.1), (1, 1024, 256, 2048, 113.2),
]
#: the row the model misses by 13% (fast): 1024 x 256 x 1024 in 7.86 us, where its neighbours in k
#: (2048: 9.48 us, 4096: 12.65 us) put the fixed part at about 6.3 us; the model's best tile (64 x 32:
#: 128 tiles, one wave, operand-feed bound) costs 7.0 us, and a 64 x 64 tile 7.6 us (within 4%): the
#: cuBLAS heuristic is not the model's best-tile oracle here. Not noise: another run of the same
#: generator (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h
#: at 9bebee8, key sm_90, "BF16xBF16->BF16") has it at 67.9, and its transposes differ: 256 x 1024 x
#: 1024 at 73.7 and 512 x 512 x 1024 at 72.5, where the model, symmetric in m and n, puts all three
#: at 77.2 (cuBLAS, column-major, sees n as its M: which tile it runs for which orientation is the
#: fact the model lacks; benchmarks/gemm_gpu.py names it on a GPU)
XLA_H100_BF16_MISSED = [(1, 1024, 256, 1024, 68.3)]
#: rows missed before issue 48's third fit and within 10% since: 4096 x 256 x 2048 in 4 batches
#: (memory-bound: 79.7 MB in 29.2 us, 2.73 TB/s; was -19% with the reads at 0.76 of the HBM and the
#: output after them), the one-wave long-k shape cuBLAS splits over k (split-K, was -11%), two
#: 64-row-tile shapes (+11.5%, -10%) and 4096^3 in 4 batches (+11.5%)
XLA_H100_BF16_THIRD_FIT = [
    (4, 4096, 256, 2048, 588.7), (1, 256, 256, 4096, 84.3), (1, 512, 1024, 4096, 309.6),
    (4, 4096, 4096, 4096, 793.13),
]

# DeepGEMM's README tables, FP8 (E4M3, 1x128 activation and 128x128 weight scales) on the
# H800 SXM5 (the H100 SXM5's GH100 compute and HBM3), NVCC 12.8: deepseek-ai/DeepGEMM README.md
# at 55ab91f72f76e8a6db0e86282c3169a88d93df1b, "Normal GEMMs for dense models" (groups 1),
# "Grouped GEMMs for MoE models" (contiguous layout) and (masked layout). Timed per kernel
# (tests/test_core.py: bench_kineto, the profiler's kernel time), so without the launch.
# (layout, groups, m per group, n, k, TFLOP/s)
DEEPGEMM_H800_FP8 = [
    ('normal', 1, 64, 24576, 1536, 289), ('normal', 1, 64, 4096, 7168, 287),
    ('normal', 1, 128, 24576, 1536, 535), ('normal', 1, 128, 32768, 512, 358),
    ('normal', 1, 128, 4096, 7168, 533), ('normal', 1, 4096, 24576, 1536, 1125),
    ('normal', 1, 4096, 7168, 2048, 1168),
    ('contiguous', 4, 8192, 4096, 7168, 1346), ('contiguous', 4, 8192, 7168, 2048, 1214),
    ('contiguous', 8, 4096, 4096, 7168, 1346), ('contiguous', 8, 4096, 7168, 2048, 1214),
    ('masked', 1, 1024, 7168, 2048, 925),
    ('masked', 2, 512, 7168, 2048, 916), ('masked', 4, 256, 7168, 2048, 815),
    ('normal', 1, 128, 2112, 7168, 352), ('normal', 1, 64, 2112, 7168, 206),
    ('normal', 1, 64, 7168, 16384, 336), ('normal', 1, 64, 7168, 2048, 295),
    ('normal', 1, 128, 7168, 16384, 645), ('normal', 1, 128, 7168, 2048, 510),
    ('normal', 1, 4096, 7168, 16384, 1426), ('masked', 4, 256, 4096, 7168, 932),
    ('normal', 1, 4096, 32768, 512, 751),
    # missed before issue 48's third fit (-14%: priced as a random draw, +11%), within 10% since
    ('masked', 1, 1024, 4096, 7168, 1233), ('normal', 1, 64, 32768, 512, 219),
    # missed before the fourth fit (-12%: 7 waves of 128 x 160 tiles, the last 30% full, measured as
    # 6.6; +12%: two groups of 512 rows without multicast at 1,040 where one of 1,024 with it runs
    # 1,233), within 10% since: the higher mainloop (-12% -> -8%, the power bound not binding) and the
    # power bound, which prices the second group's fetched bytes (+12% -> +4%; +16% without it)
    ('normal', 1, 4096, 4096, 7168, 1265), ('masked', 2, 512, 4096, 7168, 1040),
]
#: the model misses by 14%: 4096 x 2112 x 7168 (fast: 128 x 144 tiles, 5 stages, B multicast over
#: 2 SMs, 480 tiles in 4 waves (the last 64% full): measured as if 4.95 waves of the model's tile's
#: main loop (24.9 us) ran, where the same model puts the normal and contiguous 128 x 160 rows at -8
#: to +1%; it was +9.4% before the fourth fit, whose higher mainloop speeds every tile (the power
#: bound does not bind here). The only BLOCK_N 144 row in the tables. A contributor's H800 run of
#: DeepGEMM's later main branch (pull request 168, 2025-08-20, its "before fix" table, BF16 output)
#: has this shape at 1,296 TFLOP/s (+28% over this row), but its other 4096-row shapes 4-25% over
#: theirs too (4096 x 4096 x 7168: 1,424, +13%), so it does not single out the 144-wide tile: why
#: the model misses this row is not known)
DEEPGEMM_H800_FP8_MISSED = [('normal', 1, 4096, 2112, 7168, 1009)]

# Held-out judges, never fitted on: per-shape tables DeepGEMM's contributors measured on the
# H800 SXM with the tile they forced, in pull requests of deepseek-ai/DeepGEMM by sazczmh:
# #74 (opened 2025-03-25, merged, "Larger BlockTile optimizations": base 128 x 128, opti 128 x 160:
# its normal rows and its first two contiguous rows, 4 groups; the table goes on with 8 groups, not
# typed: the stored copy of the description read at review ends there) and
# #81 (2025-04-08, CUDA 12.8.1: its base column, 128 x 160; its 256 x 128 kernel is not in the
# model). (layout, groups, m per group, n, k, BLOCK_N, TFLOP/s)
DEEPGEMM_PR_H800_FP8 = [
    ('normal', 1, 4096, 24576, 1536, 128, 999), ('normal', 1, 4096, 32768, 512, 128, 591),
    ('normal', 1, 4096, 7168, 16384, 128, 1404), ('normal', 1, 4096, 7168, 2048, 128, 1031),
    ('contiguous', 4, 8192, 4096, 7168, 128, 1317), ('contiguous', 4, 8192, 7168, 2048, 128, 1114),
    ('normal', 1, 4096, 24576, 1536, 160, 1166), ('normal', 1, 4096, 32768, 512, 160, 748),
    ('normal', 1, 4096, 7168, 16384, 160, 1470), ('normal', 1, 4096, 7168, 2048, 160, 1204),
    ('contiguous', 4, 8192, 4096, 7168, 160, 1381), ('contiguous', 4, 8192, 7168, 2048, 160, 1262),
    ('normal', 1, 4096, 24576, 1536, 160, 1162), ('normal', 1, 4096, 32768, 512, 160, 801),
    ('normal', 1, 4096, 7168, 16384, 160, 1451), ('normal', 1, 4096, 4096, 7168, 160, 1304),
    ('normal', 1, 4096, 7168, 2048, 160, 1185),
]


def deepgemm_rate(layout, g, m, n, k) -> float:
    """The model's TFLOP/s for a DeepGEMM row, its kernel alone. Every layout is ``g`` groups of
    exactly ``m`` rows: DeepGEMM's tests/test_core.py at 55ab91f times the masked layout with
    ``masked_m = m`` for every group ("Test performance with fixed shapes"; its random
    ``masked_m`` only checks correctness) and the contiguous layout as ``g * m`` rows."""
    return rate(m, n, k, g, "blockwise", 1, False, masked=layout == "masked", **H100_FP8)


# stas00/ml-engineering compute/accelerator/README.md at 744d01e18b79512572f64a6bbd8b5f4a725203a7,
# "Maximum Achievable Matmul FLOPS comparison table" (v2: the cache reset between runs; mean of 100
# iterations): the best shape found per accelerator and dtype. (gpu, fmt, operand bytes, m, n, k,
# TFLOP/s). The A100 and B200 bf16 rows set their generation's ``mainloop`` (gemm.py), the GH100's
# are fitted with the other Hopper sources; the B200 FP8 and both GB200 rows were read after it
# (review, issue 48): Blackwell's FP8 mainloop share is assumed equal to the bf16 one, and the
# GB200 differs from the B200 only in its preset's peak
B200 = dict(peak=2250e12, sms=148, hbm_bw=8e12, kernels="blackwell")      # config/presets.py b200
GB200 = dict(B200, peak=2500e12)                                          # config/presets.py gb200-nvl72
MAMF = [
    (A100, "16", 2, 1024, 10240, 5120, 271.2),          # A100 SXM, bf16, torch 2.6.0+cu126
    (H100, "16", 2, 2048, 2048, 13312, 794.5),          # H100 SXM, bf16, torch 2.7.0+cu126
    (H100_FP8, "tensorwise", 1, 1024, 9216, 14336, 1402.6),   # H100 SXM, float8_e4m3fn, torch 2.7.0+cu126
    (B200, "16", 2, 1792, 16128, 3072, 1745.0),         # B200 SXM, bf16, torch 2.7.1+cu128
    (dict(B200, peak=4500e12), "tensorwise", 1, 15360, 4096, 3072, 3432.5),   # B200, float8_e4m3fn
    (GB200, "16", 2, 4096, 9728, 2048, 1822.0),         # GB200, bf16, torch 2.10.0.dev20250916+cu130
    (dict(GB200, peak=5000e12), "tensorwise", 1, 19456, 5120, 1536, 3615.6),  # GB200, float8_e4m3fn
]
#: H200 SXM, float8_e4m3fn, torch 2.7.1+cu128 (the H100's GH100 compute, HBM 4.8 TB/s): -16% at
#: the H100's kernel facts (tensorwise 0.83, between it and the H100 FP8 row at +10%): its 320 tiles
#: of 128 x 128 (2.4 waves) priced as 3 whole waves. CUTLASS's own stream-K heuristic
#: (NVIDIA/cutlass include/cutlass/gemm/kernel/tile_scheduler_params.h at 7107b05,
#: get_num_sk_tiles: stream-K for the last two waves wherever the tail wave is under half full,
#: a single partial wave included) is not what cuBLAS does here (at issue 48's second fit): for one
#: partial wave it puts 37 of the 78 XLA bf16 rows 10-100% fast; from one full wave on it prices
#: this row at +3%, but the H100 FP8 row at +10.0%, and in benchmarks/cost_model.py the
#: torchtitan 8B FSDP+TP rows' weight-gradient GEMMs (4096 x 1792, 3.4 waves) faster: bf16 -7.6% -> -9.0% (goal: every H100 row
#: within 8%), FP8 tensorwise +9.5% -> +11.4% (goal 10%). All of these run cuBLAS(Lt) (torch.mm,
#: torch._scaled_mm in mamf-finder.py and in torchao's float8 linear), so the library does not tell
#: them apart; this row's cuBLAS (cu128) is newer than the H100 rows' (cu126), and its source says
#: rows on different torch / CUDA versions are not exactly comparable (compute/accelerator/
#: README.md at 744d01e, under the MAMF table)
MAMF_MISSED = [(dict(H100_FP8, hbm_bw=4.8e12), "tensorwise", 1, 1280, 4096, 12032, 1453.4)]


@pytest.mark.parametrize("b,m,n,k,tflops", XLA_H100_BF16 + XLA_H100_BF16_SHORT_K + XLA_H100_BF16_LATER
                         + XLA_H100_BF16_THIRD_FIT)
def test_xla_h100_bf16(b, m, n, k, tflops):
    assert rate(m, n, k, b, **H100) == pytest.approx(tflops, rel=0.10)


@pytest.mark.parametrize("layout,g,m,n,k,tflops", DEEPGEMM_H800_FP8)
def test_deepgemm_h800_fp8(layout, g, m, n, k, tflops):
    assert deepgemm_rate(layout, g, m, n, k) == pytest.approx(tflops, rel=0.10)


@pytest.mark.parametrize("gpu,fmt,nbytes,m,n,k,tflops", MAMF)
def test_mamf(gpu, fmt, nbytes, m, n, k, tflops):
    # C in the benchmarked dtype (module docstring): FP8 rows write 1-byte outputs
    assert rate(m, n, k, 1, fmt, nbytes, out_bytes=nbytes, **gpu) == pytest.approx(tflops, rel=0.10)


def test_missed_rows_stay_bounded():
    """The rows each source has that the model misses by more than 10% (listed with why)
    stay within 20%."""
    for b, m, n, k, tflops in XLA_H100_BF16_MISSED:
        assert rate(m, n, k, b, **H100) == pytest.approx(tflops, rel=0.20)
    for row in DEEPGEMM_H800_FP8_MISSED:
        assert deepgemm_rate(*row[:5]) == pytest.approx(row[5], rel=0.20)
    for gpu, fmt, nbytes, m, n, k, tflops in MAMF_MISSED:
        assert rate(m, n, k, 1, fmt, nbytes, out_bytes=nbytes, **gpu) == pytest.approx(tflops, rel=0.20)


def test_small_m_is_memory_bound():
    """Few rows: the time is at least the weights' bytes at the HBM rate, far above the
    arithmetic at the peak."""
    t = gemm_seconds(8, 8192, 8192, 1, 989e12, 132, 3.35e12, "hopper")
    assert t >= 8192 * 8192 * 2 / 3.35e12 > 10 * 2 * 8 * 8192 * 8192 / 989e12


def test_waves_stream_k_and_split_k(monkeypatch):
    """With one tile shape (128 x 128) and unbounded feed and HBM (the tiles' arithmetic alone):
    a row past a full wave of tiles costs a second wave (tile, then wave quantisation); from
    STREAM_K_WAVES waves on the last partial wave is spread with the one before it over the SMs
    (stream-K: the time grows with the tiles); a short k (8 k-blocks or fewer) is never split; a
    single partial wave with a deep k is split over k (split-K) only where the kernels split it
    (``split_k_depth``)."""
    def t(kernels, m, n, k):
        return gemm_seconds(m, n, k, 1, 989e12, 132, 1e18, kernels)
    monkeypatch.setitem(KERNELS, "one", GemmKernels(((128, 128),), {"16": 0.8}, 1e15, 1.0, 0.0, "test"))
    monkeypatch.setitem(KERNELS, "split", GemmKernels(((128, 128),), {"16": 0.8}, 1e15, 1.0, 0.0, "test",
                                                      split_k_depth=12.0))
    gemm_seconds.cache_clear()
    full = 132 * 128
    one = t("one", full, 128, 8192)
    assert t("one", full + 1, 128, 8192) == pytest.approx(2 * one)
    many = STREAM_K_WAVES * full
    assert t("one", many + 128, 128, 8192) == pytest.approx(one * (STREAM_K_WAVES + 1 / 132), rel=1e-4)
    assert t("one", many + 128, 128, 512) == pytest.approx((STREAM_K_WAVES + 1) * t("one", full, 128, 512), rel=1e-4)
    assert t("one", 256, 256, 8192) == pytest.approx(one)
    # 4 tiles of 128 k-blocks: 64 units of 8 k-blocks, 16 splits per tile
    assert t("split", 256, 256, 8192) == pytest.approx(one / 16, rel=1e-3)
    gemm_seconds.cache_clear()


def test_plan_names_the_gemm_rate_model():
    """A plan whose GEMMs the model timed says so in estimate.assumptions.gemm_rate (its
    generation, SMs, clock and sources); a cluster without kernel facts (cpu) has no such key.
    Was: only the flat rule's matmul_efficiency was reported, which priced none of the GEMMs."""
    from pathlib import Path

    import parcompile
    from parcompile.analysis.efficiency import EFFICIENCY

    plan = parcompile.compile(Path(__file__).resolve().parent.parent / "examples" / "llama3_8b_2x8_h100.par")
    got = plan.data["estimate"]["assumptions"]["gemm_rate"]
    assert (got["kernels"], got["sms"], got["clock"]) == ("hopper", 132, EFFICIENCY["h100-sxm"].gemm_clock)
    assert "matmul_interpolator_data.h at 372d578" in got["source"] and "gemm_clock" in got["source"]
    tiny = parcompile.compile(Path(__file__).resolve().parent.parent / "examples" / "tiny.par")
    assert "gemm_rate" not in tiny.data["estimate"]["assumptions"]


def test_grouped_gemm_as_its_library_schedules_the_experts():
    # one grouped kernel (streams 0: torch._grouped_mm, CUTLASS, DeepGEMM) schedules every
    # expert's tiles together; Transformer Engine's GroupedLinear runs one cuBLAS GEMM per expert,
    # expert i on stream i % 4 (multi_stream_cublas_gemm): rounds of 4 concurrent GEMMs
    from parcompile.analysis.gemm import gemm_seconds, grouped_gemm_seconds
    h100 = (989e12, 132, 3.35e12, "hopper")
    for m in (128, 1024, 4096):
        one = [gemm_seconds(m, 5760, 2880, b, *h100) for b in range(17)]
        assert grouped_gemm_seconds(m, 5760, 2880, 16, 0, *h100) == one[16]
        assert grouped_gemm_seconds(m, 5760, 2880, 16, 4, *h100) == pytest.approx(4 * one[4])
        assert grouped_gemm_seconds(m, 5760, 2880, 6, 4, *h100) == pytest.approx(one[4] + one[2])
        assert grouped_gemm_seconds(m, 5760, 2880, 3, 4, *h100) == one[3]
    # each of the 4 rounds pays its own launch, and where the GEMMs are compute-bound (512 rows per
    # expert and up: below, reading an expert's 16.6 MB of weights at HBM speed takes longer than its
    # 2 * 256 * 2880^2 FLOP at peak) its 4 kernels' tiles fill the SMs less well than 16 experts'
    # together: the per-expert GEMMs run slower than one grouped kernel by 3 launches where the
    # weights' bytes set the time (128 rows: within one more launch, the compute the roofline's
    # p-norm lets show through filling the SMs less well in rounds of 4), more where the tiles
    # count (256 rows and up: compute and memory times close, or compute-bound)
    launch = KERNELS["hopper"].launch
    t = {(m, s): grouped_gemm_seconds(m, 2880, 2880, 16, s, *h100) for m in (128, 256, 512, 1024) for s in (0, 4)}
    assert t[128, 0] + 3 * launch <= t[128, 4] <= t[128, 0] + 4 * launch
    for m in (256, 512, 1024):
        assert t[m, 4] > t[m, 0] + 4 * launch


def test_blackwell_source_names_its_own_assumed_figures():
    # The Blackwell kernel facts' source said "feed, memory, launch as the first hopper fit's",
    # but hopper's first fit (analysis/gemm.py at b8717bb: 109e9, 1.0, 3.5e-6) never had
    # Blackwell's 150e9, 0.80, 4e-6: the source must give the figures the model uses, as assumed
    from parcompile.analysis.gemm import KERNELS
    bw = KERNELS["blackwell"]
    first_hopper = (109e9, 1.0, 3.5e-6)
    assert (bw.feed, bw.memory, bw.launch) != first_hopper
    said = f"feed {bw.feed / 1e9:g} GB/s per SM, memory {bw.memory:.2f}, launch {bw.launch * 1e6:g} us: assumed"
    assert said in bw.source and "as the first hopper fit's" not in bw.source


def test_deepgemm_config_as_its_source_chooses():
    """DeepGEMM's tile, pipeline depth and TMA multicast (deep_gemm/jit_kernels/gemm.py
    get_best_configs at 55ab91f), worked by hand from its rules for shapes of its README tables on
    132 SMs: the fewest waves, then the fullest last wave, then the smaller BLOCK_N (was: BLOCK_N up
    to 128 only, the larger one on a tie, always 8 stages)."""
    from parcompile.analysis.gemm import deepgemm_config, deepgemm_multicast
    # 4096 x 4096: BLOCK_N 160 gives 32 x 26 = 832 tiles, 7 waves (128: 8); 128 % 160 != 0 and
    # 128 / gcd(128, 160) = 4 <= 4: 4 stages only
    assert deepgemm_config(4096, 4096, 7168, 1, 132) == (128, 160, 4)
    # 4096 x 2112: 144 and 160 both give 4 waves (480 and 448 tiles); 144's last wave is fuller
    # (84 > 52); 8 stages of 128 x 144 overflow the 232,448 bytes of shared memory, 5 fit
    assert deepgemm_config(4096, 2112, 7168, 1, 132) == (128, 144, 5)
    # 64 rows: BLOCK_M 64; 4096 / 32 = 128 tiles in one wave, the fullest
    assert deepgemm_config(64, 4096, 7168, 1, 132) == (64, 32, 8)
    # multicast: 4096 rows, one group, BLOCK_M 128 < BLOCK_N 160: B's side first, legal as
    # 4096 holds whole pairs of 128-row blocks; groups of a masked layout (or m < 512): none
    assert deepgemm_multicast(4096, 4096, 128, 160, 1, 132) == (1, 2)
    assert deepgemm_multicast(1024, 4096, 128, 128, 2, 132) == (1, 1)
    assert deepgemm_multicast(256, 4096, 128, 128, 1, 132) == (1, 1)
    # 8 groups of 32 rows: the contiguous layout asks as one GEMM of their rows aligned to 128
    # (m_grouped_gemm.py: get_best_configs(1024, n, k, 1, is_grouped_contiguous=True)): BLOCK_M
    # 128, BLOCK_N 128 (128 tiles, one wave), 5 stages (6 overflow by 320 bytes), multicast on B
    # (BLOCK_M = BLOCK_N: B's side first; 1024 holds pairs of 128-row blocks); the masked layout
    # asks with one group's 32 rows and 8 groups: BLOCK_M 64, no multicast (was 64 for both)
    assert deepgemm_config(32, 2048, 7168, 8, 132) == (128, 128, 5)
    assert deepgemm_multicast(1024, 2048, 128, 128, 1, 132) == (1, 2)
    assert deepgemm_config(32, 2048, 7168, 8, 132, masked=True) == (64, 128, 8)


def test_deepgemm_multicast_asked_as_each_layout_calls(monkeypatch):
    """gemm_seconds asks for DeepGEMM's multicast as m_grouped_gemm.py at 55ab91f calls
    get_best_configs: the contiguous layout with the groups' rows, each group's aligned to 128,
    and one group; the masked layout with one group's rows and the groups."""
    from parcompile.analysis import gemm
    asked = []
    monkeypatch.setattr(gemm, "deepgemm_multicast", lambda m, n, bm, bn, groups, sms: asked.append((m, groups)) or (1, 1))
    gemm.gemm_seconds.cache_clear()
    for masked in (False, True):
        gemm.gemm_seconds(100, 4096, 7168, 8, 1979e12, 132, 3.35e12, "hopper", "blockwise", 1, masked=masked)
    gemm.gemm_seconds.cache_clear()
    assert asked == [(8 * 128, 1), (100, 8)]


def test_deepgemm_pull_request_tables_judge_the_fit(monkeypatch):
    """DeepGEMM's contributors' own per-shape tables (:data:`DEEPGEMM_PR_H800_FP8`, the tile each
    ran forced, its pipeline depth and multicast by the rules of 55ab91f): held out of every fit, 15 of
    their 17 rows within 10% and all within 20% (at the kernel facts before issue 48's fourth fit:
    9 of 17, the 128 x 160 rows 1-14% slow; fails there). The gain is the blockwise mainloop's rise
    0.677 -> 0.709 (15 of 17 at 0.709 without the power bound; the power bound at 0.677 leaves 9):
    the bound binds on 4 of the rows (k 16384, and 4 x 8192 x 4096 x 7168 at 128 x 128), up to 3%
    slower, and the model's 128 x 160 is 1-10% faster than its 128 x 128 where they measured 5-27%.
    What holds the power bound is the README's masked 2 x 512 row (test_deepgemm_h800_fp8: +16%
    without it) and test_power_bound_prices_the_fetched_bytes."""
    import parcompile.analysis.gemm as gemm
    chooser = gemm.deepgemm_config
    errors = []
    for layout, g, m, n, k, bn, tflops in DEEPGEMM_PR_H800_FP8:
        bm, _, _ = chooser(m, n, k, g, 132, layout == "masked")
        forced = (bm, bn, gemm.deepgemm_stages(bm, bn, k))
        monkeypatch.setattr(gemm, "deepgemm_config", lambda *a, forced=forced: forced)
        gemm_seconds.cache_clear()
        errors.append(deepgemm_rate(layout, g, m, n, k) / tflops - 1)
    monkeypatch.setattr(gemm, "deepgemm_config", chooser)
    gemm_seconds.cache_clear()
    assert sum(abs(e) <= 0.10 for e in errors) >= 15, errors
    assert max(abs(e) for e in errors) <= 0.20, errors


def test_power_bound_prices_the_fetched_bytes(monkeypatch):
    """A DeepGEMM kernel's power budget, worked by hand with round numbers (not the fitted ones):
    5e15 FLOP at power_peak 1.25 of a 2e15 FLOP/s peak take 2 s, 6e12 fetched bytes at power_byte
    2e12 B/s 3 s, 5 s together, 10 s at half the clock; a kernel without a budget (cuBLAS's formats,
    other generations) is not bound. gemm_seconds prices the bytes each tile fetches, a multicast
    tile once per cluster: 4096 x 4096 x 7168 runs 32 x 26 = 832 tiles of 128 x 160 with B shared
    over 2 SMs (test_deepgemm_config_as_its_source_chooses), 128 + 160 / 2 = 208 bytes per tile per
    k; the masked 2 x 512 rows 2 x 4 x 32 = 256 tiles of 128 x 128 without multicast, 256 bytes."""
    import dataclasses

    from parcompile.analysis import gemm
    hopper = KERNELS["hopper"]
    assert hopper.power_peak == pytest.approx(1980 / 1830)
    round_kn = dataclasses.replace(hopper, power_peak=1.25, power_byte=2e12)
    assert gemm.power_seconds(round_kn, 5e15, 6e12, 2e15) == pytest.approx(5.0)
    assert gemm.power_seconds(round_kn, 5e15, 6e12, 2e15, clock=0.5) == pytest.approx(10.0)
    assert gemm.power_seconds(dataclasses.replace(hopper, power_peak=0.0), 5e15, 6e12, 2e15) == 0.0
    assert KERNELS["ampere"].power_peak == 0.0 and KERNELS["blackwell"].power_peak == 0.0
    asked = []
    monkeypatch.setattr(gemm, "power_seconds", lambda kn, flops, fetched, peak, clock=1.0:
                        asked.append((flops, fetched, peak, clock)) or 0.0)
    gemm.gemm_seconds.cache_clear()
    deepgemm_rate("normal", 1, 4096, 4096, 7168)
    deepgemm_rate("masked", 2, 512, 4096, 7168)
    rate(4096, 4096, 7168, 1, "tensorwise", 1, **H100_FP8)      # cuBLAS: no power bound
    monkeypatch.undo()
    gemm.gemm_seconds.cache_clear()
    assert asked == [(2 * 128 * 160 * 7168 * 832, 208 * 7168 * 832, 1979e12, 1.0),
                     (2 * 128 * 128 * 7168 * 256, 256 * 7168 * 256, 1979e12, 1.0)]
    # the README's masked pair (module rows): with multicast (one group) faster than without;
    # 1.01 x without the power bound
    assert deepgemm_rate("masked", 1, 1024, 4096, 7168) > 1.1 * deepgemm_rate("masked", 2, 512, 4096, 7168)


def test_pnorm_joins_two_limits():
    """The roofline's two limits (compute and memory): their maximum at p = 0; otherwise the
    longer one alone where the other is 0, and 2^(1/p) times it where they are equal."""
    from parcompile.analysis.gemm import pnorm
    assert pnorm(3.0, 5.0, 0) == 5.0
    assert pnorm(5.0, 0.0, 6.0) == 5.0
    assert pnorm(4.0, 4.0, 6.0) == pytest.approx(4.0 * 2 ** (1 / 6))
    assert pnorm(1.0, 5.0, 6.0) == pytest.approx((1 + 5.0 ** 6) ** (1 / 6))


def test_tile_bound_skips_only_tiles_that_cannot_win(monkeypatch):
    """gemm_seconds skips a tile whose arithmetic, spread evenly over the SMs, already takes longer
    than the best tile priced so far (a shortcut for speed): every cuBLAS GEMM of a grid of shapes
    (XLA's range, the torchtitan 8B tp-8 ones, deep k) costs what the slowest way gives, each tile
    priced alone and the fastest taken."""
    import dataclasses
    hopper = KERNELS["hopper"]
    shapes = [(m, n, k, b) for m in (64, 256, 1024, 4096) for n in (256, 1792, 4096) for k in (256, 4096, 98304)
              for b in (1, 4)]
    for fmt, peak, nbytes in (("16", 989e12, 2), ("tensorwise", 1979e12, 1)):
        gemm_seconds.cache_clear()
        whole = {s: gemm_seconds(s[0], s[1], s[2], s[3], peak, 132, 3.35e12, "hopper", fmt, nbytes, nbytes)
                 for s in shapes}
        alone = {s: float("inf") for s in shapes}
        for t in hopper.tiles:
            monkeypatch.setitem(KERNELS, "hopper", dataclasses.replace(hopper, tiles=(t,)))
            gemm_seconds.cache_clear()
            for s in shapes:
                alone[s] = min(alone[s], gemm_seconds(s[0], s[1], s[2], s[3], peak, 132, 3.35e12, "hopper", fmt,
                                                      nbytes, nbytes))
        monkeypatch.setitem(KERNELS, "hopper", hopper)
        for s in shapes:
            assert whole[s] == pytest.approx(alone[s], rel=1e-12), (fmt, s)
    gemm_seconds.cache_clear()
