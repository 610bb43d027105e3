"""FP8 GEMMs of a generated training program (``train.precision = fp8``, issue 32): a linear
layer's forward and backward GEMMs on FP8 operands through ``torch._scaled_mm`` (on the CPU
the same arithmetic as an fp32 GEMM of the E4M3 values, :func:`_mm`, so miniatures verify
here), with the recipe's dynamic scaling, as
torchao's float8 training does (``torchao/float8/float8_linear.py``,
``matmul_with_hp_or_float8_args``, pytorch/ao 6243040):

- the forward casts the input ``x`` (M x K) and the weight ``W`` (N x K); the backward casts
  the output gradient ``g`` (M x N) and ``W`` again for the input gradient ``g W``, ``g`` and
  ``x`` again for the weight gradient ``g^T x``. The 16-bit ``x`` and ``W`` are saved, not
  their casts (torchao ``ctx.save_for_backward(input_hp, weight_hp_t)``). Every operand is
  E4M3 (torchao's ``Float8LinearConfig()`` and ``recipe="rowwise"``: E4M3 everywhere).
- ``tensorwise``: one scale per tensor, ``448 / amax``. A tensor split over tensor
  parallelism (the weight of either layer, a row-parallel layer's input, a column-parallel
  layer's output gradient) takes the amax of the whole tensor: the local amaxes are
  all-reduced (max) over tp, as torchao does for DTensor weights (torchtitan
  ``docs/float8.md``: "For sharded weights, we communicate max(abs) as well"), so a sharded
  run casts every element with the scale the one-process run uses.
- ``rowwise``: one scale per row of the GEMM's left operand and per column of its right
  one, each along the reduction dimension, rounded down to a power of two (torchao's
  rowwise recipe, ``round_scales_to_power_of_2=True``). The reduction dimension of a
  row-parallel layer's forward is split over tp: its per-row amaxes are all-reduced over tp
  like a tensorwise amax, for the same reason.

The GEMMs accumulate in fp32 and return the input's dtype; the weight (the master copy the
optimizer keeps in fp32, or its 16-bit copy) and its gradient stay as without FP8.

The scalar and per-row amax all-reduces over tp are counted like every collective and listed
among the plan's (``comm.collectives``, ``where`` ``fp8_amax_tp``:
:func:`parcompile.ir.fp8.amax_collectives` says which casts all-reduce).

- ``mxfp8`` (OCP Microscaling Formats (MX) v1.0, section 5 and 6.3; torchao's ``MXLinear``,
  Transformer Engine's ``MXFP8BlockScaling``): every GEMM operand in blocks of
  :data:`MX_BLOCK` = 32 contiguous elements along that GEMM's reduction dimension, one E8M0
  scale per block, ``X = 2^(floor(log2(amax_block)) - 8)`` (8 = ``emax`` of E4M3, whose
  largest normal is 1.75 * 2^8), elements ``V / X`` rounded to E4M3, saturating at +-448
  (torchao ``to_mx``, ``ScaleCalculationMode.FLOOR``). Each of the three GEMMs casts its own
  operands along its own reduction dimension (torchao's ``mx_mm``: the forward's ``x`` and
  ``W`` along K, the input gradient's ``g`` and ``W`` along N, the weight gradient's ``g`` and
  ``x`` along M). A block's scale is local, so no amax crosses ranks; a tp-split reduction
  dimension whose local size is a multiple of 32 (verify's miniature: :func:`parcompile.
  verify.miniature`; real models: hidden / tp) puts every block on one rank, as in the
  one-process run. A reduction dimension that is not a multiple of 32 ends in a partial block
  (zero-padded: the padding changes no amax and adds zero products). On CUDA sm100 and newer
  the GEMM is ``torch.nn.functional.scaled_mm`` with ``BlockWise1x32`` E8M0 scales in
  cuBLAS's swizzled layout; elsewhere (this CPU, Hopper: no block-scaled kernel) the blocks
  are dequantized (exact in fp32: E4M3 times a power of two) and multiplied in fp32
  (:func:`mx_mm`).

Under a zero-bubble schedule (runtime/train/wgrad.py: ``STORE`` collecting the step's weight
gradients) the backward splits as the 16-bit linear's does: B returns the input gradient and
files the weight gradient's GEMM with ``STORE`` for the schedule's W step. What the filed
closure keeps is that GEMM's FP8 operands, cast in B (the output gradient along its
columns, the input along its columns, with their scales; the tp amax all-reduces of those
casts run in B, in the order the ranks of a tp group share), not the 16-bit ``x`` and
``g``: a deferred W holds 1 byte per element of the layer's input and output gradient
(plus one fp32 scale per column with ``rowwise``) from B to W, where the 16-bit deferral
holds 2 (bf16) or 4 (fp32). The deferred gradient equals the one the undeferred backward
returns (the same casts, the same GEMM).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parcompile.runtime.distributed.comm import COUNTER, nbytes
from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.train.grads import accumulate
from parcompile.runtime.train.wgrad import STORE

#: the recipes the program runs (ir/fp8.py RECIPES: the plan's)
RECIPES = ("tensorwise", "rowwise", "mxfp8")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max   # 448
_TINY = 1e-12   # torchao's EPS: an all-zero tensor gets a finite scale
#: MX block size (OCP MX v1.0: k = 32 for every concrete MX format) and E8M0's exponent range
MX_BLOCK = 32
E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E4M3_EMAX = 8            # floor(log2(448)): the largest power of two in E4M3's range
_E8M0_MIN, _E8M0_MAX = -127, 127   # E8M0 encodes 2^-127 .. 2^127 (0xFF is NaN)


def _max_over(t: torch.Tensor, axis: Axis | None, rows: int | None = None) -> torch.Tensor:
    """``t`` (amaxes) with the element-wise max over ``axis`` (None or one rank: as is),
    counted as the plan lists it (``where`` ``fp8_amax_tp``:
    :func:`parcompile.ir.fp8.amax_collectives`); ``rows``: the routed rows its size
    follows (a routed expert group's per-row amaxes: the plan's ``bytes_per_row``), None when
    its size is fixed."""
    if axis is not None and axis.size > 1 and axis.group is not None:
        COUNTER.record("all_reduce", axis.name, nbytes(t), rows)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=axis.group)
    return t


def cast(t: torch.Tensor, recipe: str, dim: int | None = None, axis: Axis | None = None, routed: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-d) in E4M3 and its inverse scale (what ``torch._scaled_mm`` multiplies by).

    ``tensorwise``: one scale, ``amax`` over the whole tensor (``dim`` ignored). ``rowwise``:
    one scale per slice along ``dim`` (the reduction dimension of the GEMM that reads it;
    keepdim, so ``(M, 1)`` or ``(1, N)``), rounded down to a power of two. ``axis``: the
    amaxes are all-reduced (max) over it first (a tensor split over tp, module docstring).
    The scaled values are clamped to +-448 (saturating, as torchao's ``to_fp8_saturated``).
    ``routed``: ``t``'s rows are a routed expert group (the router sets their number): a
    per-row all-reduce is counted with its rows (:func:`_max_over`).

    Raises:
        ValueError: an unknown recipe.
    """
    if recipe not in ("tensorwise", "rowwise"):
        raise ValueError(f"cast() takes tensorwise or rowwise, not {recipe!r} (mxfp8: mx_cast)")
    a = t.detach().abs().float()
    amax = _amax(a, None if recipe == "tensorwise" else dim)
    per_row = routed and recipe == "rowwise" and dim in (-1, t.dim() - 1)
    amax = _max_over(amax, axis, t.shape[0] if per_row else None)   # a fresh tensor: reduced in place
    return cast_with_amax(t, amax, recipe)


def _amax(a: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``a``'s amax over everything (``dim`` None: a scalar) or along ``dim`` (keepdim); 0 where
    the reduction is over no element (an expert's empty group of routed rows, which still runs:
    runtime/model/moe.py GroupedExperts, so its amax all-reduces are the plan's)."""
    if dim is None:
        return a.amax() if a.numel() else a.new_zeros(())
    if a.shape[dim] == 0:
        shape = list(a.shape)
        shape[dim] = 1
        return a.new_zeros(shape)
    return a.amax(dim=dim, keepdim=True)


def cast_with_amax(t: torch.Tensor, amax: torch.Tensor, recipe: str = "tensorwise"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in E4M3 and its inverse scale, the scale ``448 / amax`` taken from ``amax`` (fp32:
    a scalar, or per row/column for ``rowwise``, rounded down to a power of two there):
    :func:`cast` once the amax is known, and ZeRO-3's FP8 all-gather, which casts each dp
    shard of a weight with the amax of the whole weight (runtime/train/zero_gather.py). Element-wise,
    so a shard cast here equals the same elements of the whole tensor's cast."""
    scale = E4M3_MAX / amax.clamp(min=_TINY)
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    t8 = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return t8, scale.reciprocal()


def mx_cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R x K, any float dtype) in MXFP8 blocks along its last dimension (module
    docstring): ``(q, scale)`` with ``q`` the E4M3 elements, R x Kp (K zero-padded to ``Kp``, a
    multiple of :data:`MX_BLOCK`), and ``scale`` the blocks' E8M0 scales as fp32 powers of two,
    R x Kp/32 (``scale.to(E8M0)`` is exact). ``q * scale`` (each scale over its 32 elements)
    is the dequantized block. The shared exponent is ``floor(log2(amax)) - 8`` from the
    block's amax exponent (``frexp``: exact, no log rounding), clamped to E8M0's
    ``[-127, 127]`` (an all-zero block gets 2^-127)."""
    r, k = t.shape
    kp = -(-k // MX_BLOCK) * MX_BLOCK
    v = t.detach().float().contiguous()
    if kp != k:
        v = torch.nn.functional.pad(v, (0, kp - k))
    blocks = v.view(r, kp // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1 (0 -> e = 0: clamped below)
    e = torch.frexp(amax).exponent - 1 - _E4M3_EMAX
    e = torch.where(amax > 0, e, torch.full_like(e, _E8M0_MIN)).clamp(_E8M0_MIN, _E8M0_MAX)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(r, kp)
    return q, scale


def _mx_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of :func:`mx_cast`'s blocks (exact: an E4M3 value times a power of two)."""
    r, kp = q.shape
    return (q.float().view(r, kp // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(-1)).view(r, kp)


def mx_mm(a: torch.Tensor, bt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ bt^T`` with both operands in MXFP8 blocks along their shared reduction dimension
    K: ``a`` (M x K) and ``bt`` (N x K), each cast by :func:`mx_cast` along K; fp32
    accumulation, output M x N in ``dtype``. On CUDA sm100+ the block-scaled
    ``scaled_mm`` (:func:`_mx_scaled_mm`); elsewhere the dequantized blocks' fp32 GEMM:
    every product of two dequantized elements is exact in fp32 (4 significant bits each
    times powers of two) and the sums accumulate in fp32, as the tensor cores' do."""
    qa, sa = mx_cast(a)
    qb, sb = mx_cast(bt)
    if _has_mx_kernel(a.device):
        return _mx_scaled_mm(qa, sa, qb, sb, dtype)
    return (_mx_dequant(qa, sa) @ _mx_dequant(qb, sb).t()).to(dtype)


def _has_mx_kernel(device: torch.device) -> bool:
    """Whether ``device`` runs block-scaled MXFP8 GEMMs: CUDA compute capability 10.0+
    (Blackwell; cuBLAS's block-scaled GEMM) with torch's ``scaled_mm`` and E8M0."""
    if device.type != "cuda" or E8M0 is None or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (10, 0)


def _swizzled(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales (R x Kb, fp32 powers of two) in cuBLAS's block-scaling-factor layout
    (cuBLAS docs, "1D Block Scaling Factors Layout"): rows padded to 128 and scale columns to
    4, tiles of 128 x 4 stored one after another, each tile's element (row, col) at offset
    ``(row % 32) * 16 + (row // 32) * 4 + col``; flattened."""
    r, kb = scale.shape
    rp, kbp = -(-r // 128) * 128, -(-kb // 4) * 4
    padded = torch.ones(rp, kbp, dtype=torch.float32, device=scale.device)
    padded[:r, :kb] = scale
    # (row tile, 128 rows = 4 x 32, col tile, 4 cols) -> (row tile, col tile, 32, 4, 4)
    tiles = padded.view(rp // 128, 4, 32, kbp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).to(E8M0)


def _mx_scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The block-scaled GEMM ``qa @ qb^T`` on CUDA sm100+ (``qb`` N x Kp row-major is the
    column-major right operand the kernel reads)."""
    F = torch.nn.functional
    blk, swz = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(qa, qb.t(), _swizzled(sa), blk, _swizzled(sb), blk, swizzle_a=swz, swizzle_b=swz,
                       output_dtype=dtype)


def _weight_cast(weight: torch.Tensor, recipe: str, dim: int, axis: Axis | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's E4M3 copy and inverse scale: the one ZeRO-3's FP8 all-gather left on the
    parameter (``fp8_gathered``, tensorwise only: gathered as E4M3 with the whole weight's
    scale, used as is, as torchao's ``WeightWithDynamicFloat8CastTensor`` is), else
    :func:`cast` of the 16-bit weight."""
    gathered = getattr(weight, "fp8_gathered", None)
    if gathered is not None and recipe == "tensorwise":
        return gathered
    return cast(weight, recipe, dim, axis)


def _mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(a8 @ b8) * sa * sb`` accumulated in fp32, in ``dtype``: ``torch._scaled_mm``, except on
    the CPU, where torch 2.13's ``_scaled_mm`` is a reference loop (0.14 s for a 128 x 64 x 176
    GEMM, 1000x an fp32 GEMM) and the same arithmetic runs as an fp32 GEMM of the E4M3 values:
    a product of two E4M3 values (4 significant bits each) is exact in fp32, the sums
    accumulate in fp32 as ``_scaled_mm``'s do, and the scales multiply the result (they are per
    row of ``a8`` and per column of ``b8``, so they factor out of every sum). Equal to
    ``_scaled_mm`` up to fp32 summation order (tests/test_fp8.py)."""
    if a8.device.type == "cpu":
        return ((a8.float() @ b8.float()) * sa * sb).to(dtype)
    return scaled_mm(a8, sa, b8, sb, dtype)


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """``torch._scaled_mm(a8, b8)`` with inverse scales ``sa`` (a scalar or ``(M, 1)``) and ``sb``
    (a scalar or ``(1, N)``), fp32 accumulation, output in ``dtype``; the operands laid out as
    the kernel takes them (:func:`_kernel_operands`)."""
    a8, b8 = _kernel_operands(a8, b8)
    return torch._scaled_mm(a8, b8, scale_a=_dense(sa), scale_b=_dense(sb), out_dtype=dtype)


def _kernel_operands(a8: torch.Tensor, b8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a8`` (M, K) row-major and ``b8`` (K, N) column-major, the reduction dimension K
    zero-padded to a multiple of 16: torch's CUDA ``_scaled_mm`` checks ``K % 16 == 0`` and
    ``N % 16 == 0`` and takes a column-major ``b``. K is a routed expert's group of rows in its
    weight gradient's GEMM (``g^T x``), any count; zeros add nothing to a sum, so the product
    is unchanged (torchao pads the same way: ``Float8LinearConfig.pad_inner_dim``,
    ``torchao/float8/float8_ops.py`` ``preprocess_addmm``, and its FP8 grouped GEMM pads token
    groups to 16, ``torchao/prototype/moe_training/utils.py`` ``pad_token_groups``, pytorch/ao
    36027d82). N is a weight's dimension (a multiple of 16 in every model that runs FP8)."""
    pad = -a8.shape[1] % 16
    if pad:
        a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], pad)], dim=1)
        b8 = torch.cat([b8, b8.new_zeros(pad, b8.shape[1])], dim=0)
    return a8.contiguous(), b8.t().contiguous().t()


def _dense(s: torch.Tensor) -> torch.Tensor:
    """A scale with row-major strides (a transposed ``(1, N)`` is ``(N, 1)`` of stride ``(1, N)``)."""
    return s.flatten().view(s.shape) if s.dim() else s


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T with FP8 GEMMs forward and backward (module docstring). ``tp``: the tp
    axis (None: one rank) and which operands it splits: ``split`` is ``"column"`` (W on N:
    the output gradient split on N) or ``"row"`` (W and x on K). ``defer``: the weight
    gradient is filed with the zero-bubble ``STORE`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: str, tp: Axis | None, split: str, defer: bool = False,
                routed: bool = False):
        ctx.recipe, ctx.tp, ctx.split, ctx.defer, ctx.routed = recipe, tp, split, defer, routed
        ctx.save_for_backward(x, weight)
        # the parameter itself (runtime/train/wgrad.py _DeferredLinear: under saved-tensor hooks
        # saved_tensors hands back another object; the deferred gradient must reach the parameter)
        ctx.weight = weight if defer else None
        if recipe == "mxfp8":   # x W^T: blocks along K (x's rows, W's rows)
            y = mx_mm(x.reshape(-1, x.shape[-1]), weight, x.dtype)
            return y.view(*x.shape[:-1], weight.shape[0])
        # FP8 all-gather's E4M3 weight (tensorwise): the backward's g W reads the same one
        ctx.gathered = getattr(weight, "fp8_gathered", None) if recipe == "tensorwise" else None
        x2 = x.reshape(-1, x.shape[-1])
        row = tp if split == "row" else None
        # forward reduction dim K: x's rows (M, 1), W's rows (N, 1) -> as the right operand (1, N)
        x8, sx = cast(x2, recipe, -1, row, routed)
        w8, sw = _weight_cast(weight, recipe, -1, tp if recipe == "tensorwise" else row)
        y = _mm(x8, sx, w8.t(), sw.t() if sw.dim() else sw, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, tp, split = ctx.recipe, ctx.tp, ctx.split
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if recipe == "mxfp8":   # each GEMM's operands in blocks along its own reduction dimension
            gx = mx_mm(g2, weight.t(), grad_out.dtype).view(*x.shape) if ctx.needs_input_grad[0] else None
            gw = None
            if ctx.needs_input_grad[1] and ctx.defer:   # W later (the 16-bit operands: MX casts run in W)
                STORE.file(_mx_weight_grad(ctx.weight, g2, x2), ctx.weight)
            elif ctx.needs_input_grad[1]:
                gw = mx_mm(g2.t(), x2.t(), weight.dtype)
            return gx, gw, None, None, None, None, None
        col, row = (tp if split == "column" else None), (tp if split == "row" else None)
        tw = recipe == "tensorwise"
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # g W: (M, N) @ (N, K), reduction N (split over tp in a column-parallel layer)
            g8, sg = cast(g2, recipe, -1, col, ctx.routed)
            w8, sw = ctx.gathered or _weight_cast(weight, recipe, 0, tp if tw else col)
            grad_x = _mm(g8, sg, w8, sw, grad_out.dtype).view(*x.shape)
        if ctx.needs_input_grad[1]:
            # g^T x: (N, M) @ (M, K), reduction M (whole on every rank)
            gt8, sgt = cast(g2, recipe, 0, col if tw else None)
            x8, sx = cast(x2, recipe, 0, row if tw else None)
            if ctx.defer:   # W later, from the FP8 operands cast now (module docstring)
                STORE.file(_weight_grad(ctx.weight, gt8, sgt, x8, sx), ctx.weight)
            else:
                grad_w = _mm(gt8.t(), sgt.t() if sgt.dim() else sgt, x8, sx, weight.dtype)
        return grad_x, grad_w, None, None, None, None, None


def _weight_grad(weight: torch.Tensor, gt8: torch.Tensor, sgt: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor):
    """The deferred weight gradient of an FP8 linear: a closure adding ``g^T x`` (the FP8 GEMM
    of ``gt8`` (M, N) and ``x8`` (M, K) E4M3 with their inverse scales) to ``weight``'s
    gradient; it keeps only those operands (module docstring)."""
    def run() -> None:
        accumulate(weight, _mm(gt8.t(), sgt.t() if sgt.dim() else sgt, x8, sx, weight.dtype))
    return run


def _mx_weight_grad(weight: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor):
    """The deferred weight gradient of an MXFP8 linear: a closure adding ``g^T x`` (``g2``
    (M, N), ``x2`` (M, K), blocks along M cast when it runs) to ``weight``'s gradient."""
    def run() -> None:
        accumulate(weight, mx_mm(g2.t(), x2.t(), weight.dtype))
    return run


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
               tp: Axis | None = None, split: str = "column", deferrable: bool = True, routed: bool = False
               ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 (module docstring): ``x`` (..., K),
    ``weight`` (N, K) -> (..., N) in ``x``'s dtype; the bias added in that dtype. ``tp`` and
    ``split`` (``"column"``, ``"row"``, ``"replicated"``): which tensors the tp axis splits,
    whose amaxes are all-reduced over it (tensorwise, rowwise; mxfp8's block scales are local).
    ``deferrable``: under a zero-bubble step
    (runtime/train/wgrad.py ``STORE.enabled``) the weight gradient is deferred to the W step, from
    the FP8 operands (module docstring), as :func:`parcompile.runtime.train.wgrad.linear` defers a
    16-bit one; False keeps it in the backward (the routed experts', which are not deferred
    in 16 bits either). ``routed``: ``x``'s rows are a routed expert group (their per-row
    amax all-reduces are counted with their rows, the plan's routed ``fp8_amax_tp`` entries).

    Raises:
        ValueError: an unknown recipe or split.
    """
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} has no program kernel here; one of {RECIPES}")
    if split not in ("column", "row", "replicated"):
        raise ValueError(f"split must be column, row or replicated, not {split!r}")
    defer = deferrable and STORE.enabled and torch.is_grad_enabled()
    y = _Fp8Linear.apply(x, weight, recipe, tp if split != "replicated" else None, split, defer, routed)
    return y + bias if bias is not None else y


__all__ = ["E4M3", "E4M3_MAX", "E8M0", "MX_BLOCK", "RECIPES", "cast", "cast_with_amax", "fp8_linear", "mx_cast",
           "mx_mm", "scaled_mm"]
