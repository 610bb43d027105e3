"""The pass pipeline: the passes in order, how one is applied, and the graph compiled
through them with its analyses.

The driver (:mod:`parcompile.driver`) compiles the chosen layout with it; the search
(:mod:`parcompile.layout_search`) probes and costs candidate layouts with it. It sits below both,
so neither imports the other's module to run a pass.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Iterator

from parcompile.analysis.cost import CostReport, analyze
from parcompile.ir.fp8 import graph_fp8
from parcompile.config.schema import SpecConfig
from parcompile.diagnostics import Diagnostic, SpecError
from parcompile.ir.graph import Graph
from parcompile.ir.lower import lower
from parcompile.ir.types import ShardingError
from parcompile.ir.verify import verify
from parcompile.passes.base import Pass, PassContext, PassError
from parcompile.passes.insert_collectives import InsertCollectives
from parcompile.passes.schedule_pipeline import SchedulePipeline
from parcompile.passes.shard_data_parallel import ShardDataParallel
from parcompile.passes.shard_experts import ShardExperts
from parcompile.passes.shard_tensor_parallel import ShardTensorParallel
from parcompile.passes.results import PassResults
from parcompile.passes.split_pipeline_stages import SplitPipelineStages

PASSES: tuple[Pass, ...] = (
    ShardDataParallel(),
    ShardTensorParallel(),
    ShardExperts(),
    SplitPipelineStages(),
    InsertCollectives(),
    SchedulePipeline(),
)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a compile or a search. They allocate a few
    hundred thousand small, acyclic objects (graph nodes, types, rank lists), each
    allocation burst triggering full collections that scan all of them again (about a
    fifth of a large compile's time); reference counting frees them all the same. The
    collector's previous state is restored on exit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_pass(p: Pass, graph: Graph, ctx: PassContext, check: bool = True) -> PassResults:
    """Apply one pass, record its result in ``ctx.results`` and verify the graph with the
    invariants the results so far switch on (unless ``check`` is false: the search's
    probes, whose passes a real compile of the chosen layout verifies). Returns
    ``ctx.results``.

    Raises:
        SpecError: a sharding the pass cannot make (at the span of the axis' degree).
        PassError: anything else that fails inside the pass (names the pass and the op).
    """
    try:
        ctx.results = ctx.results.add(p.apply(graph, ctx))
        if check:
            verify(graph, ctx.degrees, staged=ctx.results.staged, inserted=ctx.results.inserted)
        return ctx.results
    except SpecError:
        raise
    except ShardingError as e:
        axis = e.axis or "tp"
        raise SpecError([Diagnostic("error", f"{e} (in pass {p.name}, op {ctx.current_op})",
                                    ctx.cfg.span(f"parallel.{axis}"))]) from None
    except Exception as e:
        raise PassError(p.name, ctx.current_op or getattr(e, "op", None), e) from e


@dataclass
class Compiled:
    """A config lowered, run through the passes and analysed (``ctx.results``: the passes'
    results, also :attr:`results`)."""

    graph: Graph
    ctx: PassContext
    cost: CostReport

    @property
    def results(self) -> PassResults:
        return self.ctx.results


def compile_graph(cfg: SpecConfig, schedule: bool = True) -> Compiled:
    """Lower ``cfg`` to the graph of one micro-batch (``ir/lower.py``), verify it, run the
    passes in order (verifying after each) and the analyses (parameters, compute,
    communication, memory, the estimate).

    With ``schedule`` false the pipeline stops before ``schedule-pipeline`` and the
    estimate uses the closed-form pipeline (no action lists: any schedule); the search's
    exact costing and the calibration tests use that.

    Raises:
        SpecError, PassError: as :func:`run_pass`.
    """
    par = cfg.parallel
    ctx = PassContext.of(cfg)
    graph = lower(cfg.model, batch=par.micro_batch * par.dp, origin=cfg.span("model"), serve=cfg.workload == "serve")
    graph.fp8 = graph_fp8(cfg)   # which GEMMs run in FP8 (ir/fp8.py is_fp8_gemm)
    verify(graph, ctx.degrees)
    for p in PASSES:
        if not schedule and p.name == "schedule-pipeline":
            break
        run_pass(p, graph, ctx)
    res = ctx.results
    sched = res.schedule
    cost = analyze(cfg, graph, ctx.degrees, res.chunks, sched.report if sched else None,
                   sched.compute if sched else None, sched.comm if sched else None)
    return Compiled(graph, ctx, cost)


def cost_without_schedule(cfg: SpecConfig) -> CostReport:
    """:func:`compile_graph` without ``schedule-pipeline``: the closed-form estimate."""
    return compile_graph(cfg, schedule=False).cost
