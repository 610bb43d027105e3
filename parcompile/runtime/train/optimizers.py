"""Which optimizer a stage steps with, as the plan's data-parallel sharding
(:class:`~parcompile.core.data_parallel.DataParallelSharding`, the program's
``DP_SHARDING``) says: :func:`step_optimizer`, which generated programs call, and
:func:`zero_records`, what a step records of the sharded buffers for ``verify``.
"""

from __future__ import annotations

import torch.nn as nn

from parcompile.core.buckets import reshard_after_forward
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.train.optim import ReplicatedOptimizer, make_optimizer
from parcompile.runtime.train.offload import offload_optimizer
from parcompile.runtime.train.optim_moe import moe_optimizer
from parcompile.runtime.train.zero import ShardedOptimizer
from parcompile.runtime.train.zero_frozen import FrozenShards
from parcompile.runtime.train.zero_gather import LayerGather


def step_optimizer(model: nn.Module, ctx: ParallelContext, train: dict, sharding: DataParallelSharding,
                   bucket_size: int = 0, sequence_parallel: bool = False, reduce_dtype: str = "fp32",
                   offload: str = "none"):
    """The optimizer of a stage as the plan's data-parallel ``sharding`` says (a
    :class:`~parcompile.core.data_parallel.DataParallelSharding`): replicated, or sharded
    over dp_cp (:attr:`~parcompile.core.data_parallel.DataParallelSharding.sharded`),
    reducing gradients in buckets of ``bucket_size`` fp32 bytes (0: one per chunk, after
    the backward); ``sequence_parallel`` sums tp-replicated gradients over tp;
    ``reduce_dtype`` (``parallel.reduce_dtype``): the dtype the buckets reduce-scattered in
    each micro-batch (sharded gradients) are held and reduced in. With sharded parameters
    buckets are gathered just in time by hooks on the stage's units (:class:`LayerGather`).

    HSDP (``sharding.replicate > 1``): states sharded over ``ctx.axes[sharding.shard_group]``
    and replicated over ``ctx.axes[sharding.replicate_group]``, two groups that split
    ``dp_cp`` (the plan's ``dp_shard`` and ``dp_replicate`` groups, which
    :func:`~parcompile.runtime.distributed.context.init_parallel` creates).

    ``offload`` (``parallel.offload``; the checks require ZeRO): ``optimizer`` steps the
    sharded optimizer's states on the host, ``params`` (zero 3) keeps its parameter shard
    there too (:func:`~parcompile.runtime.train.offload.offload_optimizer`).

    Raises:
        ValueError: ``sharding`` is for another data-parallel group size than this run's
            ``dp_cp`` (a program run with another plan's layout), or names a shard or
            replicate group ``ctx`` does not have.
    """
    if sharding.size != ctx.axes["dp_cp"].size:
        raise ValueError(f"the program's data-parallel sharding (shard {sharding.shard}, replicate "
                         f"{sharding.replicate}) does not match this run's dp_cp group of "
                         f"{ctx.axes['dp_cp'].size} ranks")
    missing = [g for g in (sharding.shard_group, sharding.replicate_group) if g and g not in ctx.axes]
    if missing:
        raise ValueError(f"data-parallel groups {missing} are not among this run's process groups")
    opt = moe_optimizer(model, ctx, train, sharding, bucket_size, sequence_parallel, reduce_dtype)   # experts: over expert_dp
    if opt is None:
        if not sharding.sharded:
            return ReplicatedOptimizer(model, ctx, train, bucket_size, sequence_parallel)
        opt = ShardedOptimizer(model, ctx, sharding, train["weight_decay"], lambda groups: make_optimizer(groups, train),
                               bucket_size, sequence_parallel, reduce_dtype=reduce_dtype,
                               fp8_all_gather=bool(train.get("fp8_all_gather")))
    if offload != "none":   # parallel.offload: states stepped on the host (runtime/train/offload.py)
        for part in getattr(opt, "parts", (opt,)):
            if isinstance(part, ShardedOptimizer):
                offload_optimizer(part, lambda groups: make_optimizer(groups, train), offload)
    parts = [o for o in getattr(opt, "parts", (opt,))
             if isinstance(o, ShardedOptimizer) and o.sharding.shards_parameters]
    base = getattr(model, "base", None)   # LoRA: ``model`` holds the adapters of the stage ``base``
    if parts and base is not None and isinstance(opt, ShardedOptimizer):   # ZeRO-3: the frozen weights sharded too (runtime/train/zero_frozen.py)
        opt.frozen_shards = FrozenShards(base, ctx, sharding, bucket_size)
        parts.append(opt.frozen_shards)
        model = base
    if parts and hasattr(model, "layers"):   # ZeRO-3: buckets gathered just in time
        LayerGather(model, parts, reshard_after_forward(ctx.num_stages))
    return opt

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


__all__ = ["step_optimizer", "zero_records"]
