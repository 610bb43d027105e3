"""ZeRO over the data-parallel group: :class:`ShardedOptimizer`, the optimizer of a stage
whose plan shards its optimizer states (and gradients, and parameters) over ``dp_cp``, as
the plan's :class:`~parcompile.core.data_parallel.DataParallelSharding` says. Its parts,
by concern: the flat-buffer layout and the step (here), the parameter all-gathers
(:class:`parcompile.runtime.train.zero_gather.ParamGather`, with ZeRO-3's just-in-time
:class:`~parcompile.runtime.train.zero_gather.LayerGather`), the checkpoints and measurements
(:class:`parcompile.runtime.train.zero_states.ShardStates`); each reads ``self.sharding``.

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
   rest of the backward (:class:`parcompile.runtime.train.buckets.GradBuckets`), giving each
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
all-gathers run on a group of their own (:attr:`parcompile.runtime.distributed.context.Axis.param_group`).

fp32 models update their parameters in place through views (no master copy); the
optimizer's states are then 8 bytes per owned element (Adam), as SPEC accounts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.train.buckets import BucketedReduction, BucketLayout, GradBuckets, local_numel
from parcompile.runtime.distributed.comm import COUNTER, all_gather_single, all_reduce, nbytes
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.train.grads import (enable_main_grads, optimizer_grad, segment_grad, set_main_grad,
                                            set_segment_grad)
from parcompile.runtime.train.optim import fp8_weight_ids, scaler_for, set_lr, tp_partial_grads, unscale_gradients
from parcompile.runtime.train.zero_gather import ParamGather
from parcompile.runtime.train.zero_states import ShardStates


class ShardedOptimizer(ParamGather, ShardStates, BucketedReduction):
    """The optimizer of a stage under ``zero`` 1, 2 or 3 (see module docstring).

    ``make_optimizer(groups)`` builds the torch optimizer from parameter groups
    (``[{"params": [...], "weight_decay": wd}, ...]``); the groups hold this rank's
    segments of the parameters (one segment per parameter and bucket that overlaps the
    owned slice), so the update of every element equals the unsharded optimizer's.
    ``bucket_size``, ``sequence_parallel``, ``chunks`` and ``grad_scale`` (default 1/d) are
    :class:`ReplicatedOptimizer`'s; ``reduce_dtype``
    (``parallel.reduce_dtype``): the dtype of the buckets reduce-scattered per micro-batch
    (zero 2, 3; :class:`parcompile.runtime.train.buckets.GradBuckets`). ``fp8_all_gather``
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
        self.axis = ctx.axes[sharding.shard_group]   # dp_cp (expert_dp for experts), or HSDP's shard group
        # HSDP: the group the shards are replicated over, their gradients all-reduced over it
        self.replicas = ctx.axes[sharding.replicate_group] if sharding.replicate > 1 else None
        self.sequence_parallel = sequence_parallel
        self.params = [p for p in model.parameters()]
        enable_main_grads(model)
        self.scaler = scaler_for(self.params)
        self.mixed = self.params[0].dtype != torch.float32
        d = self.axis.size
        self.buckets = GradBuckets(self.params, chunks if chunks is not None else getattr(model, "chunks", None),
                                   self.axis, bucket_size, sharded=True,
                                   scale=grad_scale if grad_scale is not None else 1.0 / (d * sharding.replicate),
                                   per_microbatch=sharding.per_microbatch, reduce_dtype=reduce_dtype)
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
        self.padding = self._padding_segments()
        no_decay += [pad for _b, _lo, pad in self.padding]
        # FP8 all-gather: the FP8 GEMMs' weights, gathered as E4M3 bytes
        fp8w = fp8_weight_ids(fp8_model if fp8_model is not None else model) if fp8_all_gather and zero3 else set()
        self._init_gather_state([p for p in self.params if id(p) in fp8w])
        #: zero 2, 3: the most bytes of full gradient buffers the step held at once (the
        #: plan's ``grad_buckets_in_flight``; ``full_grads`` when reduced once per step)
        self.full_grad_bytes = 0
        if zero3:
            self.buckets.on_launch = self._release_bucket   # gradients final: no further use
        self.optimizer = make_optimizer([{"params": decay, "weight_decay": weight_decay},
                                         {"params": no_decay, "weight_decay": 0.0}])
        self._grad_shards: list[torch.Tensor] | None = None
        self.frozen_shards = None   # LoRA, zero 3: the frozen weights' (runtime/train/zero_frozen.py)
        if zero3:
            self._keep_low_shards()
            self._free_params()

    def _padding_segments(self) -> list[tuple[BucketLayout, int, nn.Parameter]]:
        """The owned slice of each bucket past its last element (padding to ``ceil(n / d) * d``):
        ``(bucket, first element, zero fp32 segment)``, a segment with optimizer states of its
        own, so that every rank holds ``ceil(n / d)`` elements of sharded state, as DeepSpeed's
        padded partitions do and the plan counts; its gradient is the (zero) padding of the
        reduce-scatter output."""
        out = []
        for b in self.buckets.buckets:
            lo_own, hi_own = self.axis.index * b.shard, (self.axis.index + 1) * b.shard
            lo = max(b.elements, lo_own)
            if lo < hi_own:
                out.append((b, lo, nn.Parameter(torch.zeros(hi_own - lo, dtype=torch.float32, device=self.ctx.device))))
        return out

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            set_main_grad(p, None)
        for *_, seg in self.segments:
            set_segment_grad(seg, None)
        self._grad_shards = None
        self.buckets.reset()

    def begin_step(self) -> None:
        """Before the first forward of a step (zero 3): start from shards only, then gather
        the buckets not gathered just in time (:class:`LayerGather`: with ``pp > 1`` the
        embedding's and the output layer's, with ``pp = 1`` a tied embedding's)."""
        if self.sharding.shards_parameters:
            if self.frozen_shards is not None:   # LoRA: the frozen weights' shards (runtime/train/zero_frozen.py)
                self.frozen_shards.free()
            self._free_params()
            self.gathered.reset()
            if self.fp8_params:
                self._fp8_scales()
            for b in self.buckets.buckets:
                if b.index not in self.just_in_time:
                    self._gather_bucket(b)
            if self.frozen_shards is not None:
                self.frozen_shards.begin_step()

    def reduce_gradients(self) -> None:
        """Finish the buckets' reduce-scatters, attach the owned slices to the segments,
        run the model-parallel sums on them."""
        self._grad_shards = self.buckets.finish()
        if self.replicas is not None:   # HSDP: reduce-scattered over the shard group, summed over the replicas
            for g in self._grad_shards:
                all_reduce(g, self.replicas)
        for b, p, lo, hi, seg in self.segments:
            lo_own = self._own_lo(b)
            set_segment_grad(seg, optimizer_grad(self._grad_shards[b.index][lo - lo_own:hi - lo_own].view(seg.shape)))
        for b, lo, pad in self.padding:
            set_segment_grad(pad, optimizer_grad(self._grad_shards[b.index][lo - self._own_lo(b):]))
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
                flat[at:at + hi - lo] = segment_grad(seg).reshape(-1)
            all_reduce(flat, axis)
            for b, p, lo, hi, seg in mine:
                at = start[id(p)] + lo - self.buckets.offset_of[id(p)]
                segment_grad(seg).reshape(-1).copy_(flat[at:at + hi - lo])

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
                sq += segment_grad(seg).float().pow(2).sum()
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
            set_segment_grad(seg, None)
        for *_, pad in self.padding:
            set_segment_grad(pad, None)
        if self.sharding.shards_parameters:
            self._keep_low_shards()
            self._fp8_amax = None   # the weights changed: the next step takes new scales
        if not self.sharding.shards_gradients:
            self._grad_shards = None   # zero 1 keeps full gradients; the slices were scratch copies
        if self.sharding.shards_parameters:
            self._free_params()
            if self.frozen_shards is not None:
                self.frozen_shards.free()
        else:
            self._all_gather_params()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    # -- the flat buffers -------------------------------------------------------------------
    def _segments_of(self, b: BucketLayout):
        return [(p, lo, hi, seg) for bb, p, lo, hi, seg in self.segments if bb is b]
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


__all__ = ["ShardedOptimizer"]
