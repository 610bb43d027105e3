"""The optimizer rules every training step shares: gradient reduction without sharding, the
model-parallel gradient sums, the gradient norm, clipping, fp16 loss-scale handling and
the torch optimizer, and :class:`ReplicatedOptimizer` (ZeRO stage 0: every data-parallel
rank holds all states). The sharded optimizer (ZeRO 1-3) is
:class:`parcompile.runtime.train.zero.ShardedOptimizer`; a stage holding expert weights steps
with :class:`parcompile.runtime.train.optim_moe.MoEOptimizer`;
:func:`parcompile.runtime.train.optimizers.step_optimizer` picks one as the plan's
:class:`~parcompile.core.data_parallel.DataParallelSharding` says.

The gradient buckets all three reduce in are :class:`parcompile.runtime.train.buckets.GradBuckets`
(the rule: :mod:`parcompile.core.buckets`).

Parameters carry their layout (set by :func:`parcompile.runtime.model.layers.make_param`):
``global_name``, ``shard_dim`` (None: replicated over tp) and ``global_shape``. A tied
LM head on the last pipeline stage (pp > 1) is a copy of the embedding marked
``tied_copy``; its gradient is summed with the embedding's over the `embedding` group
(Megatron-LM's rule) and it is counted once in the gradient norm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parcompile.runtime.train.buckets import BucketedReduction, GradBuckets
from parcompile.runtime.distributed.comm import all_reduce
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.machine.device import FUSED_OPTIMIZER_DEVICES
from parcompile.runtime.train.grads import (enable_main_grads, grad_dtype, is_mixed, main_grad, optimizer_grad,
                                            set_main_grad)
from parcompile.runtime.train.loss_scale import DynamicLossScaler


# --------------------------------------------------------------------------- shared rules


def sync_gradients(model: nn.Module, ctx: ParallelContext, sequence_parallel: bool = False) -> None:
    """The model-parallel gradient sums of a step, after the data-parallel reduction
    (Megatron-LM's ``finalize_model_grads`` order; sums over tp or `embedding` and the mean
    over dp are linear, so they commute):

    - with sequence parallelism, parameters replicated over tp (norms, row-parallel
      biases, learned positions) saw only this rank's part of the sequence: their
      gradients are summed over tp in one flat buffer (Megatron-LM's sequence-parallel
      gradients); without it only the qk-norm weights are (shared by the heads tp splits:
      :func:`tp_partial_grads`);
    - a tied embedding and its LM-head copy on the last stage (pp > 1) sum their
      gradients over the `embedding` group (Megatron-LM's rule).

    :class:`ReplicatedOptimizer` runs it on the reduced gradients; the sharded optimizer
    runs the same sums on its owned shards (:class:`ShardedOptimizer`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if main_grad(p) is None:
            set_main_grad(p, torch.zeros(p.shape, dtype=grad_dtype() if is_mixed(p) else torch.float32,
                                         device=p.device))
    if ctx.tp.size > 1:
        _all_reduce_flat(tp_partial_grads(params, sequence_parallel), ctx.tp)
    emb = ctx.axes["embedding"]
    if emb.size > 1:
        for p in params:
            if getattr(p, "tied", False):
                g = main_grad(p).float()
                all_reduce(g, emb)
                main_grad(p).copy_(g)


def tp_partial_grads(params: list, sequence_parallel: bool) -> list:
    """The parameters whose gradients are partial sums over tp, summed over tp each step:
    with sequence parallelism every tp-replicated one (:func:`sp_replicated`), qk-norm
    weights included; without it only those marked ``tp_partial_grad`` (a qk-norm weight:
    each rank sums its gradient over its own heads; Megatron-Core's
    ``finalize_model_grads`` all-reduces ``q_layernorm``/``k_layernorm`` alike)."""
    if sequence_parallel:
        return sp_replicated(params)
    return [p for p in params if getattr(p, "tp_partial_grad", False)]


def sp_replicated(params: list) -> list:
    """The parameters whose gradients sequence parallelism sums over tp: replicated over tp
    (no ``shard_dim``), not MoE experts (those are split over expert_tp) and not marked
    ``tp_whole_grad`` (MLA's down projections and latent norms, which run on the whole
    gathered sequence: runtime/model/mla.py)."""
    return [p for p in params if getattr(p, "shard_dim", None) is None and not getattr(p, "expert", False)
            and not getattr(p, "tp_whole_grad", False)]


def _all_reduce_flat(params: list, axis, scale: float = 1.0) -> None:
    """Sum the gradients of ``params`` over ``axis`` as one flat fp32 buffer, times ``scale``."""
    if not params or axis.size == 1:
        return
    grads = [main_grad(p) for p in params]
    flat = _flatten_dense_tensors([g.float() for g in grads])
    all_reduce(flat, axis)
    if scale != 1.0:
        flat *= scale
    for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(new)


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one device and dtype (what a foreach kernel takes at once)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def local_grad_squares(params, ctx: ParallelContext) -> torch.Tensor:
    """The sum of squares (a (1,) fp32 tensor) of this rank's gradients of ``params`` that
    the global norm counts here: replicated-over-tp parameters on tp rank 0 only, a tied LM
    head copy never. From ``torch._foreach_norm`` (one fused pass over every gradient of a
    device and dtype, as ``torch.nn.utils.clip_grad_norm_``), in fp32."""
    grads = []
    for p in params:
        g = main_grad(p)
        if g is None or getattr(p, "tied_copy", False):
            continue
        if getattr(p, "shard_dim", None) is None and ctx.tp.index != 0:
            continue
        grads.append(g)
    sq = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    for group in _by_device_and_dtype(grads):
        norms = torch._foreach_norm(group, 2.0)
        sq += torch.stack(norms).to(device=ctx.device, dtype=torch.float32).pow(2).sum()
    return sq


def grad_norm(model: nn.Module, ctx: ParallelContext) -> torch.Tensor:
    """The global L2 norm of all gradients, each parameter counted once over tp and pp:
    :func:`local_grad_squares` all-reduced over tp and pp."""
    sq = local_grad_squares(model.parameters(), ctx)
    all_reduce(sq, ctx.tp)
    all_reduce(sq, ctx.pp)
    return sq.sqrt()[0]


def clip_gradients(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by ``max_norm / norm`` when the norm exceeds ``max_norm`` (0: off),
    with ``torch._foreach_mul_`` (one call per device and dtype)."""
    if max_norm and max_norm > 0:
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            grads = [g for g in (main_grad(p) for p in model.parameters()) if g is not None]
            for group in _by_device_and_dtype(grads):
                torch._foreach_mul_(group, coef)


def make_optimizer(groups: list[dict], train: dict) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD over parameter groups (each with its ``weight_decay``). Adam and
    AdamW use torch's fused kernel (one pass over all parameters, on the device types of
    ``runtime/machine/device.py`` ``FUSED_OPTIMIZER_DEVICES``: CPU and CUDA; the
    optimizer states and the update are the same as the per-parameter loop's up to rounding)
    when every parameter is a floating tensor on one device type, as the fp32 masters are."""
    name, lr = train["optimizer"], train["lr"]
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_floating_point() for p in params) \
        and len({p.device.type for p in params}) == 1 and params[0].device.type in FUSED_OPTIMIZER_DEVICES
    kw = {"fused": True} if fused else {}
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(train["betas"]), eps=train["eps"], **kw)
    if name == "adam":  # Adam's weight decay is L2 added to the gradient
        return torch.optim.Adam(groups, lr=lr, betas=tuple(train["betas"]), eps=train["eps"], **kw)
    return torch.optim.SGD(groups, lr=lr)


def build_optimizer(model: nn.Module, train: dict) -> torch.optim.Optimizer:
    """The optimizer over the local shards. Weight decay applies to matrices and
    embeddings (ndim >= 2), not to norms and biases (Megatron-LM and torchtitan's rule).
    Element-wise updates make the result independent of how parameters are sharded.
    """
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return make_optimizer([{"params": decay, "weight_decay": train["weight_decay"]},
                           {"params": no_decay, "weight_decay": 0.0}], train)


class ReplicatedOptimizer(BucketedReduction):
    """``zero = 0``: every data-parallel rank holds all optimizer states; gradients are
    averaged over `dp_cp` (``axis``) with one all-reduce per gradient bucket, launched
    during the backward (:class:`parcompile.runtime.train.buckets.GradBuckets`), then summed
    over the model-parallel groups that need it (:func:`sync_gradients`).

    Args:
        model: the rank's stage (or a view of some of its parameters).
        ctx: the rank's groups.
        train: the spec's ``train`` block.
        bucket_size: fp32 bytes per gradient bucket (``parallel.bucket_size``).
        sequence_parallel: sum tp-replicated parameters' gradients over tp.
        chunks: layer ids per local chunk (default ``model.chunks``), for the buckets.
        axis: the data-parallel group (default ``dp_cp``; ``expert_dp`` for expert weights).
        grad_scale: what the summed gradients are multiplied by (default ``1 / dp_cp``).

    Same interface as :class:`ShardedOptimizer`.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, train: dict, bucket_size: int = 0,
                 sequence_parallel: bool = False, chunks=None, axis=None, grad_scale: float | None = None):
        self.model, self.ctx = model, ctx
        self.params = list(model.parameters())
        self.scaler = scaler_for(self.params)
        self.sequence_parallel = sequence_parallel
        enable_main_grads(model)
        axis = axis or ctx.axes["dp_cp"]
        scale = grad_scale if grad_scale is not None else 1.0 / ctx.axes["dp_cp"].size
        self.buckets = GradBuckets(self.params, chunks if chunks is not None else getattr(model, "chunks", None),
                                   axis, bucket_size, sharded=False, scale=scale)
        # 16-bit parameters get fp32 master copies that the optimizer updates (SPEC: 4 bytes
        # of master weights per parameter); fp32 parameters are updated in place
        self.masters = [nn.Parameter(p.detach().float().clone()) if p.dtype != torch.float32 else p
                        for p in self.params]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        self.optimizer = make_optimizer([{"params": decay, "weight_decay": train["weight_decay"]},
                                         {"params": no_decay, "weight_decay": 0.0}], train)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            set_main_grad(p, None)
        self.buckets.reset()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def begin_step(self) -> None:
        pass

    def reduce_gradients(self) -> None:
        """Finish the bucketed data-parallel reduction, then the model-parallel sums."""
        self.buckets.finish()
        sync_gradients(self.model, self.ctx, self.sequence_parallel)

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before the backward (fp16; 1 otherwise)."""
        return self.scaler.scale if self.scaler else 1.0

    def unscale(self) -> bool:
        """Divide the gradients by the loss scale; False when one overflowed on some rank
        (the step is then skipped, its gradients dropped, and the scale halves)."""
        return unscale_gradients(self.scaler, [main_grad(p) for p in self.params], self.ctx, self.zero_grad)

    def dump_gradients(self) -> dict:
        return shards(self.model, self.ctx, grads=True)

    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.model, self.ctx)

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        clip_gradients(self.model, norm, max_norm)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = optimizer_grad(main_grad(p))   # fp32 (grad_dtype bf16: a copy)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    m.grad = None
                    p.copy_(m)                                  # 16-bit weights from the fp32 masters

    def gather_for_export(self) -> None:
        pass

    def export_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Optimizer states in their parameter's layout, by ``id(param)`` (checkpoints)."""
        out = {}
        for p, m in zip(self.params, self.masters):
            st = {k: v.detach() for k, v in self.optimizer.state.get(m, {}).items() if torch.is_tensor(v) and v.dim() > 0}
            if m is not p:
                st["master"] = m.detach()
            out[id(p)] = st
        return out

    def import_states(self, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """Restore what :meth:`export_states` wrote, after ``step`` optimizer steps."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                st = dict(states.get(id(p), {}))
                master = st.pop("master", None)
                if m is not p:
                    m.copy_(master if master is not None else p.float())
                if st:
                    self.optimizer.state[m] = {"step": torch.tensor(float(step)), **{k: v.clone() for k, v in st.items()}}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters, gradients, optimizer states."""
        ps = self.params
        masters = sum(m.numel() * m.element_size() for p, m in zip(ps, self.masters) if m is not p)
        return {
            "params": sum(p.numel() * p.element_size() for p in ps),
            "grads": self.buckets.buffer_bytes(),   # every gradient is a view of its bucket's buffer
            "optimizer": masters + sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                                       for t in st.values() if torch.is_tensor(t) and t.dim() > 0),
        }


def scaler_for(params: list):
    """A :class:`parcompile.runtime.train.loss_scale.DynamicLossScaler` when ``params`` are fp16
    (their first one decides: a stage has one dtype), else None."""
    if params and params[0].dtype == torch.float16:
        return DynamicLossScaler()
    return None


def unscale_gradients(scaler, grads: list, ctx: ParallelContext, drop) -> bool:
    """fp16: divide ``grads`` (fp32 tensors, None skipped) in place by the loss scale of
    ``scaler`` (a :class:`parcompile.runtime.train.loss_scale.DynamicLossScaler`; None: nothing to
    do, True), agree with every rank on an overflow (inf or nan), update the scale, and
    call ``drop()`` (drop the step's gradients) on an overflow. Returns False when the step
    is to be skipped. Shared by every optimizer of this module."""
    if scaler is None:
        return True
    inv = 1.0 / scaler.scale
    for g in grads:
        if g is not None:
            g.mul_(inv)
    overflow = scaler.found_inf(grads, ctx)
    scaler.update(overflow)
    if overflow:
        drop()
    return not overflow


def fp8_weight_ids(model: nn.Module) -> set[int]:
    """``id`` of each weight ZeRO-3's FP8 all-gather moves in E4M3: the ``weight`` of every
    module of ``model`` with an FP8 recipe (``fp8``; the linear layers). Not the routed
    experts' matrices (runtime/model/moe.py MoELayer has no ``weight``): their ZeRO-3 gathers move
    16 bits, as the plan's (analysis/params.py ``fp8_weights``, dense buckets' ``Bucket.fp8``)
    and torchao's FSDP float8 all-gather (Float8Linear weights only)."""
    return {id(m.weight) for m in model.modules()
            if getattr(m, "fp8", None) and isinstance(getattr(m, "weight", None), nn.Parameter)}


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def shards(model: nn.Module, ctx: ParallelContext, grads: bool) -> dict:
    """This rank's parameters (or gradients) with their layout, for ``verify`` to reassemble."""
    out = {}
    for name, p in model.named_parameters():
        t = main_grad(p) if grads else p
        out[name] = {
            "global_name": getattr(p, "global_name", name),
            "shard_dim": getattr(p, "shard_dim", None),
            "tp_index": getattr(p, "shard_index", ctx.tp.index),   # over tp, or expert_tp for experts
            "tp_size": ctx.tp.size,
            "tensor": None if t is None else t.detach().float().cpu().clone(),
        }
    return out


__all__ = [
    "sync_gradients", "sp_replicated", "tp_partial_grads", "grad_norm", "clip_gradients", "make_optimizer", "build_optimizer",
    "ReplicatedOptimizer", "local_grad_squares", "scaler_for", "unscale_gradients", "fp8_weight_ids", "set_lr", "shards",
]
