"""The optimizer of a stage holding expert weights (:class:`MoEOptimizer`): a dense part and
an expert part, each replicated or ZeRO-sharded as the plan's
:class:`~parcompile.core.data_parallel.DataParallelSharding` says (experts over
``expert_dp``: :meth:`~parcompile.core.data_parallel.DataParallelSharding.experts`).

**Gradients of expert weights** (:class:`MoEOptimizer`). Every token of the stage is
dispatched from exactly one rank, so summing an expert's local gradient over its ``expert_dp`` replicas gives the sum over all
tokens of the stage of d loss_g / dW, where loss_g is the loss of data-parallel rank g.
The step's loss is the mean over the dp * cp ranks, so expert gradients are all-reduced
over expert_dp and divided by dp * cp (not by expert_dp). The gradient norm counts each
expert shard once: squares summed over expert_dp (when sharded), ep and expert_tp.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.train.buckets import GradSync
from parcompile.runtime.distributed.comm import all_reduce
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.train.grads import main_grad, segment_grad, set_main_grad
from parcompile.runtime.train.optim import ReplicatedOptimizer, local_grad_squares, make_optimizer, shards
from parcompile.runtime.train.zero import ShardedOptimizer


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
    gradients in its own buckets (:class:`parcompile.runtime.train.buckets.GradBuckets`), expert
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
        if self.expert_sharded:   # over expert_sharding.shard_group, expert_dp
            self.experts = ShardedOptimizer(experts, ctx, expert_sharding, wd, mk, bucket_size, False, chunks, expert_scale,
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
            grads = [segment_grad(seg) for *_, seg in self.experts.segments] if self.expert_sharded else \
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
        """Dense squares over [the dense part's shard group with ZeRO] and tp, expert squares
        over [expert_dp with ZeRO], ep and expert_tp; their sum over pp."""
        ctx = self.ctx
        dense = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        if hasattr(self.dense, "segments"):
            for *_, seg in self.dense.segments:
                if seg.counts_in_norm:
                    dense += segment_grad(seg).float().pow(2).sum()
            all_reduce(dense, self.dense.axis)   # the shard group: dp_cp, or HSDP's dp_shard
        else:
            dense = local_grad_squares(self.dense_params, ctx)
        all_reduce(dense, ctx.tp)
        expert = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        if self.expert_sharded:
            for *_, seg in self.experts.segments:
                expert += segment_grad(seg).float().pow(2).sum()
            all_reduce(expert, self.experts.axis)
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


__all__ = ["MoEOptimizer", "moe_optimizer", "is_expert", "has_experts"]
