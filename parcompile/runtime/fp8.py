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

The scalar and per-row amax all-reduces over tp run outside the collective counter: the
plan prices them in time (``estimate.assumptions.fp8.amax_all_reduces_tp``) but does not
list them among a step's collectives.

Under a zero-bubble schedule (runtime/wgrad.py: ``STORE`` collecting the step's weight
gradients) the backward splits as the 16-bit linear's does: B returns the input gradient and
files the weight gradient's GEMM with ``STORE`` for the schedule's W step. What the filed
closure keeps is that GEMM's FP8 operands, cast in B (the output gradient along its
columns, the input along its columns, with their scales; the tp amax all-reduces of those
casts run in B, in the order the ranks of a tp group share), not the 16-bit ``x`` and
``g``: a deferred W holds 1 byte per element of the layer's input and output gradient
(plus one fp32 scale per column with ``rowwise``) from B to W, where the 16-bit deferral
holds 2 (bf16) or 4 (fp32). The deferred gradient equals the one the undeferred backward
returns (the same casts, the same GEMM).

mxfp8 (32-element E8M0 blocks) has no CPU kernel; the program refuses it before it is
written (codegen/emit.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parcompile.runtime.context import Axis
from parcompile.runtime.grads import accumulate
from parcompile.runtime.wgrad import STORE

#: the recipes the program runs (analysis/fp8.py RECIPES has mxfp8 too: the plan only)
RECIPES = ("tensorwise", "rowwise")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max   # 448
_TINY = 1e-12   # torchao's EPS: an all-zero tensor gets a finite scale


def _max_over(t: torch.Tensor, axis: Axis | None) -> torch.Tensor:
    """``t`` (amaxes) with the element-wise max over ``axis`` (None or one rank: as is)."""
    if axis is not None and axis.size > 1 and axis.group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=axis.group)
    return t


def cast(t: torch.Tensor, recipe: str, dim: int | None = None, axis: Axis | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-d) in E4M3 and its inverse scale (what ``torch._scaled_mm`` multiplies by).

    ``tensorwise``: one scale, ``amax`` over the whole tensor (``dim`` ignored). ``rowwise``:
    one scale per slice along ``dim`` (the reduction dimension of the GEMM that reads it;
    keepdim, so ``(M, 1)`` or ``(1, N)``), rounded down to a power of two. ``axis``: the
    amaxes are all-reduced (max) over it first (a tensor split over tp, module docstring).
    The scaled values are clamped to +-448 (saturating, as torchao's ``to_fp8_saturated``).

    Raises:
        ValueError: an unknown recipe.
    """
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} has no program kernel here; one of {RECIPES}")
    a = t.detach().abs().float()
    amax = a.amax() if recipe == "tensorwise" else a.amax(dim=dim, keepdim=True)
    amax = _max_over(amax.clone(), axis)
    return cast_with_amax(t, amax, recipe)


def cast_with_amax(t: torch.Tensor, amax: torch.Tensor, recipe: str = "tensorwise"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in E4M3 and its inverse scale, the scale ``448 / amax`` taken from ``amax`` (fp32:
    a scalar, or per row/column for ``rowwise``, rounded down to a power of two there):
    :func:`cast` once the amax is known, and ZeRO-3's FP8 all-gather, which casts each dp
    shard of a weight with the amax of the whole weight (runtime/optim.py). Element-wise,
    so a shard cast here equals the same elements of the whole tensor's cast."""
    scale = E4M3_MAX / amax.clamp(min=_TINY)
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    t8 = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return t8, scale.reciprocal()


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
    def forward(ctx, x, weight, recipe: str, tp: Axis | None, split: str, defer: bool = False):
        ctx.recipe, ctx.tp, ctx.split, ctx.defer = recipe, tp, split, defer
        ctx.save_for_backward(x, weight)
        # the parameter itself (runtime/wgrad.py _DeferredLinear: under saved-tensor hooks
        # saved_tensors hands back another object; the deferred gradient must reach the parameter)
        ctx.weight = weight if defer else None
        # FP8 all-gather's E4M3 weight (tensorwise): the backward's g W reads the same one
        ctx.gathered = getattr(weight, "fp8_gathered", None) if recipe == "tensorwise" else None
        x2 = x.reshape(-1, x.shape[-1])
        row = tp if split == "row" else None
        # forward reduction dim K: x's rows (M, 1), W's rows (N, 1) -> as the right operand (1, N)
        x8, sx = cast(x2, recipe, -1, row)
        w8, sw = _weight_cast(weight, recipe, -1, tp if recipe == "tensorwise" else row)
        y = _mm(x8, sx, w8.t(), sw.t() if sw.dim() else sw, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, tp, split = ctx.recipe, ctx.tp, ctx.split
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        col = tp if split == "column" else None
        tw = recipe == "tensorwise"
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # g W: (M, N) @ (N, K), reduction N (split over tp in a column-parallel layer)
            g8, sg = cast(g2, recipe, -1, col)
            w8, sw = ctx.gathered or _weight_cast(weight, recipe, 0, tp if tw else col)
            grad_x = _mm(g8, sg, w8, sw, grad_out.dtype).view(*x.shape)
        if ctx.needs_input_grad[1]:
            # g^T x: (N, M) @ (M, K), reduction M (whole on every rank)
            gt8, sgt = cast(g2, recipe, 0, col if tw else None)
            x8, sx = cast(x2, recipe, 0, (tp if split == "row" else None) if tw else None)
            if ctx.defer:   # W later, from the FP8 operands cast now (module docstring)
                STORE.file(_weight_grad(ctx.weight, gt8, sgt, x8, sx), ctx.weight)
            else:
                grad_w = _mm(gt8.t(), sgt.t() if sgt.dim() else sgt, x8, sx, weight.dtype)
        return grad_x, grad_w, None, None, None, None


def _weight_grad(weight: torch.Tensor, gt8: torch.Tensor, sgt: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor):
    """The deferred weight gradient of an FP8 linear: a closure adding ``g^T x`` (the FP8 GEMM
    of ``gt8`` (M, N) and ``x8`` (M, K) E4M3 with their inverse scales) to ``weight``'s
    gradient; it keeps only those operands (module docstring)."""
    def run() -> None:
        accumulate(weight, _mm(gt8.t(), sgt.t() if sgt.dim() else sgt, x8, sx, weight.dtype))
    return run


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
               tp: Axis | None = None, split: str = "column", deferrable: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 (module docstring): ``x`` (..., K),
    ``weight`` (N, K) -> (..., N) in ``x``'s dtype; the bias added in that dtype. ``tp`` and
    ``split`` (``"column"``, ``"row"``, ``"replicated"``): which tensors the tp axis splits,
    whose amaxes are all-reduced over it. ``deferrable``: under a zero-bubble step
    (runtime/wgrad.py ``STORE.enabled``) the weight gradient is deferred to the W step, from
    the FP8 operands (module docstring), as :func:`parcompile.runtime.wgrad.linear` defers a
    16-bit one; False keeps it in the backward (the routed experts', which are not deferred
    in 16 bits either).

    Raises:
        ValueError: an unknown recipe or split.
    """
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} has no program kernel here; one of {RECIPES}")
    if split not in ("column", "row", "replicated"):
        raise ValueError(f"split must be column, row or replicated, not {split!r}")
    defer = deferrable and STORE.enabled and torch.is_grad_enabled()
    y = _Fp8Linear.apply(x, weight, recipe, tp if split != "replicated" else None, split, defer)
    return y + bias if bias is not None else y


__all__ = ["E4M3", "E4M3_MAX", "RECIPES", "cast", "cast_with_amax", "fp8_linear", "scaled_mm"]
