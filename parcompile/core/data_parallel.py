"""Data-parallel sharding: what a training step shards over its data-parallel ranks, as one
value (:class:`DataParallelSharding`) that the ``shard-data-parallel`` pass sets on the plan
and that the analyses, the search, the exports, codegen and the runtime optimizer read,
instead of each branching on the ZeRO stage integer. Standard library only (the ground
floor, :mod:`parcompile.core`).

**ZeRO stages** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5; DeepSpeed's ``zero_optimization.stage``; the spec's
``parallel.zero``): stage 1 shards the optimizer states (fp32 masters included), stage 2
also the gradients, stage 3 also the parameters (FSDP's ``FULL_SHARD``, FSDP2's
``fully_shard``), each over the *shard group*; stage 0 shards nothing (DDP).

**Replicate x shard** (HSDP): the data-parallel ranks form a 2-D mesh of ``replicate`` x
``shard`` ranks; states are sharded over the shard group and replicated over the replicate
group (the spec's ``parallel.dp_replicate`` / ``dp_shard``). torchtitan names the two degrees ``data_parallel_replicate_degree`` and
``data_parallel_shard_degree`` with ``dp_replicate * dp_shard * cp * tp * pp ==
world_size`` (torchtitan 0.3.0, ``torchtitan/distributed/parallel_dims.py``
``ParallelDims._validate`` and ``build_mesh``'s ``dp_replicate`` / ``fsdp`` dims, the
``fsdp`` dim folding ``dp_shard`` and ``cp`` together as parcompile's ``dp_cp`` does);
FSDP2's ``fully_shard`` takes a 2-D mesh for HSDP, sharding over the 2nd dim and
replicating over the 1st (placements ``(Replicate(), Shard(0))``; PyTorch 2.13,
``torch/distributed/fsdp/_fully_shard/_fully_shard.py``, commit
cf30153c4c131c8164ee7798e5022d810682e2cb). Its gradient step is a reduce-scatter over the
shard group followed by an all-reduce of the shards over the replicate group. With
``dp_replicate = 1`` the shard group is all of ``dp_cp``; otherwise the plan has the groups
``dp_shard`` (``dp_shard * cp`` consecutive members of a ``dp_cp`` group: inside a node when
it fits) and ``dp_replicate`` (every ``dp_shard * cp``-th member: across nodes)
(:func:`parcompile.core.groups.rank_groups`).

Expert weights (MoE) are replicated over ``expert_dp`` only, so they are sharded over
that group (:meth:`DataParallelSharding.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.core.schedule import as_schedule

@dataclass(frozen=True)
class DataParallelSharding:
    """What is sharded over which data-parallel group (module docstring).

    Attributes:
        stage: the ZeRO stage, 0-3 (``parallel.zero``).
        shard: ranks of the shard group (``dp * cp`` for dense weights, ``expert_dp`` for
            expert weights); 1: nothing is split, whatever the stage.
        replicate: ranks of the replicate group (HSDP); 1 today.
        per_microbatch: gradient buckets are reduce-scattered in every micro-batch's
            backward (stage >= 2, except the zero-bubble schedule, which reduces once per
            step; :func:`data_parallel_sharding`).
        shard_group: the process group the states are sharded over (``dp_cp``, HSDP's
            ``dp_shard``, or ``expert_dp``; :mod:`parcompile.core.axes`).
        replicate_group: the group they are replicated over (None while ``replicate`` is 1).

    Raises:
        ValueError: a stage outside 0-3, a degree below 1, ``replicate > 1`` without a
            ``replicate_group``, or ``per_microbatch`` below stage 2.
    """

    stage: int = 0
    shard: int = 1
    replicate: int = 1
    per_microbatch: bool = False
    shard_group: str = "dp_cp"
    replicate_group: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.stage!r} is not one of 0, 1, 2, 3")
        if self.shard < 1 or self.replicate < 1:
            raise ValueError(f"data-parallel degrees must be >= 1, not shard {self.shard}, "
                             f"replicate {self.replicate}")
        if self.replicate > 1 and not self.replicate_group:
            raise ValueError("replicate > 1 needs the replicate group's name (replicate_group)")
        if self.per_microbatch and not self.shards_gradients:
            raise ValueError(f"per_microbatch reduction needs sharded gradients (stage >= 2), not stage {self.stage}")

    # -- which states are sharded ---------------------------------------------------------
    @property
    def shards_optimizer_states(self) -> bool:
        """Optimizer states (and fp32 master weights) are split over the shard group (ZeRO-1)."""
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are kept only as this rank's shard between micro-batches (ZeRO-2)."""
        return self.stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters are kept only as this rank's shard and all-gathered where used (ZeRO-3)."""
        return self.stage >= 3

    @property
    def sharded(self) -> bool:
        """Something is split over more than one rank: the step runs a sharded optimizer
        (``stage >= 1`` and ``shard > 1``); otherwise every rank holds all states."""
        return self.stage >= 1 and self.shard > 1

    @property
    def size(self) -> int:
        """Ranks of the whole data-parallel group, ``replicate * shard``."""
        return self.replicate * self.shard

    # -- what the step runs ---------------------------------------------------------------
    @property
    def gradient_reduction(self) -> str:
        """The collective each gradient bucket is reduced with over the shard group:
        ``all_reduce`` (stage 0) or ``reduce_scatter``."""
        return "reduce_scatter" if self.shards_optimizer_states else "all_reduce"

    @property
    def parameter_gather(self) -> str | None:
        """When parameters are all-gathered over the shard group: ``after_step`` (stages 1
        and 2: the updated shards rebuild the full parameters), ``before_use`` (stage 3:
        bucket by bucket where the step needs them, :mod:`parcompile.core.buckets`), or
        None (stage 0)."""
        return None if not self.shards_optimizer_states else "before_use" if self.shards_parameters else "after_step"

    def experts(self, expert_dp: int) -> "DataParallelSharding":
        """The same stage for expert weights, sharded over ``expert_dp`` (module docstring)."""
        return replace(self, shard=max(1, expert_dp), shard_group="expert_dp", replicate=1, replicate_group=None)


def data_parallel_sharding(par, stage: int | None = None) -> DataParallelSharding:
    """The :class:`DataParallelSharding` of a layout ``par`` (a ``ParallelConfig``: reads
    ``zero``, ``dp``, ``cp``, ``dp_replicate`` and ``schedule``), for the dense weights over ``dp_cp``
    (HSDP: sharded over ``dp_shard``, replicated over ``dp_replicate``); the one
    rule the pass sets on the plan and the search applies to layouts it has no graph of.
    ``stage``: this ZeRO stage instead of ``par.zero`` (the search's bounds price a probe's
    layout at other stages).

    Gradients are reduce-scattered per micro-batch from stage 2 on, except under a schedule
    that splits the backward (:attr:`parcompile.core.schedule.Schedule.split_backward`: the
    zero-bubble one), whose B actions write the norms' gradients of every layer of a chunk
    before its W actions complete them (:mod:`parcompile.core.buckets`, "When gradients are
    reduced")."""
    z = par.zero if stage is None else stage
    replicate = getattr(par, "dp_replicate", 1)
    hsdp = dict(replicate=replicate, shard_group="dp_shard", replicate_group="dp_replicate") if replicate > 1 else {}
    return DataParallelSharding(stage=z, shard=par.dp * par.cp // replicate,
                                per_microbatch=z >= 2 and not as_schedule(par.schedule).split_backward, **hsdp)


def shard_degree(degrees) -> int:
    """Ranks the dense states are sharded over, from a degrees map (``parallel_degrees``:
    ``dp_cp`` and, with HSDP, ``dp_replicate``): ``dp_cp / dp_replicate``, the ``dp_shard``
    group's size (all of ``dp_cp`` without HSDP). What the analyses read instead of
    ``dp_cp`` wherever a size is a shard count."""
    return degrees["dp_cp"] // degrees.get("dp_replicate", 1)


__all__ = ["DataParallelSharding", "data_parallel_sharding", "shard_degree"]
