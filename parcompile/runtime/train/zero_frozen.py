"""ZeRO-3 of LoRA's frozen weights (``train.method = lora`` with ``zero = 3``):
:class:`FrozenShards`, the frozen base weights of a stage sharded over the data-parallel
shard group and all-gathered where the step needs them, as ZeRO-3 gathers trained ones
(:class:`parcompile.runtime.train.zero_gather.ParamGather`, driven by the same
:class:`~parcompile.runtime.train.zero_gather.LayerGather` hooks), but with no fp32 master,
no gradient, no reduce-scatter and no optimizer state: a rank keeps its slice of each
bucket in the weights' dtype, and that slice is what the all-gathers send.

This is FSDP's wrapping of a LoRA model as torchtune's distributed LoRA recipe does it
(pytorch/torchtune recipes/lora_finetune_distributed.py @ 00360f72ac6b68c5d1834992854cb0c2b50b430e,
``_setup_model``: ``fully_shard`` on each ``nn.Linear`` whose weight requires a gradient, the
adapters' ``lora_a``/``lora_b``, then on each ``TransformerDecoderLayer``, whose frozen base
weights it shards, then on the model: embedding and output layer; the frozen weights,
``requires_grad = False``, get no gradient to reduce-scatter and no optimizer state). The
adapters are the stage's :class:`~parcompile.runtime.train.zero.ShardedOptimizer` (zero 3:
sharded with fp32 masters, gradients reduce-scattered, Adam states sharded, gathered per
layer bucket). The frozen buckets are the base model's units (embedding, each decoder layer,
the output layer) partitioned at the plan's ``bucket_size``
(:func:`parcompile.runtime.train.buckets.bucket_layouts`), as the plan prices them
(:func:`parcompile.analysis.lora.frozen_gathers`). A bucket is gathered again for its
backward as ZeRO-3 gathers a trained one; whatever is still gathered when a micro-batch's
backward ends is freed then (FSDP2's post-backward final callback reshards what no hook
did: the first layer, whose input needs no gradient).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.train.buckets import BucketLayout, bucket_layouts
from parcompile.runtime.train.zero_gather import ParamGather


class _Layout:
    """The buckets of :class:`FrozenShards` where ParamGather reads ``buckets.buckets``; no
    gradient buffer to attach a gathered bucket to."""

    def __init__(self, buckets: list[BucketLayout]):
        self.buckets = buckets

    def attach(self, b: BucketLayout) -> None:
        """Nothing: frozen weights have no gradient."""


class FrozenShards(ParamGather):
    """The frozen parameters of ``model`` (those without ``lora``) sharded over
    ``ctx.axes[sharding.shard_group]`` (module docstring); ``chunks``: layer ids per local
    chunk (``model.chunks``); ``bucket_size``: the plan's, in fp32 bytes."""

    frozen = True

    def __init__(self, model: nn.Module, ctx: ParallelContext, sharding: DataParallelSharding, bucket_size: int):
        self.ctx, self.sharding = ctx, sharding
        self.axis = ctx.axes[sharding.shard_group]
        self.params = [p for p in model.parameters() if not getattr(p, "lora", False)]
        self.buckets = _Layout(bucket_layouts(self.params, getattr(model, "chunks", None), self.axis.size,
                                              bucket_size))
        self.mixed = False
        self._init_gather_state()
        self.low_shards = []   # this rank's slice of each bucket, in the weights' dtype
        for b in self.buckets.buckets:
            mine = torch.zeros(b.shard, dtype=self.params[0].dtype, device=ctx.device)
            lo_own, hi_own = self._own_lo(b), self._own_lo(b) + b.shard
            for p, off in zip(b.params, b.offsets):
                lo, hi = max(off, lo_own), min(off + p.numel(), hi_own)
                if lo < hi:
                    mine[lo - lo_own:hi - lo_own] = p.data.view(-1)[lo - off:hi - off]
            self.low_shards.append(mine)
        self._free_params()

    def free(self) -> None:
        """Keep the shards only (after the step, and before the next)."""
        self._free_params()

    def begin_step(self) -> None:
        """Before a step's first forward: shards only, then the buckets not gathered just
        in time (:meth:`parcompile.runtime.train.zero.ShardedOptimizer.begin_step`)."""
        self._free_params()
        for b in self.buckets.buckets:
            if b.index not in self.just_in_time:
                self._gather_bucket(b)

    def shard_bytes(self) -> int:
        """Bytes of the frozen weights this rank keeps between steps: its slices."""
        return sum(t.numel() * t.element_size() for t in self.low_shards)


__all__ = ["FrozenShards"]
