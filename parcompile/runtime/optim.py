"""The optimizer family of a training step, in one module: gradient reduction, the
model-parallel gradient sums, the gradient norm, clipping, fp16 loss-scale handling and
the update, for every ``zero`` stage and for expert weights.

- :class:`ReplicatedOptimizer`: ``zero = 0``; every data-parallel rank holds all states.
- :class:`ShardedOptimizer`: ``zero`` 1, 2 and 3, sharded over ``dp_cp`` (below), with
  :class:`LayerGather` gathering ZeRO-3's buckets just in time.
- :class:`MoEOptimizer`: a stage holding expert weights (below): a dense part and an
  expert part, each one of the two above.
- :func:`step_optimizer` picks one for a stage; generated programs call it.

The gradient buckets all three reduce in are :class:`parcompile.runtime.buckets.GradBuckets`
(the rule: :mod:`parcompile.core.buckets`).

Parameters carry their layout (set by :func:`parcompile.runtime.layers.make_param`):
``global_name``, ``shard_dim`` (None: replicated over tp) and ``global_shape``. A tied
LM head on the last pipeline stage (pp > 1) is a copy of the embedding marked
``tied_copy``; its gradient is summed with the embedding's over the `embedding` group
(Megatron-LM's rule) and it is counted once in the gradient norm.

**ZeRO** over the data-parallel group (:class:`ShardedOptimizer`; Rajbhandari et al. 2020; Megatron-LM's distributed
optimizer; torchtitan's FSDP + PP shape: parameters stay gathered across the
micro-batches of a step).

A pipeline stage's parameters are grouped into gradient buckets
(:mod:`parcompile.core.buckets`); each bucket of N elements is its own sharded buffer,
padded to ``S * d`` with ``S = ceil(N / d)`` over the ``dp_cp`` group of d ranks, and rank
i owns elements ``[i S, (i + 1) S)`` of every bucket (Megatron-LM's
``param_and_grad_buffer.py`` layout). One step:

1. ``zero = 1``: the backward accumulates full gradients (fp32) over the micro-batches;
   each bucket is reduce-scattered as soon as its gradients are final, overlapping the
   rest of the backward (:class:`parcompile.runtime.buckets.GradBuckets`), giving each
   rank the sum of its slice (divided by d: the data-parallel average). ``zero = 2, 3``:
   each bucket is reduce-scattered in every micro-batch's backward as soon as that
   micro-batch's gradients of it are complete, added into the rank's fp32 slice (kept
   across the step) and its full buffer freed (DeepSpeed ZeRO-2, FSDP2), so at most two
   full buckets exist at once (the zero-bubble schedule reduces once per step);
2. the model-parallel sums (sequence-parallel parameters over tp, the tied embedding over
   `embedding`) run on the owned slices: every rank of those groups has the same bucket
   layout, so its slices line up (Megatron-LM's ``finalize_model_grads`` after the
   reduce-scatter);
3. the gradient norm is summed over the shards (all-reduce over dp_cp, then tp and pp);
4. the optimizer updates the owned slices only: its states are ``sum S`` elements;
5. one all-gather per bucket of the updated slices rebuilds the parameters.

Stages: ``zero = 1`` keeps full gradients and parameters between steps; ``zero = 2``
holds full gradients only for the buckets in flight (only the slices' gradients are kept);
``zero = 3`` also frees the full parameters after the update and all-gathers them, bucket
by bucket, where the step needs them (:class:`LayerGather`; the rule and the plan's side
are in :mod:`parcompile.core.buckets`). With ``pp = 1`` every bucket is gathered just
in time, before the forward of its first unit (the embedding, a decoder layer, the output
layer) with the next unit's prefetched, and freed after the forward of its last unit;
gathered again before the backward of its last unit the backward reads (not the
embedding: its backward reads the token ids) and freed once the input gradient of its
first such unit is complete (FSDP's ``reshard_after_forward``, DeepSpeed ZeRO-3). The output
layer's bucket is kept from its forward through its backward, which follows at once
(torchtitan does not reshard the last module after forward); a tied embedding's bucket,
which the LM head reads too, is gathered at the step's start. With ``pp > 1`` a bucket of
decoder layers is gathered before the forward of its first layer, the others at the
step's start, and all are kept across the micro-batches (torchtitan's FSDP + PP). Every
gathered bucket is freed once its gradients are final (when its last reduce-scatter of
the step starts), so the optimizer step runs with shards only. A gathered bucket is
one padded buffer the bucket's parameters are views of; freeing it resizes the buffer's
storage to zero, so what autograd saved (the same storage) sees the data again once it
is gathered back (FSDP's ``resize_`` of the unsharded storage).
The collectives are the plan's ``grads`` reduce-scatters and ``params`` all-gathers
(``comm.collectives``): one reduce-scatter per bucket per step (``m`` at zero 2, 3, in the
reduce dtype, ``parallel.reduce_dtype``), one all-gather per bucket per step (with ``pp = 1``
under ZeRO-3, ``2 m`` for layer buckets, ``m`` for the embedding's and the output layer's). ZeRO-3's
all-gathers run on a group of their own (:attr:`parcompile.runtime.context.Axis.param_group`).

fp32 models update their parameters in place through views (no master copy); the
optimizer's states are then 8 bytes per owned element (Adam), as SPEC accounts.

**Gradients of expert weights** (:class:`MoEOptimizer`). Every token of the stage is
dispatched from exactly one rank, so summing an expert's local gradient over its ``expert_dp`` replicas gives the sum over all
tokens of the stage of d loss_g / dW, where loss_g is the loss of data-parallel rank g.
The step's loss is the mean over the dp * cp ranks, so expert gradients are all-reduced
over expert_dp and divided by dp * cp (not by expert_dp). The gradient norm counts each
expert shard once: squares summed over expert_dp (when sharded), ep and expert_tp.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.buckets import (fp8_gather_elements, bucket_positions, needed_in_backward, reshard_after_forward, unit_position,
                                     zero3_just_in_time)
from parcompile.runtime.buckets import BucketedReduction, BucketLayout, GradBuckets, GradSync, local_numel
from parcompile.runtime.comm import COUNTER, all_gather_single, all_reduce, nbytes
from parcompile.runtime.context import ParallelContext
from parcompile.runtime.device import FUSED_OPTIMIZER_DEVICES
from parcompile.runtime.fp8 import E4M3, cast_with_amax
from parcompile.runtime.grads import enable_main_grads, main_grad, set_main_grad
from parcompile.runtime.loss_scale import DynamicLossScaler


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
            set_main_grad(p, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
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
    gathered sequence: runtime/mla.py)."""
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


def grad_norm(model: nn.Module, ctx: ParallelContext) -> torch.Tensor:
    """The global L2 norm of all gradients, each parameter counted once over tp and pp.

    Replicated-over-tp parameters count on tp rank 0 only; a tied LM head copy is skipped.
    The local sum of squares comes from ``torch._foreach_norm`` (one fused pass over every
    gradient of a device and dtype, as ``torch.nn.utils.clip_grad_norm_``), in fp32; it is
    then all-reduced over tp and pp.
    """
    grads = []
    for p in model.parameters():
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
    ``runtime/device.py`` ``FUSED_OPTIMIZER_DEVICES``: CPU and CUDA; the
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
    during the backward (:class:`parcompile.runtime.buckets.GradBuckets`), then summed
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
                m.grad = main_grad(p)
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
    """A :class:`parcompile.runtime.loss_scale.DynamicLossScaler` when ``params`` are fp16
    (their first one decides: a stage has one dtype), else None."""
    if params and params[0].dtype == torch.float16:
        return DynamicLossScaler()
    return None


def unscale_gradients(scaler, grads: list, ctx: ParallelContext, drop) -> bool:
    """fp16: divide ``grads`` (fp32 tensors, None skipped) in place by the loss scale of
    ``scaler`` (a :class:`parcompile.runtime.loss_scale.DynamicLossScaler`; None: nothing to
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
    experts' matrices (runtime/moe.py MoELayer has no ``weight``): their ZeRO-3 gathers move
    16 bits, as the plan's (analysis/params.py ``fp8_weights``, dense buckets' ``Bucket.fp8``)
    and torchao's FSDP float8 all-gather (Float8Linear weights only)."""
    return {id(m.weight) for m in model.modules()
            if getattr(m, "fp8", None) and isinstance(getattr(m, "weight", None), nn.Parameter)}


def step_optimizer(model: nn.Module, ctx: ParallelContext, train: dict, sharding: DataParallelSharding,
                   bucket_size: int = 0, sequence_parallel: bool = False, reduce_dtype: str = "fp32"):
    """The optimizer of a stage as the plan's data-parallel ``sharding`` says (a
    :class:`~parcompile.core.data_parallel.DataParallelSharding`): replicated, or sharded
    over dp_cp (:attr:`~parcompile.core.data_parallel.DataParallelSharding.sharded`),
    reducing gradients in buckets of ``bucket_size`` fp32 bytes (0: one per chunk, after
    the backward); ``sequence_parallel`` sums tp-replicated gradients over tp;
    ``reduce_dtype`` (``parallel.reduce_dtype``): the dtype the buckets reduce-scattered in
    each micro-batch (sharded gradients) are held and reduced in. With sharded parameters
    buckets are gathered just in time by hooks on the stage's units (:class:`LayerGather`).

    Raises:
        ValueError: ``sharding`` is for another data-parallel group size than this run's
            ``dp_cp`` (a program run with another plan's layout), or replicates
            (``replicate > 1``: HSDP's groups are not built yet).
    """
    if sharding.shard != ctx.axes["dp_cp"].size or sharding.replicate != 1:
        raise ValueError(f"the program's data-parallel sharding (shard {sharding.shard}, replicate "
                         f"{sharding.replicate}) does not match this run's dp_cp group of "
                         f"{ctx.axes['dp_cp'].size} ranks")
    opt = moe_optimizer(model, ctx, train, sharding, bucket_size, sequence_parallel, reduce_dtype)   # experts: over expert_dp
    if opt is None:
        if not sharding.sharded:
            return ReplicatedOptimizer(model, ctx, train, bucket_size, sequence_parallel)
        opt = ShardedOptimizer(model, ctx, sharding, train["weight_decay"], lambda groups: make_optimizer(groups, train),
                               bucket_size, sequence_parallel, reduce_dtype=reduce_dtype,
                               fp8_all_gather=bool(train.get("fp8_all_gather")))
    parts = [o for o in getattr(opt, "parts", (opt,))
             if isinstance(o, ShardedOptimizer) and o.sharding.shards_parameters]
    if parts and hasattr(model, "layers"):   # ZeRO-3: buckets gathered just in time
        LayerGather(model, parts, reshard_after_forward(ctx.num_stages))
    return opt


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


# --------------------------------------------------------------------------- ZeRO


class ShardedOptimizer(BucketedReduction):
    """The optimizer of a stage under ``zero`` 1, 2 or 3 (see module docstring).

    ``make_optimizer(groups)`` builds the torch optimizer from parameter groups
    (``[{"params": [...], "weight_decay": wd}, ...]``); the groups hold this rank's
    segments of the parameters (one segment per parameter and bucket that overlaps the
    owned slice), so the update of every element equals the unsharded optimizer's.
    ``bucket_size``, ``sequence_parallel``, ``chunks`` and ``grad_scale`` (default 1/d) are
    :class:`ReplicatedOptimizer`'s; ``reduce_dtype``
    (``parallel.reduce_dtype``): the dtype of the buckets reduce-scattered per micro-batch
    (zero 2, 3; :class:`parcompile.runtime.buckets.GradBuckets`). ``fp8_all_gather``
    (zero 3, ``train.fp8_all_gather`` with tensorwise FP8 GEMMs): the weights of the FP8
    GEMMs (the modules with an ``fp8`` recipe) are all-gathered as E4M3 bytes, the rest of
    each bucket in 16 bits (:meth:`_gather_fp8`); ``fp8_model``: the module whose layers say
    which weights those are (:func:`fp8_weight_ids`; default ``model``: a
    :class:`MoEOptimizer` part is a view over some of a stage's parameters).
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, sharding: DataParallelSharding, weight_decay: float,
                 make_optimizer, bucket_size: int = 0, sequence_parallel: bool = False, chunks=None,
                 grad_scale: float | None = None, reduce_dtype: str = "fp32", fp8_all_gather: bool = False,
                 fp8_model: nn.Module | None = None):
        self.model, self.ctx, self.sharding = model, ctx, sharding
        zero3 = sharding.shards_parameters
        self.axis = ctx.axes["dp_cp"]
        self.sequence_parallel = sequence_parallel
        self.params = [p for p in model.parameters()]
        enable_main_grads(model)
        self.scaler = scaler_for(self.params)
        self.mixed = self.params[0].dtype != torch.float32
        d = self.axis.size
        self.buckets = GradBuckets(self.params, chunks if chunks is not None else getattr(model, "chunks", None),
                                   self.axis, bucket_size, sharded=True,
                                   scale=grad_scale if grad_scale is not None else 1.0 / d,
                                   per_microbatch=sharding.shards_gradients, reduce_dtype=reduce_dtype)
        # (bucket, param, lo, hi, segment): the owned elements [lo, hi) of the bucket, in param p
        self.segments: list[tuple[BucketLayout, nn.Parameter, int, int, nn.Parameter]] = []
        decay, no_decay = [], []
        for b in self.buckets.buckets:
            lo_own, hi_own = self.axis.index * b.shard, (self.axis.index + 1) * b.shard
            for p, off in zip(b.params, b.offsets):
                n = p.numel()
                lo, hi = max(off, lo_own), min(off + n, hi_own)
                if lo >= hi:
                    continue
                flat = p.data.view(-1)[lo - off:hi - off]
                # fp32: a view of the parameter (zero 3: its own copy); 16-bit: an fp32 master copy
                seg = nn.Parameter(flat.float().clone() if (zero3 or self.mixed) else flat)
                seg.counts_in_norm = not getattr(p, "tied_copy", False) and (
                    getattr(p, "shard_dim", None) is not None or ctx.tp.index == 0)
                self.segments.append((b, p, lo, hi, seg))
                (decay if p.ndim >= 2 else no_decay).append(seg)
        # the owned slice of a bucket past its last element (padding to ceil(n / d) * d) is a
        # zero segment with optimizer states of its own, so that every rank holds ceil(n / d)
        # elements of sharded state, as DeepSpeed's padded partitions do and the plan counts;
        # its gradient is the (zero) padding of the reduce-scatter output
        self.padding: list[tuple[BucketLayout, int, nn.Parameter]] = []
        for b in self.buckets.buckets:
            lo_own, hi_own = self.axis.index * b.shard, (self.axis.index + 1) * b.shard
            lo = max(b.elements, lo_own)
            if lo < hi_own:
                pad = nn.Parameter(torch.zeros(hi_own - lo, dtype=torch.float32, device=ctx.device))
                self.padding.append((b, lo, pad))
                no_decay.append(pad)
        # zero 3 with 16-bit weights: the rank keeps its 16-bit slice of every bucket, which the
        # next step's all-gather sends (SPEC: 2/d bytes of parameters per element)
        self.low_shards: list[torch.Tensor] | None = None
        # zero 3: the gathered buffer of each bucket (by index), the buckets LayerGather
        # gathers just in time, and the bytes of gathered buffers held (shared by a stage's parts)
        self._full: dict[int, torch.Tensor] = {}
        self._inflight: dict[int, tuple] = {}   # prefetched buckets: (works, inputs, finish)
        self.just_in_time: set[int] = set()
        self.gathered = GatherMeter()
        #: zero 2, 3: the most bytes of full gradient buffers the step held at once (the
        #: plan's ``grad_buckets_in_flight``; ``full_grads`` when reduced once per step)
        self.full_grad_bytes = 0
        if zero3:
            self.buckets.on_launch = self._release_bucket   # gradients final: no further use
        self.optimizer = make_optimizer([{"params": decay, "weight_decay": weight_decay},
                                         {"params": no_decay, "weight_decay": 0.0}])
        self._grad_shards: list[torch.Tensor] | None = None
        # FP8 all-gather: the FP8 GEMMs' weights (index = their amax's place), the step's
        # amaxes and inverse scales (None: not taken this step: gathers in 16 bits)
        self.fp8_params: list[nn.Parameter] = []
        if fp8_all_gather and zero3:
            fp8w = fp8_weight_ids(fp8_model if fp8_model is not None else model)
            self.fp8_params = [p for p in self.params if id(p) in fp8w]
        self._fp8_index = {id(p): k for k, p in enumerate(self.fp8_params)}
        self._fp8_amax: torch.Tensor | None = None
        self._fp8_sinv: list[torch.Tensor] = []
        self._fp8_held: dict[int, int] = {}   # bucket index -> bytes of its E4M3 copies held
        self._exporting = False
        if zero3:
            self._keep_low_shards()
            self._free_params()

    def _keep_low_shards(self) -> None:
        """zero 3, 16-bit weights: refresh this rank's 16-bit slices from the fp32 masters."""
        if not self.mixed:
            return
        dtype = self.params[0].dtype
        self.low_shards = []
        for b in self.buckets.buckets:
            mine = torch.zeros(b.shard, dtype=dtype, device=self.ctx.device)
            lo_own = self._own_lo(b)
            for p, lo, hi, seg in self._segments_of(b):
                mine[lo - lo_own:hi - lo_own] = seg.data.view(-1).to(dtype)
            self.low_shards.append(mine)

    def _own_lo(self, b: BucketLayout) -> int:
        return self.axis.index * b.shard

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            set_main_grad(p, None)
        for *_, seg in self.segments:
            seg.grad = None
        self._grad_shards = None
        self.buckets.reset()

    def begin_step(self) -> None:
        """Before the first forward of a step (zero 3): start from shards only, then gather
        the buckets not gathered just in time (:class:`LayerGather`: with ``pp > 1`` the
        embedding's and the output layer's, with ``pp = 1`` a tied embedding's)."""
        if self.sharding.shards_parameters:
            self._free_params()
            self.gathered.reset()
            if self.fp8_params:
                self._fp8_scales()
            for b in self.buckets.buckets:
                if b.index not in self.just_in_time:
                    self._gather_bucket(b)

    def reduce_gradients(self) -> None:
        """Finish the buckets' reduce-scatters, attach the owned slices to the segments,
        run the model-parallel sums on them."""
        self._grad_shards = self.buckets.finish()
        for b, p, lo, hi, seg in self.segments:
            lo_own = self._own_lo(b)
            seg.grad = self._grad_shards[b.index][lo - lo_own:hi - lo_own].view_as(seg)
        for b, lo, pad in self.padding:
            pad.grad = self._grad_shards[b.index][lo - self._own_lo(b):]
        self._sync_model_parallel()
        if self.sharding.shards_gradients:   # the full gradients are reduced: only the owned slices stay
            self.full_grad_bytes = self.buckets.peak_bytes
            self.buckets.release()

    def _sync_model_parallel(self) -> None:
        """:func:`sync_gradients` on the owned slices: one flat
        all-reduce over tp of the sequence-parallel parameters (the plan's full
        ``sp_norm_grads`` size; slices not owned here are zeros), and one over `embedding`
        of the tied embedding (alone in its bucket on both stages, so both own the same
        slice)."""
        def reduce(params: list, axis) -> None:
            if not params or axis.size == 1:
                return
            start, off = {}, 0
            for p in params:
                start[id(p)] = off
                off += local_numel(p)
            flat = torch.zeros(off, dtype=torch.float32, device=self.ctx.device)
            mine = [(b, p, lo, hi, seg) for b, p, lo, hi, seg in self.segments if id(p) in start]
            for b, p, lo, hi, seg in mine:
                at = start[id(p)] + lo - self.buckets.offset_of[id(p)]
                flat[at:at + hi - lo] = seg.grad.reshape(-1)
            all_reduce(flat, axis)
            for b, p, lo, hi, seg in mine:
                at = start[id(p)] + lo - self.buckets.offset_of[id(p)]
                seg.grad.reshape(-1).copy_(flat[at:at + hi - lo])

        if self.ctx.tp.size > 1:
            reduce(tp_partial_grads(self.params, self.sequence_parallel), self.ctx.tp)
        reduce([p for p in self.params if getattr(p, "tied", False)], self.ctx.axes["embedding"])

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before the backward (fp16; 1 otherwise)."""
        return self.scaler.scale if self.scaler else 1.0

    def unscale(self) -> bool:
        """Unscale the owned gradient slices; False (step skipped) when a rank overflowed."""
        def drop():
            self.zero_grad()
            if self.sharding.shards_parameters:
                self._free_params()

        return unscale_gradients(self.scaler, list(self._grad_shards or []), self.ctx, drop)

    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm from the shards: all-reduce over dp_cp, then tp and pp."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        for *_, seg in self.segments:
            if seg.counts_in_norm:
                sq += seg.grad.float().pow(2).sum()
        all_reduce(sq, self.axis)
        all_reduce(sq, self.ctx.tp)
        all_reduce(sq, self.ctx.pp)
        return sq.sqrt()[0]

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        if max_norm and max_norm > 0:
            coef = float(max_norm) / (float(norm) + 1e-6)
            if coef < 1.0:
                for g in self._grad_shards or []:
                    g.mul_(coef)

    def step(self) -> None:
        """Update the owned slices, then rebuild the parameters (zero 1, 2) or free them (3)."""
        self.optimizer.step()
        for *_, seg in self.segments:
            seg.grad = None
        for *_, pad in self.padding:
            pad.grad = None
        if self.sharding.shards_parameters:
            self._keep_low_shards()
            self._fp8_amax = None   # the weights changed: the next step takes new scales
        if not self.sharding.shards_gradients:
            self._grad_shards = None   # zero 1 keeps full gradients; the slices were scratch copies
        if self.sharding.shards_parameters:
            self._free_params()
        else:
            self._all_gather_params()

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # -- parameters -----------------------------------------------------------------------
    def _gather(self, fill, dtype: torch.dtype, counted: bool = True) -> list[torch.Tensor]:
        """Per bucket, all-gather this rank's slice (``fill(bucket, mine)`` writes it) into
        the full padded buffer; returns the buffers."""
        d = self.axis.size
        out = []
        enabled = COUNTER.enabled
        COUNTER.enabled = enabled and counted
        try:
            for b in self.buckets.buckets:
                mine = torch.zeros(b.shard, dtype=dtype, device=self.ctx.device)
                fill(b, mine)
                full = torch.empty(b.shard * d, dtype=dtype, device=self.ctx.device)
                COUNTER.record("all_gather", self.axis.name, nbytes(full))
                all_gather_single(full, mine, group=self.axis.group)
                out.append(full)
        finally:
            COUNTER.enabled = enabled
        return out

    def _segments_of(self, b: BucketLayout):
        return [(p, lo, hi, seg) for bb, p, lo, hi, seg in self.segments if bb is b]

    def _all_gather_params(self) -> None:
        if self.sharding.shards_parameters:
            for b in self.buckets.buckets:
                self._gather_bucket(b)
            return
        dtype = self.params[0].dtype

        def fill(b: BucketLayout, mine: torch.Tensor) -> None:
            if self.low_shards is not None:
                mine.copy_(self.low_shards[b.index])
                return
            lo_own = self._own_lo(b)
            for p, lo, hi, seg in self._segments_of(b):
                mine[lo - lo_own:hi - lo_own] = seg.data.view(-1).to(dtype)

        for b, full in zip(self.buckets.buckets, self._gather(fill, dtype)):
            for p, off in zip(b.params, b.offsets):
                n = local_numel(p)
                if p.data.numel() != n:
                    p.data = torch.empty(p.global_local_shape, dtype=dtype, device=self.ctx.device)
                p.data.view(-1).copy_(full[off:off + n])

    def _fill_shard(self, b: BucketLayout) -> torch.Tensor:
        """This rank's slice of bucket ``b`` in the parameters' dtype (``shard`` elements)."""
        if self.low_shards is not None:
            return self.low_shards[b.index]
        mine = torch.zeros(b.shard, dtype=self.params[0].dtype, device=self.ctx.device)
        lo_own = self._own_lo(b)
        for p, lo, hi, seg in self._segments_of(b):
            mine[lo - lo_own:hi - lo_own] = seg.data.view(-1).to(mine.dtype)
        return mine

    def _gather_bucket(self, b: BucketLayout, prefetch: bool = False) -> None:
        """zero 3: all-gather bucket ``b`` into its padded buffer (``shard * d`` elements),
        the storage of its parameters. ``prefetch``: start it asynchronously (a later call
        without ``prefetch`` waits for it); nothing if it is gathered or in flight already,
        except that a call without ``prefetch`` waits for one in flight."""
        if b.index in self._inflight:
            if not prefetch:
                self._wait(b)
            return
        dtype = self.params[0].dtype
        n = b.shard * self.axis.size
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        full = self._full.get(b.index)
        if full is not None and full.untyped_storage().nbytes() == nbytes:
            return
        if full is None:
            full = self._full[b.index] = torch.empty(n, dtype=dtype, device=self.ctx.device)
            for p, off in zip(b.params, b.offsets):
                p.data = full[off:off + local_numel(p)].view(p.global_local_shape)
            self.buckets.attach(b)   # fp32 gradients can be views of the bucket's buffer now
        else:   # freed after an earlier use this step: the same storage, and views, again
            full.untyped_storage().resize_(nbytes)
        if self._fp8_amax is not None and not self._exporting and self._fp8_elements(b):
            works, keep, finish = self._gather_fp8(b, full, prefetch)
        else:
            COUNTER.record("all_gather", self.axis.name, nbytes)
            keep, finish = self._fill_shard(b), None
            works = [all_gather_single(full, keep, group=self.axis.param_group, async_op=prefetch)]
        self.gathered.add(nbytes)
        if prefetch:
            self._inflight[b.index] = (works, keep, finish)   # keep the inputs alive until done
        elif finish is not None:
            finish()

    # -- FP8 all-gather ---------------------------------------------------------------------
    def _pieces(self, b: BucketLayout, r: int) -> list[tuple[nn.Parameter, int, int, int]]:
        """``(param, offset, lo, hi)``: the elements ``[lo, hi)`` of bucket ``b`` in rank
        ``r``'s shard, parameter by parameter in bucket order."""
        lo_r, hi_r = r * b.shard, (r + 1) * b.shard
        out = []
        for p, off in sorted(zip(b.params, b.offsets), key=lambda t: t[1]):
            lo, hi = max(off, lo_r), min(off + local_numel(p), hi_r)
            if lo < hi:
                out.append((p, off, lo, hi))
        return out

    def _fp8_elements(self, b: BucketLayout) -> int:
        """Elements of bucket ``b`` that are FP8 GEMM weights (the plan's ``Bucket.fp8``)."""
        return sum(local_numel(p) for p in b.params if id(p) in self._fp8_index)

    def _fp8_scales(self) -> None:
        """Once per step, before the first gather: each FP8 weight's amax over the whole
        weight, the max of its dp shards' amaxes (one fp32 per weight, all-reduced over dp:
        the plan's ``fp8_amax``; then over tp, the plan's ``fp8_amax_tp``, as runtime/fp8.py's tensorwise
        scales of tp-sharded weights), from the 16-bit shards the gathers send, so each
        weight's scale is the one the one-process run casts it with."""
        amax = torch.zeros(len(self.fp8_params), dtype=torch.float32, device=self.ctx.device)
        for b in self.buckets.buckets:
            mine, lo_own = None, self._own_lo(b)
            for p, _off, lo, hi in self._pieces(b, self.axis.index):
                k = self._fp8_index.get(id(p))
                if k is None:
                    continue
                mine = self._fill_shard(b) if mine is None else mine
                amax[k] = torch.maximum(amax[k], mine[lo - lo_own:hi - lo_own].detach().abs().float().amax())
        COUNTER.record("all_reduce", self.axis.name, nbytes(amax))
        if self.axis.size > 1 and self.axis.group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.axis.group)
        tp = self.ctx.tp
        if tp.size > 1 and tp.group is not None:
            COUNTER.record("all_reduce", tp.name, nbytes(amax))   # the plan's fp8_amax_tp step collective
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
        self._fp8_amax = amax
        self._fp8_sinv = [cast_with_amax(amax.new_zeros(0), amax[k])[1] for k in range(len(self.fp8_params))]

    def _gather_fp8(self, b: BucketLayout, full: torch.Tensor, prefetch: bool):
        """zero 3 with FP8 all-gather: bucket ``b`` in two all-gathers of the sizes of
        :func:`parcompile.core.buckets.fp8_gather_elements`: this rank's pieces of FP8
        weights cast to E4M3 with their weight's step scale (:meth:`_fp8_scales`), as bytes,
        and the other pieces in the parameters' dtype. Returns ``(works, inputs, finish)``;
        ``finish`` unpacks them: each FP8 weight's E4M3 copy and inverse scale on the
        parameter (``fp8_gathered``, what runtime/fp8.py's GEMMs use, not cast again) and
        its dequantized values in ``full`` (the 16-bit view), the rest into ``full``."""
        d, dtype, dev = self.axis.size, full.dtype, self.ctx.device
        n8, n16 = fp8_gather_elements(b.elements, self._fp8_elements(b), d)
        mine, lo_own = self._fill_shard(b), self._own_lo(b)
        m8 = torch.zeros(n8, dtype=torch.uint8, device=dev)
        m16 = torch.zeros(n16, dtype=dtype, device=dev)
        c8 = c16 = 0
        for p, _off, lo, hi in self._pieces(b, self.axis.index):
            vals, k = mine[lo - lo_own:hi - lo_own], self._fp8_index.get(id(p))
            if k is None:
                m16[c16:c16 + hi - lo] = vals
                c16 += hi - lo
            else:
                m8[c8:c8 + hi - lo] = cast_with_amax(vals, self._fp8_amax[k])[0].view(torch.uint8)
                c8 += hi - lo
        f8 = torch.empty(n8 * d, dtype=torch.uint8, device=dev)
        f16 = torch.empty(n16 * d, dtype=dtype, device=dev)
        COUNTER.record("all_gather", self.axis.name, nbytes(f8))
        works = [all_gather_single(f8, m8, group=self.axis.param_group, async_op=prefetch)]
        if n16:
            COUNTER.record("all_gather", self.axis.name, nbytes(f16))
            works.append(all_gather_single(f16, m16, group=self.axis.param_group, async_op=prefetch))

        # the E4M3 copies, allocated with the buffer (held from the launch, as it is)
        w8 = {id(p): torch.empty(p.global_local_shape, dtype=E4M3, device=dev)
              for p in b.params if id(p) in self._fp8_index}
        held = sum(nbytes(t) for t in w8.values())   # beside the buffer (the plan's zero3_gather)
        self.gathered.add(held - self._fp8_held.get(b.index, 0))
        self._fp8_held[b.index] = held

        def finish() -> None:
            for r in range(d):
                a8, a16 = r * n8, r * n16
                for p, off, lo, hi in self._pieces(b, r):
                    if id(p) in w8:
                        w8[id(p)].view(-1)[lo - off:hi - off] = f8[a8:a8 + hi - lo].view(E4M3)
                        a8 += hi - lo
                    else:
                        full[lo:hi] = f16[a16:a16 + hi - lo]
                        a16 += hi - lo
            for p, off in zip(b.params, b.offsets):
                if id(p) in w8:
                    t8, sinv = w8[id(p)], self._fp8_sinv[self._fp8_index[id(p)]]
                    p.fp8_gathered = (t8, sinv)
                    full[off:off + t8.numel()] = (t8.float().view(-1) * sinv).to(dtype)

        return works, (m8, m16, f8, f16), finish

    def _wait(self, b: BucketLayout) -> None:
        works, _, finish = self._inflight.pop(b.index)
        for work in works:
            work.wait()
        if finish is not None:
            finish()

    def _release_bucket(self, b: BucketLayout) -> None:
        """zero 3: free bucket ``b``'s gathered buffer (its storage; the views stay)."""
        if b.index in self._inflight:
            self._wait(b)
        full = self._full.get(b.index)
        if full is not None and full.untyped_storage().nbytes() > 0:
            self.gathered.add(-full.untyped_storage().nbytes())
            full.untyped_storage().resize_(0)
        for p in b.params:
            if id(p) in self._fp8_index:
                p.fp8_gathered = None
        self.gathered.add(-self._fp8_held.pop(b.index, 0))

    def _free_params(self) -> None:
        for works, _, _ in self._inflight.values():
            for work in works:
                work.wait()
        self._inflight.clear()
        for p in self.fp8_params:
            p.fp8_gathered = None
        for held in self._fp8_held.values():
            self.gathered.add(-held)
        self._fp8_held.clear()
        for p in self.params:
            if not hasattr(p, "global_local_shape"):
                p.global_local_shape = tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for full in self._full.values():
            self.gathered.add(-full.untyped_storage().nbytes())
        self._full.clear()

    @property
    def zero3_gathered_peak(self) -> int:
        """zero 3: the most bytes of gathered parameter buffers held at once since the
        step began (the plan's ``zero3_gather`` buffer); 0 otherwise."""
        return self.gathered.peak if self.sharding.shards_parameters else 0

    def gather_for_export(self) -> None:
        """Rebuild full parameters outside the measured step (checkpoints, verify dumps)."""
        if self.sharding.shards_parameters:
            enabled, COUNTER.enabled = COUNTER.enabled, False
            self._exporting = True   # the 16-bit weights themselves, not their E4M3 casts
            try:
                self._all_gather_params()
            finally:
                COUNTER.enabled = enabled
                self._exporting = False

    def dump_gradients(self) -> dict:
        """The data-parallel-averaged full gradients with their layout (verify's first-step
        dump), rebuilt by all-gathers that are not counted as the step's traffic."""
        saved = [main_grad(p) for p in self.params]
        self.full_gradients()
        out = shards(self.model, self.ctx, grads=True)
        for p, g in zip(self.params, saved):
            set_main_grad(p, g)
        return out

    def full_gradients(self) -> None:
        """Set every parameter's gradient to the full data-parallel-averaged gradient,
        all-gathered (not counted as step traffic) from the owned slices."""

        def fill(b: BucketLayout, mine: torch.Tensor) -> None:
            mine.copy_(self._grad_shards[b.index])

        for b, full in zip(self.buckets.buckets, self._gather(fill, torch.float32, counted=False)):
            for p, off in zip(b.params, b.offsets):
                shape = getattr(p, "global_local_shape", tuple(p.shape))
                set_main_grad(p, full[off:off + local_numel(p)].view(shape).clone())

    # -- checkpoints ----------------------------------------------------------------------
    def export_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Optimizer states gathered into their parameter's layout, by ``id(param)`` (an
        all-gather per state and bucket over dp_cp, not counted as step traffic)."""
        d = self.axis.size
        keys = sorted({k for *_, seg in self.segments for k, v in self.optimizer.state.get(seg, {}).items()
                       if torch.is_tensor(v) and v.dim() > 0})
        if self.mixed:
            keys.append("master")
        if dist.is_initialized() and self.axis.group is not None:   # every rank needs the same keys
            found = [None] * d
            dist.all_gather_object(found, keys, group=self.axis.group)
            keys = sorted(set().union(*map(set, found)))
        out: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in self.params}
        for key in keys:
            def fill(b: BucketLayout, mine: torch.Tensor, key=key) -> None:
                lo_own = self._own_lo(b)
                for p, lo, hi, seg in self._segments_of(b):
                    v = seg.data if key == "master" else self.optimizer.state.get(seg, {}).get(key)
                    if v is not None:
                        mine[lo - lo_own:hi - lo_own] = v.reshape(-1).float()

            for b, full in zip(self.buckets.buckets, self._gather(fill, torch.float32, counted=False)):
                for p, off in zip(b.params, b.offsets):
                    shape = getattr(p, "global_local_shape", tuple(p.shape))
                    out[id(p)][key] = full[off:off + local_numel(p)].view(shape).clone()
        return out

    def import_states(self, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """Restore the owned slices of what :meth:`export_states` wrote (any sharding)."""
        with torch.no_grad():
            for b, p, lo, hi, seg in self.segments:
                off = self.buckets.offset_of[id(p)]
                st = states.get(id(p), {})
                part = slice(lo - off, hi - off)
                if "master" in st:
                    seg.data.copy_(st["master"].reshape(-1)[part])
                elif self.mixed or self.sharding.shards_parameters:
                    seg.data.copy_(p.data.reshape(-1)[part].float())
                rest = {k: v.reshape(-1)[part].clone() for k, v in st.items() if k != "master"}
                if rest:
                    self.optimizer.state[seg] = {"step": torch.tensor(float(step)), **rest}
        if self.sharding.shards_parameters:
            self._keep_low_shards()
            self._free_params()

    # -- measurement ----------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters, gradients, optimizer states."""
        params = sum(p.data.numel() * p.element_size() for p in self.params)
        segs = sum(seg.numel() * seg.element_size() for *_, seg in self.segments)
        segs += sum(pad.numel() * pad.element_size() for *_, pad in self.padding)
        if self.low_shards is not None:         # zero 3, 16-bit: the kept 16-bit slices
            params += sum(t.numel() * t.element_size() for t in self.low_shards)
        if self.mixed:
            masters = segs                      # fp32 master slices: an optimizer state
        else:
            masters, params = 0, params + (segs if self.sharding.shards_parameters else 0)
        grads = self.buckets.buffer_bytes()   # zero 1: the full (padded) buffers; 2, 3: none
        grads += sum(g.numel() * g.element_size() for g in self._grad_shards or [])
        optimizer = masters + sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optimizer}


class GatherMeter:
    """Bytes of ZeRO-3 gathered parameter buffers held now (``now``) and at most since
    :meth:`reset` (``peak``); one per pipeline rank, shared by its sharded parts."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def reset(self) -> None:
        self.peak = self.now


def head_reads_embedding(model: nn.Module) -> bool:
    """The stage's LM head reads its embedding table (tied embeddings on one pipeline rank;
    :func:`parcompile.core.buckets.head_reads_embedding`)."""
    emb, head = getattr(model, "embedding", None), getattr(model, "head_weight", None)
    return emb is not None and callable(head) and bool(getattr(model, "has_last", False)) and head() is emb.weight


class LayerGather:
    """ZeRO-3 just-in-time gathering (module docstring; the rule is
    :mod:`parcompile.core.buckets`), driven by hooks on the stage's units: its decoder
    layers (``model.layers``, chunks ``model.chunks``) and, with ``per_microbatch``
    (``pp = 1``; :func:`parcompile.core.buckets.reshard_after_forward`), the embedding
    (``model.embedding``) and the output layer (``model.final_norm``, whose forward starts
    it). Units are visited in forward order (:func:`parcompile.core.buckets.unit_position`).

    - before a unit's forward: free the embedding's buckets if the unit follows it (freed
      here, not after the embedding module, because the learned positions are added after
      it), gather the buckets containing the unit (waiting for a prefetch in flight), then
      prefetch those of the next unit of the chunk (asynchronous, so it runs while this
      unit computes: FSDP's forward prefetch);
    - ``per_microbatch``: after a unit's forward, free the buckets it ends (in forward
      order), except at the chunk's last unit (the output layer), whose buckets are kept
      for its backward, which follows at once; a hook on the gradient of that unit's output
      prefetches the unit before it for the backward; a hook on the gradient of each unit's
      input, complete once the unit's backward has run, frees the buckets whose first unit
      read by the backward it is, gathers those of the unit before it and prefetches the one
      before that (FSDP's backward prefetch). The embedding's backward reads the token ids
      only: a bucket of the embedding alone is not gathered for the backward
      (:func:`parcompile.core.buckets.needed_in_backward`). A rank so holds the buckets
      of two neighbouring units at most, as the plan counts
      (:func:`parcompile.core.buckets.zero3_gathered`); a tied embedding's bucket (the
      LM head reads it too) is gathered at the step's start and kept;
    - otherwise (``pp > 1``) layer buckets are gathered before their first layer and stay
      gathered for the step, the others from the step's start, all freed when their
      gradients are final (:meth:`ShardedOptimizer._release_bucket` on the bucket's launch).

    Recomputation runs a layer's forward again inside the backward: its pre-hook finds the
    buckets gathered (or gathers them); nothing is prefetched, freed or hooked from inside
    a backward.

    Args:
        model: the stage (``layers``: ModuleDict by layer id; ``chunks``: layer ids per
            chunk; ``embedding``, ``final_norm``, ``head_weight()`` where it has them).
        parts: the stage's ZeRO-3 optimizers (dense, and experts with expert_dp > 1).
        per_microbatch: free buckets after every forward and backward.
    """

    def __init__(self, model: nn.Module, parts: list[ShardedOptimizer], per_microbatch: bool):
        self.per_microbatch = per_microbatch
        emb, out = unit_position("embedding"), unit_position("output")
        tied = per_microbatch and head_reads_embedding(model)
        self.of_pos: dict[tuple, list] = {}       # unit -> buckets containing it (forward)
        self.of_pos_bwd: dict[tuple, list] = {}   # unit -> buckets its backward reads
        self.ends: dict[tuple, list] = {}         # unit -> buckets whose last unit it is
        self.bwd_starts: dict[tuple, list] = {}   # unit -> buckets whose first unit read by the backward it is
        meter = GatherMeter()
        for part in parts:
            part.gathered = meter
            for b in part.buckets.buckets:
                if not zero3_just_in_time(b, per_microbatch, tied):
                    continue
                part.just_in_time.add(b.index)
                pos = bucket_positions(b)
                for at in pos:
                    self.of_pos.setdefault(at, []).append((part, b))
                self.ends.setdefault(pos[-1], []).append((part, b))
                if needed_in_backward(b):
                    back = [at for at in pos if at != emb]
                    for at in back:
                        self.of_pos_bwd.setdefault(at, []).append((part, b))
                    self.bwd_starts.setdefault(back[0], []).append((part, b))
        self.emb = emb
        self.prev: dict[tuple, tuple] = {}
        self.next: dict[tuple, tuple] = {}
        self.chunk_last: set[tuple] = set()
        chunks = getattr(model, "chunks", None) or []
        has_emb = per_microbatch and getattr(model, "has_first", True) and hasattr(model, "embedding")
        has_out = per_microbatch and getattr(model, "has_last", True) and hasattr(model, "final_norm")
        for c, ids in enumerate(chunks):
            order = [unit_position(f"layers.{i}") for i in ids]
            if c == 0 and has_emb:
                order.insert(0, emb)
            if c == len(chunks) - 1 and has_out:
                order.append(out)
            self.prev.update({b: a for a, b in zip(order, order[1:])})
            self.next.update({a: b for a, b in zip(order, order[1:])})
            if order:
                self.chunk_last.add(order[-1])
        for name, layer in model.layers.items():
            at = unit_position(f"layers.{name}")
            layer.register_forward_pre_hook(functools.partial(self._pre, at))
            layer.register_forward_hook(functools.partial(self._post, at))
        if has_emb:
            model.embedding.register_forward_pre_hook(functools.partial(self._pre, emb))
        if has_out:
            model.final_norm.register_forward_pre_hook(functools.partial(self._pre, out))
            model.final_norm.register_forward_hook(functools.partial(self._post, out))

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _gather(self, at: tuple | None, prefetch: bool = False, backward: bool = False) -> None:
        for part, b in (self.of_pos_bwd if backward else self.of_pos).get(at, ()) if at is not None else ():
            part._gather_bucket(b, prefetch)

    @staticmethod
    def _release(pairs) -> None:
        for part, b in pairs:
            part._release_bucket(b)

    def _pre(self, at: tuple, module: nn.Module, args) -> None:
        if self._in_backward():   # recomputation: the unit's buckets are gathered for its backward
            self._gather(at, backward=True)
            return
        if self.per_microbatch and self.prev.get(at) == self.emb:
            self._release(self.ends.get(self.emb, ()))
        self._gather(at)
        self._gather(self.next.get(at), prefetch=True)
        x = args[0] if args else None
        if self.per_microbatch and torch.is_tensor(x) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(functools.partial(self._after_backward, at))

    def _post(self, at: tuple, module: nn.Module, args, out) -> None:
        if not self.per_microbatch or self._in_backward():
            return
        backward_follows = torch.is_tensor(out) and out.requires_grad and torch.is_grad_enabled()
        if at in self.chunk_last and backward_follows:   # kept for its backward, which follows at once
            out.register_hook(functools.partial(self._before_backward, at))
        else:
            self._release(self.ends.get(at, ()))

    def _before_backward(self, at: tuple, grad: torch.Tensor) -> None:
        self._gather(at, backward=True)
        self._gather(self.prev.get(at), prefetch=True, backward=True)

    def _after_backward(self, at: tuple, grad: torch.Tensor) -> None:
        self._release(self.bwd_starts.get(at, ()))
        before = self.prev.get(at)
        self._gather(before, backward=True)
        self._gather(self.prev.get(before), prefetch=True, backward=True)


# --------------------------------------------------------------------------- experts


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "expert", False)


def has_experts(model: nn.Module) -> bool:
    return any(is_expert(p) for p in model.parameters())


class _Holder(nn.Module):
    """A module view over some of a model's parameters (the dense or the expert ones)."""

    def __init__(self, params):
        super().__init__()
        self.held = nn.ParameterList(params)


class MoEOptimizer:
    """The optimizer of a stage holding expert weights: dense parameters as usual
    (replicated, or ZeRO over dp_cp), expert parameters over expert_dp (replicated, or
    ZeRO-sharded over expert_dp: their states are ``sum ceil(n_b / expert_dp)`` per rank
    over their gradient buckets, as the plan's memory counts them). Each part reduces its
    gradients in its own buckets (:class:`parcompile.runtime.buckets.GradBuckets`), expert
    sums scaled by ``1 / (dp * cp)`` (module docstring). Same interface as
    :class:`ReplicatedOptimizer`.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, train: dict, sharding: DataParallelSharding,
                 bucket_size: int = 0, sequence_parallel: bool = False, reduce_dtype: str = "fp32"):
        self.model, self.ctx = model, ctx
        params = [p for p in model.parameters()]
        self.dense_params = [p for p in params if not is_expert(p)]
        self.expert_params = [p for p in params if is_expert(p)]
        mk = lambda groups: make_optimizer(groups, train)  # noqa: E731
        wd = train["weight_decay"]
        chunks = getattr(model, "chunks", None)
        dense, experts = _Holder(self.dense_params), _Holder(self.expert_params)
        if sharding.sharded:
            # FP8 all-gather: the dense FP8 weights, found on the model's layers (fp8_weight_ids)
            self.dense = ShardedOptimizer(dense, ctx, sharding, wd, mk, bucket_size, sequence_parallel, chunks,
                                          reduce_dtype=reduce_dtype, fp8_all_gather=bool(train.get("fp8_all_gather")),
                                          fp8_model=model)
        else:
            self.dense = ReplicatedOptimizer(dense, ctx, train, bucket_size, sequence_parallel, chunks)
        expert_sharding = sharding.experts(ctx.axes["expert_dp"].size)
        self.expert_sharded = expert_sharding.sharded
        expert_scale = 1.0 / ctx.axes["dp_cp"].size   # summed over expert_dp, averaged over dp * cp
        if self.expert_sharded:
            # the sharded optimizer reduces over its context's dp_cp axis: give it expert_dp
            ectx = dataclasses.replace(ctx, axes={**ctx.axes, "dp_cp": ctx.axes["expert_dp"]})
            self.experts = ShardedOptimizer(experts, ectx, expert_sharding, wd, mk, bucket_size, False, chunks, expert_scale,
                                            reduce_dtype=reduce_dtype)
        else:
            self.experts = ReplicatedOptimizer(experts, ctx, train, bucket_size, False, chunks,
                                               ctx.axes["expert_dp"], expert_scale)
        self.parts = (self.dense, self.experts)

    @property
    def grad_sync(self):
        """Both parts' gradient buckets, told when a chunk's last backward runs."""
        return GradSync([self.dense.buckets, self.experts.buckets])

    def bucket_report(self) -> list[dict]:
        return self.dense.bucket_report() + self.experts.bucket_report()

    @property
    def full_grad_bytes(self) -> int:
        """ZeRO 2, 3: the full gradient buffers of both parts, each part's most held at once
        during the step, summed (each part waits for its own reduce-scatters; the plan's
        ``grad_buckets_in_flight`` sums the kinds alike)."""
        return sum(o.full_grad_bytes for o in self.parts)

    @property
    def zero3_gathered_peak(self) -> int:
        """ZeRO-3: the most gathered parameter bytes held at once this step (the sharded
        parts share one meter, so either part's peak is the stage's)."""
        return max(o.zero3_gathered_peak for o in self.parts)

    def zero_grad(self) -> None:
        for o in self.parts:
            o.zero_grad()

    def set_lr(self, lr: float) -> None:
        for o in self.parts:
            o.set_lr(lr)

    def begin_step(self) -> None:
        for o in self.parts:
            o.begin_step()

    def reduce_gradients(self) -> None:
        self.dense.reduce_gradients()
        self.experts.reduce_gradients()

    @property
    def scaler(self):
        """The dense part's dynamic loss scaler (fp16; None otherwise), which checkpoints keep."""
        return self.dense.scaler

    @property
    def loss_scale(self) -> float:
        """The dense part's loss scale (fp16; 1 otherwise), shared by the expert gradients."""
        return self.dense.loss_scale

    def unscale(self) -> bool:
        """Unscale expert gradients by the same scale, then the dense part decides (fp16:
        an overflow is detected on the dense gradients only)."""
        scale = self.dense.loss_scale
        if scale != 1.0:
            grads = [seg.grad for *_, seg in self.experts.segments] if self.expert_sharded else \
                [main_grad(p) for p in self.expert_params]
            for g in grads:
                if g is not None:
                    g.div_(scale)
        return self.dense.unscale()

    def export_states(self) -> dict:
        return {**self.dense.export_states(), **self.experts.export_states()}

    def import_states(self, states: dict, step: int) -> None:
        self.dense.import_states(states, step)
        self.experts.import_states(states, step)

    def grad_norm(self) -> torch.Tensor:
        """Dense squares over [dp_cp with ZeRO] and tp, expert squares over [expert_dp with
        ZeRO], ep and expert_tp; their sum over pp."""
        ctx = self.ctx
        dense = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        if hasattr(self.dense, "segments"):
            for *_, seg in self.dense.segments:
                if seg.counts_in_norm:
                    dense += seg.grad.float().pow(2).sum()
            all_reduce(dense, ctx.axes["dp_cp"])
        else:
            for p in self.dense_params:
                g = main_grad(p)
                if g is None or getattr(p, "tied_copy", False):
                    continue
                if getattr(p, "shard_dim", None) is None and ctx.tp.index != 0:
                    continue
                dense += g.float().pow(2).sum()
        all_reduce(dense, ctx.tp)
        expert = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        if self.expert_sharded:
            for *_, seg in self.experts.segments:
                expert += seg.grad.float().pow(2).sum()
            all_reduce(expert, ctx.axes["expert_dp"])
        else:
            for p in self.expert_params:
                if main_grad(p) is not None:
                    expert += main_grad(p).float().pow(2).sum()
        all_reduce(expert, ctx.axes["ep"])
        all_reduce(expert, ctx.axes["expert_tp"])
        total = dense + expert
        all_reduce(total, ctx.pp)
        return total.sqrt()[0]

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        for o in self.parts:
            o.clip(norm, max_norm)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def gather_for_export(self) -> None:
        for o in self.parts:
            o.gather_for_export()

    def dump_gradients(self) -> dict:
        """Full (reduced) gradients of every parameter with their layout, for ``verify``;
        sharded parts are all-gathered without being counted (ShardedOptimizer's rule)."""
        saved = [(p, main_grad(p)) for p in self.dense_params + self.expert_params]
        for o in self.parts:
            if isinstance(o, ShardedOptimizer):
                o.full_gradients()
        out = shards(self.model, self.ctx, grads=True)
        for p, g in saved:
            set_main_grad(p, g)
        return out

    def state_bytes(self) -> dict[str, int]:
        a, b = self.dense.state_bytes(), self.experts.state_bytes()
        return {k: a[k] + b[k] for k in a}


def moe_optimizer(model: nn.Module, ctx: ParallelContext, train: dict, sharding: DataParallelSharding,
                  bucket_size: int = 0,
                  sequence_parallel: bool = False, reduce_dtype: str = "fp32"):
    """:class:`MoEOptimizer` when this rank holds expert weights, else None."""
    return MoEOptimizer(model, ctx, train, sharding, bucket_size, sequence_parallel, reduce_dtype) \
        if has_experts(model) else None



def zero_records(opt, sharding: DataParallelSharding) -> dict[str, int]:
    """What a training step records of the optimizer's ZeRO buffers for ``parcompile verify``
    (``verify._buffer_check``), as the plan's ``sharding`` says: sharded gradients (ZeRO 2,
    3): ``grad_buckets_in_flight``, the most full gradient bucket bytes held at once; sharded
    parameters (ZeRO-3): ``zero3_gathered``, the most gathered parameter bytes held at once.
    Empty for ZeRO 0, 1 (no such buffers: verify checks nothing)."""
    out = {}
    if sharding.shards_gradients:
        out["grad_buckets_in_flight"] = opt.full_grad_bytes
    if sharding.shards_parameters:
        out["zero3_gathered"] = opt.zero3_gathered_peak
    return out


__all__ = [
    "sync_gradients", "sp_replicated", "tp_partial_grads", "grad_norm", "clip_gradients", "make_optimizer", "build_optimizer",
    "ReplicatedOptimizer", "ShardedOptimizer", "LayerGather", "GatherMeter", "MoEOptimizer", "step_optimizer",
    "moe_optimizer", "scaler_for", "unscale_gradients", "set_lr", "shards", "is_expert", "has_experts",
    "head_reads_embedding", "zero_records",
]
