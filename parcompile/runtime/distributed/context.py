"""The process groups of one rank, built from a plan's `groups` (Megatron-Core rank order).

Generated programs create one :class:`ParallelContext` at start-up. With a world of one
process (the single-process reference) no process group is created and every collective
is skipped, so the same program runs in-process without torchrun.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parcompile.core.axes import GROUP_AXES as AXES  # every group of a plan, in creation order
from parcompile.core.process import PROCESS_GROUP_TIMEOUT_S, die_with_parent
from parcompile.core.schedule import LOOP, Placement, lookup
from parcompile.runtime.machine.device import choose_backend  # the device type's backend and device (runtime/machine/device.py)


@dataclass
class Axis:
    """This rank's group along one mesh axis.

    ``ranks`` are global ranks in group order; ``index`` is this rank's position in it
    (the axis rank); ``group`` is the torch process group, or None when ``size == 1`` or
    when running without torch.distributed. ``gather_group`` is a second group of the
    same ranks (ZeRO-3 parameter all-gathers on ``dp_cp`` and ``expert_dp``), or None.
    """

    name: str
    ranks: list[int]
    index: int
    group: object | None = None
    gather_group: object | None = None

    @property
    def param_group(self) -> object | None:
        """The group ZeRO-3 all-gathers parameters over: their own communicator, so they
        never interleave with the gradient reduce-scatters in flight on ``group`` (which
        start in an order the router can change; FSDP likewise keeps them apart)."""
        return self.gather_group if self.gather_group is not None else self.group

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelContext:
    """Where this rank sits in the plan: its axes, its pipeline stage and its device.

    Attributes: ``rank``/``world_size`` (global), ``axes`` (name -> :class:`Axis`),
    ``stage`` (pipeline rank, = ``axes["pp"].index``), ``device`` and ``backend``;
    ``placement``: which pipeline rank holds each model chunk (the plan's schedule's,
    :func:`plan_placement`).
    """

    rank: int
    world_size: int
    axes: dict[str, Axis]
    device: torch.device
    backend: str | None
    distributed: bool = False
    extra: dict = field(default_factory=dict)
    owns_world: bool = True   # False: a batch launcher (runtime.batch) holds the default group
    groups: list = field(default_factory=list)   # the process groups this plan created on this rank
    placement: Placement = LOOP

    def axis(self, name: str) -> Axis:
        return self.axes[name]

    @property
    def tp(self) -> Axis:
        return self.axes["tp"]

    @property
    def pp(self) -> Axis:
        return self.axes["pp"]

    @property
    def dp(self) -> Axis:
        return self.axes["dp"]

    @property
    def stage(self) -> int:
        return self.axes["pp"].index

    @property
    def num_stages(self) -> int:
        return self.axes["pp"].size

    def is_first_stage(self) -> bool:
        return self.stage == 0

    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


def plan_placement(plan: dict) -> Placement:
    """The placement of ``plan``'s pipeline schedule (plan.json ``schedule.name``,
    :func:`parcompile.core.schedule.lookup`); ``loop`` for a plan without one (serving).

    Raises:
        ValueError: a schedule name this version does not know (a plan from another
            version: its ranks would otherwise talk to the wrong peers)."""
    name = (plan.get("schedule") or {}).get("name")
    return LOOP if name is None else lookup(name).placement


def _find(groups: list[list[int]], rank: int) -> list[int]:
    for g in groups:
        if rank in g:
            return list(g)
    return [rank]


#: the axes ZeRO-3 all-gathers parameters over, which get a second group (Axis.gather_group)
GATHER_AXES = ("dp_cp", "expert_dp", "dp_shard")   # dp_shard: HSDP's shard groups


def init_parallel(plan: dict, force_cpu: bool = False, timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
                  device: str = "cuda", gather_groups: bool = False) -> ParallelContext:
    """Create the process groups of ``plan["groups"]`` and return this rank's context.

    ``device`` is the plan's device type (``cuda``, ``npu``, ``cpu``: see
    :func:`parcompile.runtime.machine.device.choose_backend`); process
    groups time out after ``timeout_s`` seconds, so a dead rank ends the job instead of
    hanging it. ``gather_groups`` (ZeRO-3) adds a second group for each of
    :data:`GATHER_AXES` (:attr:`Axis.param_group`). Under torchrun (``WORLD_SIZE`` > 1) this initialises torch.distributed; every rank
    creates every group of every axis in the same order, as torch requires. Outside
    torchrun the plan must have a world size of 1.

    A rank started by torchrun (``TORCHELASTIC_RUN_ID`` set) first asks to be killed when
    torchrun dies (:func:`parcompile.core.process.die_with_parent`): torch starts each rank in a
    session of its own, so nothing else would end it when torchrun is killed.

    Raises:
        RuntimeError: the plan's world size differs from the launched one.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    planned = int(plan["world_size"])
    if world != planned:
        raise RuntimeError(
            f"the plan needs world_size={planned} processes but {world} were launched; "
            f"run it with: torchrun --nproc-per-node {planned} ..."
        )
    backend, device = choose_backend(force_cpu, device)
    groups = plan["groups"]
    if world == 1:
        axes = {name: Axis(name, [0], 0, None) for name in AXES}
        return ParallelContext(0, 1, axes, device, None, distributed=False, placement=plan_placement(plan))
    owns_world = not dist.is_initialized()   # else a batch launcher holds it (runtime.batch)
    if owns_world:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    axes: dict[str, Axis] = {}
    made: list = []   # this rank's groups, freed by shutdown when the world is not ours
    for name in AXES:
        lists = groups.get(name) or [[r] for r in range(world)]
        mine = _find(lists, rank)
        # every rank takes part in creating every group (torch's rule)
        pg = None
        if any(len(g) > 1 for g in lists):
            cur, _ = dist.new_subgroups_by_enumeration([list(g) for g in lists], backend=backend)
            pg = cur if len(mine) > 1 else None
            made.append(cur)
        axes[name] = Axis(name, mine, mine.index(rank), pg)
    if gather_groups:
        for name in GATHER_AXES:
            lists = groups.get(name) or [[r] for r in range(world)]
            if any(len(g) > 1 for g in lists):
                cur, _ = dist.new_subgroups_by_enumeration([list(g) for g in lists], backend=backend)
                made.append(cur)
                if axes[name].size > 1:
                    axes[name].gather_group = cur
    return ParallelContext(rank, world, axes, device, backend, distributed=True,
                           owns_world=owns_world, groups=made, placement=plan_placement(plan))


def shutdown(ctx: ParallelContext) -> None:
    """Tear down cleanly (see DESIGN: drop tensors, gc, barrier, then destroy)."""
    if not ctx.distributed:
        return
    import gc

    gc.collect()
    try:
        dist.barrier()
    finally:
        if ctx.owns_world:
            dist.destroy_process_group()
        else:   # the world belongs to a batch launcher: free only the groups this plan made
            for pg in ctx.groups:
                if pg is not None:
                    dist.destroy_process_group(pg)
