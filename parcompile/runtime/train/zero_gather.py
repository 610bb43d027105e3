"""ZeRO's parameter all-gathers (:class:`ParamGather`, a part of
:class:`parcompile.runtime.train.zero.ShardedOptimizer`): after the step the updated shards
rebuild the full parameters (``DataParallelSharding.parameter_gather == "after_step"``,
ZeRO 1 and 2), or, with sharded parameters (ZeRO-3, ``"before_use"``), each bucket is
all-gathered where the step needs it and freed after (:class:`LayerGather`'s hooks; the rule
is :mod:`parcompile.core.buckets`), its FP8 weights as E4M3 bytes with ``fp8_all_gather``.
The module docstring of :mod:`parcompile.runtime.train.zero` describes the step.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from parcompile.core.buckets import (bucket_positions, fp8_gather_elements, needed_in_backward, unit_position,
                                     zero3_just_in_time)
from parcompile.runtime.train.buckets import BucketLayout, local_numel
from parcompile.runtime.distributed.comm import COUNTER, all_gather_single, nbytes
from parcompile.runtime.model.fp8 import E4M3, cast_with_amax
from parcompile.runtime.train.offload import HOST


class ParamGather:
    """The parameter all-gathers of :class:`parcompile.runtime.train.zero.ShardedOptimizer` (module
    docstring), a part of it that reads its layout (``buckets``, ``segments``, ``axis``) and
    its ``sharding``; the state it keeps (gathered buffers, prefetches in flight, ZeRO-3's
    16-bit slices, the FP8 weights and scales) is set by :meth:`_init_gather_state`, which
    ``ShardedOptimizer.__init__`` and :class:`parcompile.runtime.train.zero_frozen.FrozenShards`
    call."""

    def _init_gather_state(self, fp8_params: list[nn.Parameter] | None = None) -> None:
        """The all-gathers' state before the first step: no 16-bit slices kept
        (``low_shards`` None), ``offload`` "none" (``parallel.offload``, set by
        :func:`parcompile.runtime.train.offload.offload_optimizer`); zero 3: no bucket gathered
        (``_full``: bucket index -> gathered buffer), none prefetched (``_inflight``: index ->
        (works, inputs, finish)), none gathered just in time yet (``just_in_time``, set by
        :class:`LayerGather`), the bytes of gathered buffers held (``gathered``); FP8
        all-gather: the FP8 GEMMs' weights ``fp8_params`` (their index is their amax's place;
        none: gathers in 16 bits), the step's amaxes and inverse scales (None / empty: not taken
        this step), the bytes of E4M3 copies held per bucket, and no export in progress."""
        self.low_shards: list[torch.Tensor] | None = None
        self.offload = "none"
        self._full: dict[int, torch.Tensor] = {}
        self._inflight: dict[int, tuple] = {}
        self.just_in_time: set[int] = set()
        self.gathered = GatherMeter()
        self.fp8_params: list[nn.Parameter] = list(fp8_params or [])
        self._fp8_index = {id(p): k for k, p in enumerate(self.fp8_params)}
        self._fp8_amax: torch.Tensor | None = None
        self._fp8_sinv: list[torch.Tensor] = []
        self._fp8_held: dict[int, int] = {}
        self._exporting = False

    def _own_lo(self, b: BucketLayout) -> int:
        """The first element of bucket ``b`` this rank owns (its slice: ``b.shard`` elements
        from there, in the shard group's rank order)."""
        return self.axis.index * b.shard

    def _keep_low_shards(self) -> None:
        """zero 3, 16-bit weights: refresh this rank's 16-bit slices from the fp32 masters,
        kept on the device, or in host memory with ``offload = params``
        (:func:`parcompile.runtime.train.offload.offload_optimizer`)."""
        if not self.mixed:
            return
        dtype = self.params[0].dtype
        where = HOST if self.offload == "params" else self.ctx.device
        self.low_shards = []
        for b in self.buckets.buckets:
            mine = torch.zeros(b.shard, dtype=dtype, device=where)
            lo_own = self._own_lo(b)
            for p, lo, hi, seg in self._segments_of(b):
                mine[lo - lo_own:hi - lo_own] = seg.data.view(-1).to(dtype)
            self.low_shards.append(mine)
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
        """This rank's slice of bucket ``b`` in the parameters' dtype (``shard`` elements), on
        the device (with ``offload = params`` copied there from host memory)."""
        if self.low_shards is not None:
            return self.low_shards[b.index].to(self.ctx.device)
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
        the plan's ``fp8_amax``; then over tp, the plan's ``fp8_amax_tp``, as runtime/model/fp8.py's tensorwise
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
        parameter (``fp8_gathered``, what runtime/model/fp8.py's GEMMs use, not cast again) and
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

    def release_all(self) -> None:
        """zero 3: free every bucket gathered just in time (LoRA: a micro-batch's backward
        ended, :class:`LayerGather`)."""
        for b in self.buckets.buckets:
            if b.index in self.just_in_time:
                self._release_bucket(b)

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
            if getattr(self, "frozen_shards", None) is not None:   # LoRA: the frozen weights too
                self.frozen_shards.gather_for_export()


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

    def __init__(self, model: nn.Module, parts: list, per_microbatch: bool):
        self.per_microbatch = per_microbatch
        emb, out = unit_position("embedding"), unit_position("output")
        tied = per_microbatch and head_reads_embedding(model)
        self.of_pos: dict[tuple, list] = {}       # unit -> buckets containing it (forward)
        self.of_pos_bwd: dict[tuple, list] = {}   # unit -> buckets its backward reads
        self.ends: dict[tuple, list] = {}         # unit -> buckets whose last unit it is
        self.bwd_starts: dict[tuple, list] = {}   # unit -> buckets whose first unit read by the backward it is
        meter = GatherMeter()
        #: LoRA's frozen weights (:class:`parcompile.runtime.train.zero_frozen.FrozenShards`): the
        #: first adapted layer's input needs no gradient, so no hook frees its buckets (frozen
        #: and adapters) after its backward; they are freed when the micro-batch's backward ends
        #: (FSDP2's post-backward final callback)
        self.frozen = [part for part in parts if getattr(part, "frozen", False)]
        self.parts = parts
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
        self.emb, self.out = emb, out
        #: the output layer's buckets kept after its forward without a backward (evaluation
        #: under no_grad): the LM head reads its weight after ``final_norm``'s forward hook,
        #: so they are freed at the next unit's forward instead
        self.out_held = False
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
        if self.out_held:
            self._release(self.ends.get(self.out, ()))
            self.out_held = False
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
        elif at == self.out:   # the head's matmul follows this hook: freed at the next forward
            self.out_held = True
        else:
            self._release(self.ends.get(at, ()))

    def _before_backward(self, at: tuple, grad: torch.Tensor) -> None:
        self._gather(at, backward=True)
        self._gather(self.prev.get(at), prefetch=True, backward=True)
        if self.frozen:   # LoRA: free what no hook freed once the backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._release_all)

    def _release_all(self) -> None:
        for part in self.parts:
            part.release_all()

    def _after_backward(self, at: tuple, grad: torch.Tensor) -> None:
        self._release(self.bwd_starts.get(at, ()))
        before = self.prev.get(at)
        self._gather(before, backward=True)
        self._gather(self.prev.get(before), prefetch=True, backward=True)


__all__ = ["ParamGather", "GatherMeter", "LayerGather", "head_reads_embedding"]
