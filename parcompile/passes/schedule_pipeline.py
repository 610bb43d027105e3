"""``schedule-pipeline``: the action list of every pipeline rank, checked by the simulator.

The schedules and the simulator are :mod:`parcompile.core.schedule` (re-exported here for
existing importers). The pass times each model chunk with the estimate's compute-time
model, :func:`parcompile.analysis.estimate.chunk_times` (one model: the zero-bubble order,
the simulated ``in_flight`` and the timeline use the times the estimate simulates the
same action lists with).
"""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.analysis.comm import comm_report
from parcompile.analysis.gemm import gemm_pricer
from parcompile.analysis.compute import compute_report
from parcompile.analysis.estimate import chunk_times
from parcompile.analysis.lora import frozen_backward, with_adapter_collectives
from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.analysis.memory import saved_bytes, unlike_chunk_bytes
from parcompile.core.attention import attention_engine
from parcompile.core.groups import rank_groups
from parcompile.core.schedule import SUPPORTED, ScheduleError, ScheduleReport, SimResult, build_actions, simulate
from parcompile.ir.graph import Graph
from parcompile.passes.base import PassContext
from parcompile.passes.results import ScheduleResult

__all__ = ["SUPPORTED", "ScheduleError", "ScheduleReport", "ScheduleResult", "SimResult", "build_actions",
           "simulate", "SchedulePipeline"]


@dataclass(frozen=True)
class SchedulePipeline:
    """Build and simulate the schedule; returns a
    :class:`~parcompile.passes.results.ScheduleResult`: the :class:`ScheduleReport` and the
    reports it timed the chunks with (:func:`parcompile.analysis.cost.analyze` reuses them). Runs after ``insert-collectives`` (the chunk times include the
    tensor-, context- and expert-parallel collectives on each chunk's critical path).

    ``1f1b`` and ``zero_bubble`` with ``virtual_stages > 1`` are a rule of the checks table
    (``frontend/checks.py: _check_schedule``); an unchecked config that has them fails in
    :func:`~parcompile.core.schedule.build_actions` (a ``PassError`` naming this pass).
    """

    name: str = "schedule-pipeline"

    def apply(self, graph: Graph, ctx: PassContext) -> ScheduleResult:
        cfg = ctx.cfg
        par = cfg.parallel
        m = par.num_microbatches
        comp = compute_report(graph, ctx.degrees, par.pp * par.virtual_stages, cfg.model.vocab,
                              cfg.model.padded_vocab(par.tp), m, par.recompute, cfg.cluster.engine,
                              attention_engine(cfg.cluster), fp8=fp8_enabled(cfg), gemm=gemm_pricer(cfg))
        comm = comm_report(graph, ctx.degrees, m, par.recompute, par.pp, *frozen_backward(cfg, graph))
        comm = with_adapter_collectives(cfg, ctx.degrees, comm, m, graph)   # LoRA's tp collectives
        f, b, w = chunk_times(cfg, ctx.degrees, rank_groups(par), comp, comm).per_chunk()
        # zero-bubble orders by F, the input-gradient part of B, and W
        sched = par.pipeline_schedule
        actions = build_actions(sched, par.pp, m, par.virtual_stages,
                                times=(f, [bi - wi for bi, wi in zip(b, w)], w), group=par.microbatch_group_size)
        sim = simulate(actions, f, b, par.pp, par.virtual_stages, m, wgrad_time=w,
                       chunk_bytes=_unlike(graph, cfg, ctx.degrees), placement=sched.placement)
        return ScheduleResult(ScheduleReport(par.schedule, m, actions, sim, f, b, w), comp, comm)



def _unlike(graph: Graph, cfg, degrees) -> tuple[int, ...] | None:
    """:func:`~parcompile.analysis.memory.unlike_chunk_bytes` of the graph's saved bytes
    (read only where a rank's chunks are unlike)."""
    par = cfg.parallel
    if par.virtual_stages == 1:
        return None
    saved = saved_bytes(graph, degrees, par.pp * par.virtual_stages, par.recompute, cfg.model.dropout > 0,
                        cfg.cluster.engine, attention_engine(cfg.cluster), fp8=fp8_enabled(cfg))
    return unlike_chunk_bytes(cfg, saved)
